"""HLS as a live source: follow the playlist, read every segment once, stop at its end.

FFmpeg's HLS demuxer (what `PyAVSource` used) starts three segments behind the
live edge (7.2 s behind the encoder with 2 s segments), reads a finished
playlist again from its first segment after every reconnect (the same
sentences captioned six times a minute), and after an encoder crash replays
stale segments. This reader keeps its own bookkeeping (`hls_playlist`):

- the playlist is reloaded every eighth of a target duration (0.25 s for 2 s
  segments): a new segment is seen soon after the encoder lists it;
- its audio goes out at real time, only `HLS_LEAD_S` ahead: a segment arrives
  every target duration (give or take a reload), so delivery stays smooth and
  never looks like a stall. Letting each segment's first second out at once (the
  lead other live sources get) was faster (bench.ingest, tiny.en, 2 s segments:
  final captions 1.9 s behind the encoder at p50, against 2.8 s) but left ~1 s
  without audio between segments: the stall threshold had to learn it, and
  ingest's clock took the first such pause for a hole (0.9 s of noise in the
  speech of every new stream);
- a playlist that is not there yet (HTTP 404) is polled like a stalled one
  (`idle`), so reading starts within a reload of the first segment's listing;
- segments are fetched with httpx and demuxed one by one with PyAV (MPEG-TS,
  packed audio, fragmented MP4 with its `EXT-X-MAP`) into one decoder that
  lives across segments, so segment seams are seamless; a discontinuity, a gap
  or a restart starts a fresh decoder;
- what it learned (the next media sequence number) survives a reconnect, so a
  playlist server that fails for a while is picked up where it was left.

Events: `gap` (segments skipped or gone, a restarted playlist, a
discontinuity), `idle` (the playlist stopped advancing: the encoder is gone or
stuck). The source ends (returns) after the last segment of an
`#EXT-X-ENDLIST` playlist. Playlist load failures are retryable `SourceError`s.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

import av
import httpx

from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError, SourceEvent, SourceItem
from workers.sources.hls_playlist import (
    Playlist,
    PlaylistError,
    Segment,
    SegmentTracker,
    parse_playlist,
    pick_audio_playlist,
)
from workers.sources.pyav import CHUNK_BYTES, Pacer, describe_av_error, redact_url

HLS_LEAD_S = 0.25
MAX_PLAYLIST_BYTES = 1 << 20
MAX_SEGMENT_BYTES = 64 << 20


def is_hls_url(url: str) -> bool:
    """HTTP(S) URLs whose path ends in .m3u8 (or .m3u) are read as HLS."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.scheme.lower() in ("http", "https") and parts.path.lower().endswith(
        (".m3u8", ".m3u"))


class SegmentDecoder:
    """Segments (bytes) → 16 kHz mono PCM16 chunks, one decoder across segments. Blocking."""

    def __init__(self) -> None:
        self._ctx: Any = None
        self._key: tuple[str, bytes] | None = None
        self._resampler: av.AudioResampler | None = None
        self._layout: tuple[str, str, int] | None = None
        self._pending = bytearray()

    def reset(self) -> list[bytes]:
        """Forget the decoder (a discontinuity); returns the audio it still held."""
        out = self._drain(flush=True)
        self._ctx = self._key = self._resampler = self._layout = None
        return out

    def decode(self, data: bytes) -> list[bytes]:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise SourceError("an HLS segment has no audio stream; check the encoder's "
                                  "audio settings", retryable=False)
            stream = container.streams.audio[0]
            cc = stream.codec_context
            key = (cc.name, bytes(cc.extradata or b""))
            if self._ctx is None or key != self._key:
                self._pending += b"".join(self.reset())
                self._ctx = av.CodecContext.create(cc.name, "r")
                if key[1]:
                    self._ctx.extradata = key[1]
                self._key = key
            for packet in container.demux(stream):
                if packet.size:
                    for frame in self._ctx.decode(packet):
                        self._resample(frame)
        return self._drain(flush=False)

    def _resample(self, frame: Any) -> None:
        layout = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._resampler is None or layout != self._layout:
            if self._resampler is not None:
                for f in self._resampler.resample(None):
                    self._pending += f.to_ndarray().tobytes()
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            self._layout = layout
        for f in self._resampler.resample(frame):
            self._pending += f.to_ndarray().tobytes()

    def _drain(self, *, flush: bool) -> list[bytes]:
        if flush and self._ctx is not None:
            for frame in self._ctx.decode(None):
                self._resample(frame)
            if self._resampler is not None:
                for f in self._resampler.resample(None):
                    self._pending += f.to_ndarray().tobytes()
        end = len(self._pending) // CHUNK_BYTES * CHUNK_BYTES
        if flush:
            end = len(self._pending) // 2 * 2
        chunks = [bytes(self._pending[i : i + CHUNK_BYTES]) for i in range(0, end, CHUNK_BYTES)]
        del self._pending[:end]
        return chunks


class HlsSource(AudioSource):
    """A live (or VOD) HLS playlist over HTTP(S); see the module docstring."""

    gap_reasons = ("hls-missing", "hls-stalled", "hls-restart", "hls-skipped",
                   "hls-discontinuity", "hls-bad-segment")

    def __init__(self, url: str, *, executor: Executor | None = None, start_segments: int = 1,
                 timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.url = url
        self.tracker = SegmentTracker(start_segments)
        self._executor = executor
        self._timeout_s = timeout_s
        self._transport = transport
        self._decoder = SegmentDecoder()
        self._media_url: str | None = None
        self.segments_fetched: list[int] = []
        """Media sequence numbers fetched, in order (tests and benchmarks read it)."""

    def __repr__(self) -> str:
        return f"HlsSource({redact_url(self.url)!r})"

    @property
    def _where(self) -> str:
        return f"HLS source {redact_url(self.url)!r}"

    async def _get(self, http: httpx.AsyncClient, url: str, limit: int) -> httpx.Response:
        resp = await http.get(url)
        if len(resp.content) > limit:
            raise SourceError(f"{self._where}: {redact_url(url)} is over {limit} bytes")
        return resp

    async def _playlist(self, http: httpx.AsyncClient, url: str) -> Playlist | None:
        """The playlist, or None while it is not there (HTTP 404: the encoder has not
        written it yet, or the URL is wrong): polled like a stalled one, so the first
        segment is read within a reload of its listing, not after a reconnect's backoff."""
        try:
            resp = await self._get(http, url, MAX_PLAYLIST_BYTES)
        except httpx.HTTPError as exc:
            raise SourceError(f"{self._where}: cannot load the playlist ({type(exc).__name__}); "
                              "check that the encoder's HTTP server is up") from None
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise SourceError(f"{self._where}: the playlist answered HTTP {resp.status_code}; "
                              "check the URL and that the encoder is writing it")
        try:
            return parse_playlist(resp.text, str(resp.url))
        except (PlaylistError, ValueError) as exc:
            raise SourceError(f"{self._where}: {exc}",
                              retryable=not isinstance(exc, PlaylistError)) from None

    async def _segment(self, http: httpx.AsyncClient, seg: Segment) -> bytes | None:
        """The segment's bytes (init section first), or None when it is gone (404/410)."""
        parts = []
        for url in (seg.init_uri, seg.uri):
            if url is None:
                continue
            try:
                resp = await self._get(http, url, MAX_SEGMENT_BYTES)
            except httpx.HTTPError as exc:
                raise SourceError(f"{self._where}: cannot fetch segment {seg.seq} "
                                  f"({type(exc).__name__})") from None
            if resp.status_code in (404, 410):
                return None
            if resp.status_code != 200:
                raise SourceError(f"{self._where}: segment {seg.seq} answered HTTP "
                                  f"{resp.status_code}")
            parts.append(resp.content)
        return b"".join(parts)

    async def _decode(self, data: bytes) -> list[bytes]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._decoder.decode, data)
        except av.FFmpegError as exc:
            raise _BadSegment(describe_av_error(exc)) from None

    async def chunks(self) -> AsyncIterator[SourceItem]:
        async with httpx.AsyncClient(timeout=self._timeout_s, follow_redirects=True,
                                     transport=self._transport) as http:
            pacer = Pacer(lead_s=HLS_LEAD_S)
            missing_said = False
            poll_s = 0.25
            while True:
                pl = await self._playlist(http, self._media_url or self.url)
                if pl is None:
                    if not missing_said:
                        missing_said = True
                        yield SourceEvent("idle", "hls-missing", (
                            "the playlist is not there (HTTP 404); waiting for the encoder "
                            "to write it: check the URL if it never comes"))
                    await asyncio.sleep(poll_s)
                    continue
                missing_said = False
                if self._media_url is None:
                    if pl.is_master:
                        self._media_url = pick_audio_playlist(pl)
                        continue
                    self._media_url = self.url
                elif pl.is_master:
                    raise SourceError(f"{self._where}: the variant playlist is a master "
                                      "playlist too", retryable=False)
                poll_s = min(1.0, max(0.1, pl.target_duration_s / 8))
                plan = self.tracker.plan(pl, time.monotonic())
                if plan.stalled:
                    yield SourceEvent("idle", "hls-stalled", (
                        f"the playlist has not advanced for "
                        f"{self.tracker.stall_after * pl.target_duration_s:.0f} s; check that "
                        "the encoder is running"))
                if plan.gap is not None:
                    for chunk in self._decoder.reset():
                        yield chunk
                    what = ("the playlist restarted (its media sequence went back)"
                            if plan.gap == "hls-restart" else
                            f"{plan.skipped} segment(s) were gone before they could be read")
                    yield SourceEvent("gap", plan.gap, what)
                    # All but the newest segment are behind already: out at once, then the
                    # newest at the usual pace (so nothing is added to the delay).
                    behind = sum(seg.duration_s for seg in plan.segments[:-1])
                    pacer = Pacer(lead_s=HLS_LEAD_S + behind)
                for seg in plan.segments:
                    async for item in self._read(http, seg, pacer):
                        yield item
                if plan.ended:
                    for chunk in self._decoder.reset():
                        await pacer.wait(len(chunk) // 2)
                        yield chunk
                    return
                await asyncio.sleep(poll_s)

    async def _read(self, http: httpx.AsyncClient, seg: Segment,
                    pacer: Pacer) -> AsyncIterator[SourceItem]:
        if seg.discontinuity:
            for chunk in self._decoder.reset():
                yield chunk
            yield SourceEvent("gap", "hls-discontinuity", f"segment {seg.seq} is a "
                              "discontinuity (the encoder changed or restarted)")
        data = await self._segment(http, seg)
        self.segments_fetched.append(seg.seq)
        if data is None:
            yield SourceEvent("gap", "hls-skipped", f"segment {seg.seq} was gone (HTTP 404) "
                              "before it could be read")
            return
        try:
            chunks = await self._decode(data)
        except _BadSegment as exc:
            for chunk in self._decoder.reset():
                yield chunk
            yield SourceEvent("gap", "hls-bad-segment",
                              f"segment {seg.seq} could not be decoded ({exc})")
            return
        for chunk in chunks:
            await pacer.wait(len(chunk) // 2)
            yield chunk

    async def aclose(self) -> None:
        # Nothing is held between calls: the HTTP client lives inside chunks().
        return None


class _BadSegment(Exception):
    pass
