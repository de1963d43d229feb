"""Live HLS WebVTT: a rolling subtitle playlist per stream and language.

Segment `n` covers stream audio time [n·D, (n+1)·D) for a segment duration D.
Cue times inside segments are stream audio seconds, and every segment carries
`X-TIMESTAMP-MAP=MPEGTS:<mpegts>,LOCAL:00:00:00.000`: audio second 0 is video
PTS `mpegts` (90 kHz ticks), which is 0 when the video packager's clock starts
with the event's audio (set `mpegts` otherwise). A cue that spans a segment
boundary is repeated, with the same identifier and times, in every segment it
overlaps, as HLS players expect.

A segment is published once the stream's audio clock has passed its end by
`delay_s`, so that the finals of its speech (and their translations) have been
published by then. The playlist lists the last `window` published segments.

`HlsTrack` is plain logic; `HlsService` keeps one per (stream, lang) for the
gateway, filled from the caption Stream in Redis on demand.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.outputs.archive import vtt_block
from orchestrator.outputs.cues import Cue, FinalFilter, as_note, final_cues
from workers.bus import RedisBus, caption_from_json, captions_key
from workers.captions.linebreak import WEB, LineProfile
from workers.events import SAMPLE_RATE, CaptionSegment

_SCAN_BATCH = 500


@dataclass(frozen=True, slots=True)
class HlsOptions:
    """Plain options of the live HLS WebVTT output (see `outputs.config.HlsConfig`)."""

    enabled: bool = True
    segment_s: float = 6.0
    window: int = 10
    delay_s: float = 6.0
    mpegts: int = 0
    profile: LineProfile = field(default=WEB)
    # Players poll a live playlist about once a segment; many players of one track share
    # one Redis read per `refresh_s`.
    refresh_s: float = 0.5

    def __post_init__(self) -> None:
        if not (0.5 <= self.segment_s <= 60):
            raise ValueError(f"HLS segment_s must be 0.5..60 seconds, got {self.segment_s}")
        if not (3 <= self.window <= 10_000):
            raise ValueError(f"HLS window must be 3..10000 segments, got {self.window}")
        if self.delay_s < 0:
            raise ValueError(f"HLS delay_s cannot be negative, got {self.delay_s}")
        if not (0 <= self.mpegts < 2**33):
            raise ValueError(f"HLS mpegts must be 0..2^33-1 (90 kHz ticks), got {self.mpegts}")


def timestamp_map(mpegts: int) -> str:
    return f"X-TIMESTAMP-MAP=MPEGTS:{mpegts},LOCAL:00:00:00.000"


class HlsTrack:
    """The cues and clock of one (stream, lang), and its playlist and segments."""

    def __init__(self, options: HlsOptions) -> None:
        self.options = options
        self.clock_s = 0.0
        self.last_seq = 0
        self._cues: list[Cue] = []  # sorted by (start, seq, page)
        self._filter = FinalFilter()

    def add(self, seg: CaptionSegment) -> None:
        self.last_seq = max(self.last_seq, seg.seq)
        seg = as_note(seg)  # a gap event shows as "[N s not captioned]" where it was
        if not self._filter.accept(seg):
            return
        for cue in final_cues(seg, self.options.profile):
            bisect.insort(self._cues, cue, key=lambda c: (c.start_s, c.seq, c.page))
        # Speech that has a final has been heard: the clock is at least its end.
        self.advance(seg.audio_end_s)

    def advance(self, audio_s: float) -> None:
        self.clock_s = max(self.clock_s, audio_s)
        self._prune()

    def last_segment(self) -> int:
        """Index of the newest published segment; -1 before the first one."""
        d = self.options.segment_s
        return math.floor((self.clock_s - self.options.delay_s) / d + 1e-9) - 1

    def first_segment(self) -> int:
        return max(0, self.last_segment() - self.options.window + 1)

    def _prune(self) -> None:
        horizon = self.first_segment() * self.options.segment_s
        if self._cues and self._cues[0].end_s <= horizon:
            self._cues = [c for c in self._cues if c.end_s > horizon]

    def playlist(self, segment_uri: Callable[[int], str]) -> str:
        d = self.options.segment_s
        last = self.last_segment()
        first = self.first_segment()
        lines = [
            "#EXTM3U",
            "#EXT-X-VERSION:3",
            f"#EXT-X-TARGETDURATION:{math.ceil(d)}",
            f"#EXT-X-MEDIA-SEQUENCE:{first}",
        ]
        for n in range(first, last + 1):
            lines += [f"#EXTINF:{d:.3f},", segment_uri(n)]
        return "\n".join(lines) + "\n"

    def segment(self, n: int) -> str | None:
        """Segment `n` as WebVTT; None when it is not in the playlist's window."""
        if not (self.first_segment() <= n <= self.last_segment()):
            return None
        d = self.options.segment_s
        start, end = n * d, (n + 1) * d
        cues = [c for c in self._cues if c.start_s < end and c.end_s > start]
        return ("WEBVTT\n" + timestamp_map(self.options.mpegts) + "\n"
                + "".join(vtt_block(c) for c in cues))


class HlsService:
    """HLS tracks for the gateway, kept up to date from Redis when they are asked for."""

    def __init__(self, bus: RedisBus, options: HlsOptions) -> None:
        self.bus = bus
        self.options = options
        self._tracks: dict[tuple[str, str], tuple[HlsTrack, float]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def track(self, stream: str, lang: str) -> HlsTrack:
        key = (stream, lang)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._tracks.get(key)
            now = time.monotonic()
            if held is not None and now - held[1] < self.options.refresh_s:
                return held[0]
            track = held[0] if held is not None else None
            track = await self._refresh(stream, lang, track)
            self._tracks[key] = (track, now)
            return track

    async def _audio_clock(self, stream: str) -> float:
        pos, _ = await self.bus.last_audio_end(stream)
        return pos / SAMPLE_RATE

    async def _refresh(self, stream: str, lang: str, track: HlsTrack | None) -> HlsTrack:
        latest = await self.bus.last_caption(stream, lang)
        if track is not None and latest is not None and latest.seq < track.last_seq:
            track = None  # the stream's captions started over (a new event)
        if track is None:
            track = HlsTrack(self.options)
            track.advance(await self._audio_clock(stream))
            for seg in await self._recent(stream, lang, track):
                track.add(seg)
        else:
            track.advance(await self._audio_clock(stream))
            while True:
                batch = await self.bus.captions_after(stream, lang, track.last_seq)
                for seg in batch:
                    track.add(seg)
                if len(batch) < 1000:
                    break
        return track

    async def _recent(self, stream: str, lang: str, track: HlsTrack) -> list[CaptionSegment]:
        """The publications a new track needs, oldest first: read backwards from the
        newest until past the start of the playlist's window (a day-long Stream is
        not read whole)."""
        o = self.options
        horizon = (track.first_segment() - 2) * o.segment_s
        key = captions_key(stream, lang)
        out: list[CaptionSegment] = []
        upper = "+"
        while True:
            entries = await self.bus.redis.xrevrange(key, max=upper, min="-",
                                                     count=_SCAN_BATCH)
            oldest_end = math.inf
            for _entry_id, fields in entries:
                try:
                    seg = caption_from_json(fields[b"d"])
                except (KeyError, ValueError, TypeError):
                    self.bus.undecodable += 1
                    continue
                out.append(seg)
                oldest_end = min(oldest_end, seg.audio_end_s)
            if len(entries) < _SCAN_BATCH or oldest_end < horizon:
                break
            last_id = entries[-1][0]
            upper = "(" + (last_id.decode() if isinstance(last_id, bytes) else last_id)
        out.reverse()
        return out
