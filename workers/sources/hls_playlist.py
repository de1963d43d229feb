"""HLS playlists (RFC 8216) as an ingest reads them, and which segment to read next.

`parse_playlist` reads a master or media playlist. `SegmentTracker` decides,
playlist after playlist, what to read so that a segment is never read twice and
nothing is replayed:

- It follows media sequence numbers, not URIs (ffmpeg reuses `live0.ts` after
  a restart): a segment is new when its number is at or past the next one due.
- The first playlist starts near the live edge: `start_segments` from its end
  (1: the newest segment). The HLS default of three target durations is for
  players that must never stall; here a stall is filled with noise, and every
  segment of head start is a segment of delay (7.2 s behind the encoder with
  ffmpeg's 2 s segments, issue 14). A VOD playlist is read from its start.
- Sequence numbers that jump ahead (segments gone before they were read) or go
  back (a restarted encoder) are a gap. A restarted playlist that is still young
  (at most `start_segments + 2` segments: the restart was seen within about two
  segments) is read from its first segment, so the encoder's first words after
  its return are kept (the reader lets the older ones out at once); an older one
  from the live edge. A playlist that stops advancing for `stall_after` target durations
  is stalled (the encoder is gone or stuck), once, until it advances again.
- `#EXT-X-ENDLIST` ends the source once its last segment is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urljoin


class PlaylistError(ValueError):
    """Not a playlist this reader can follow; the message says why."""


@dataclass(frozen=True, slots=True)
class Segment:
    seq: int
    uri: str
    duration_s: float
    discontinuity: bool = False
    init_uri: str | None = None  # EXT-X-MAP (fragmented MP4)


@dataclass(frozen=True, slots=True)
class Variant:
    uri: str
    bandwidth: int
    audio_group: str | None


@dataclass(frozen=True, slots=True)
class Playlist:
    target_duration_s: float = 0.0
    media_sequence: int = 0
    segments: tuple[Segment, ...] = ()
    ended: bool = False
    vod: bool = False
    variants: tuple[Variant, ...] = ()
    audio_renditions: dict[str, str] = field(default_factory=dict)  # group → URI (default)

    @property
    def is_master(self) -> bool:
        return bool(self.variants)

    @property
    def last_seq(self) -> int:
        return self.media_sequence + len(self.segments) - 1


def _attributes(text: str) -> dict[str, str]:
    """`A=1,B="x,y"` → {"A": "1", "B": "x,y"}."""
    out: dict[str, str] = {}
    key, value, quoted, reading_key = "", "", False, True
    for ch in text + ",":
        if reading_key:
            if ch == "=":
                reading_key = False
            elif ch != ",":
                key += ch
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            out[key.strip().upper()] = value
            key, value, reading_key = "", "", True
        else:
            value += ch
    return out


def parse_playlist(text: str, base_url: str) -> Playlist:
    """A playlist with every URI made absolute against `base_url`."""
    lines = [line.strip() for line in text.splitlines()]
    if not lines or lines[0].lstrip("\ufeff") != "#EXTM3U":
        raise PlaylistError("not an HLS playlist (no #EXTM3U first line)")
    target = 0.0
    media_seq = 0
    segments: list[Segment] = []
    variants: list[Variant] = []
    renditions: dict[str, str] = {}
    ended = vod = False
    duration: float | None = None
    discontinuity = False
    init_uri: str | None = None
    pending_variant: dict[str, str] | None = None
    for line in lines[1:]:
        if not line:
            continue
        tag, _, rest = line.partition(":")
        if tag == "#EXT-X-TARGETDURATION":
            target = float(rest)
        elif tag == "#EXT-X-MEDIA-SEQUENCE":
            media_seq = int(rest)
        elif tag == "#EXTINF":
            duration = float(rest.split(",", 1)[0])
        elif tag == "#EXT-X-DISCONTINUITY":
            discontinuity = True
        elif tag == "#EXT-X-ENDLIST":
            ended = True
        elif tag == "#EXT-X-PLAYLIST-TYPE":
            vod = rest.strip().upper() == "VOD"
        elif tag == "#EXT-X-MAP":
            uri = _attributes(rest).get("URI")
            init_uri = urljoin(base_url, uri) if uri else None
        elif tag == "#EXT-X-KEY":
            if _attributes(rest).get("METHOD", "NONE").upper() != "NONE":
                raise PlaylistError("encrypted HLS (EXT-X-KEY) is not supported; serve the "
                                    "stream unencrypted to Babelcast")
        elif tag == "#EXT-X-STREAM-INF":
            pending_variant = _attributes(rest)
        elif tag == "#EXT-X-MEDIA":
            attrs = _attributes(rest)
            if attrs.get("TYPE") == "AUDIO" and "URI" in attrs:
                group = attrs.get("GROUP-ID", "")
                if group not in renditions or attrs.get("DEFAULT", "").upper() == "YES":
                    renditions[group] = urljoin(base_url, attrs["URI"])
        elif not line.startswith("#"):
            uri = urljoin(base_url, line)
            if pending_variant is not None:
                variants.append(Variant(uri, int(pending_variant.get("BANDWIDTH", "0") or 0),
                                        pending_variant.get("AUDIO")))
                pending_variant = None
            elif duration is not None:
                segments.append(Segment(media_seq + len(segments), uri, duration,
                                        discontinuity, init_uri))
                duration, discontinuity = None, False
    if not variants and not segments and not ended and target == 0.0:
        raise PlaylistError("an HLS playlist with no segments, variants or target duration")
    return Playlist(target, media_seq, tuple(segments), ended, vod, tuple(variants),
                    renditions)


def pick_audio_playlist(master: Playlist) -> str:
    """The media playlist to read from a master: an audio rendition when the variants
    have one (audio-only, least data), else the variant with the lowest bandwidth
    (every variant carries the same audio)."""
    lowest = min(master.variants, key=lambda v: v.bandwidth)
    if lowest.audio_group and lowest.audio_group in master.audio_renditions:
        return master.audio_renditions[lowest.audio_group]
    return lowest.uri


@dataclass(frozen=True, slots=True)
class Plan:
    """What one playlist load says to do."""

    segments: tuple[Segment, ...] = ()
    gap: str | None = None  # "hls-skipped" or "hls-restart": a hole before `segments`
    stalled: bool = False  # newly stalled (said once per stall)
    ended: bool = False  # ENDLIST and nothing left to read: the source is done
    skipped: int = 0


class SegmentTracker:
    """Media-sequence bookkeeping across playlist loads (and across reconnects)."""

    def __init__(self, start_segments: int = 1, stall_after: float = 2.0) -> None:
        if start_segments < 1:
            raise ValueError("start_segments counts from 1 (the newest segment)")
        self.start_segments = start_segments
        self.stall_after = stall_after
        self.next_seq: int | None = None
        self._last_media_seq: int | None = None
        self._advanced_at = 0.0
        self._stalled = False
        self.segments_read = 0
        self.gaps = 0

    def _live_edge(self, pl: Playlist) -> tuple[Segment, ...]:
        if pl.vod:
            return pl.segments
        return pl.segments[-self.start_segments:] if pl.segments else ()

    def plan(self, pl: Playlist, now: float) -> Plan:
        if pl.is_master:
            raise PlaylistError("a master playlist was given where a media playlist was due")
        restarted = (self._last_media_seq is not None
                     and (pl.media_sequence < self._last_media_seq
                          or (self.next_seq is not None and pl.segments
                              and pl.last_seq < self.next_seq - 1)))
        self._last_media_seq = pl.media_sequence
        gap: str | None = None
        skipped = 0
        if restarted:
            young = len(pl.segments) <= self.start_segments + 2
            todo = pl.segments if young else self._live_edge(pl)
            gap = "hls-restart"
        elif self.next_seq is None:
            todo = self._live_edge(pl)
        else:
            todo = tuple(s for s in pl.segments if s.seq >= self.next_seq)
            first = todo[0].seq if todo else pl.media_sequence
            if todo and first > self.next_seq:
                skipped = first - self.next_seq
                gap = "hls-skipped"
        if gap is not None:
            self.gaps += 1
        stalled = False
        if todo:
            self.next_seq = todo[-1].seq + 1
            self._advanced_at = now
            self._stalled = False
            self.segments_read += len(todo)
        elif self.next_seq is None:
            self.next_seq = pl.media_sequence  # an empty live playlist: wait for its first
            self._advanced_at = now
        elif (not pl.ended and not self._stalled
              and now - self._advanced_at > self.stall_after * max(pl.target_duration_s, 1.0)):
            self._stalled = stalled = True
        ended = pl.ended and (self.next_seq is None or self.next_seq > pl.last_seq)
        return Plan(todo, gap, stalled, ended, skipped)
