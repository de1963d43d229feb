"""Decoding through PyAV: the shared decoder, the pacer, and the network source.

`PyAVDecoder` turns any container PyAV can open into 16 kHz mono PCM16 chunks of
exactly `CHUNK_BYTES` (the last may be shorter). FFmpeg's demux and decode calls
block, so they run in an executor one batch at a time: each call returns as soon
as at least one chunk is ready, which keeps a live source's latency at one chunk
and holds an executor thread only while there is work, so one executor can serve
many streams. Nothing is read ahead of the consumer beyond that one batch.

`Pacer` keeps every source at real time; `PyAVSource` pulls http(s), HLS, RTMP
and RTSP URLs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import av
from av.audio.frame import AudioFrame
from av.container import InputContainer

from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError

CHUNK_BYTES = SAMPLE_RATE // 10 * 2  # 100 ms of PCM16 mono
# A live stream may carry a few corrupt packets (a lost UDP datagram, a bad AAC
# frame); FFmpeg's CLI skips them too. Only a run this long means the input is
# not decodable at all.
_MAX_BAD_PACKETS = 50
_SECRET_QUERY_KEYS = frozenset({"passphrase", "password", "pass", "pwd", "key", "token", "secret"})

# FFmpeg probes a live stream for up to 5 s (FLV and MPEG-TS announce streams late)
# and then releases what it probed in one burst; paced at real time, a burst stays
# as latency for the whole connection. Half a second finds an audio stream.
PROBE_OPTIONS: dict[str, str] = {"analyzeduration": "500000"}

Opener = Callable[[], InputContainer]


class NoAudioError(Exception):
    """The container has no audio stream (or a looped file decodes to nothing)."""


def redact_url(url: str) -> str:
    """The URL with its password and secret query values masked, for operator messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else netloc
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
        masked = [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs]
        query = urlencode(masked, safe="*:/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def describe_av_error(exc: BaseException) -> str:
    """A short reason for an av/OS error, without the URL FFmpeg appends to it."""
    if isinstance(exc, av.ExitError):
        # PyAV's timeout interrupts FFmpeg, which reports it as an exit request.
        return "timed out waiting for data"
    reason = getattr(exc, "strerror", None)
    return str(reason) if reason else type(exc).__name__


LIVE_LEAD_S = 1.0
"""How far ahead of real time a live source may run. What FFmpeg probed at connect
(`PROBE_OPTIONS`), an encoder's send buffer after a reconnect or a TCP backlog
arrives at once: released at once, it is no extra latency and no lost speech
(paced out, it stayed as latency for the whole connection; dropped, as SRT did
with `-fflags nobuffer`, it was the first ~0.5 s of speech after every
reconnect). A sender faster than real time still gets no further ahead."""


class Pacer:
    """Holds a source to real time: a chunk is released once the audio before it has played,
    less `lead_s` (a live source may run that far ahead: `LIVE_LEAD_S`).

    If the consumer falls more than `max_lag_s` behind (a network stall, a slow
    consumer), the schedule is re-based to now instead of bursting the backlog
    out to catch up.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        *,
        rate: int = SAMPLE_RATE,
        max_lag_s: float = 1.0,
        lead_s: float = 0.0,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._rate = rate
        self._max_lag_s = max_lag_s
        self._lead_s = lead_s
        self._start: float | None = None
        self._samples = 0

    async def wait(self, samples: int) -> None:
        """Wait until `samples` more may be yielded, then count them as yielded."""
        now = self._clock()
        if self._start is None:
            self._start = now - self._lead_s
        due = self._start + self._samples / self._rate
        if now - due > self._max_lag_s + self._lead_s:
            self._start = now - self._lead_s - self._samples / self._rate
        elif due > now:
            await self._sleep(due - now)
        self._samples += samples


def _pcm(frame: AudioFrame) -> bytes:
    return frame.to_ndarray().tobytes()


def _pcm_frames(container: InputContainer, skip: int = 0) -> Generator[bytes, None, None]:
    """Blocking: the first audio stream as 16 kHz mono s16 byte strings, without its
    first `skip` samples (16 kHz). A skip seeks near its end first (a restarted ingest
    in the middle of a long file must not decode everything before it), then drops
    what precedes it by the frames' timestamps; a container that cannot seek, or
    frames without timestamps, are decoded from the start and counted instead."""
    if not container.streams.audio:
        raise NoAudioError("has no audio stream")
    stream = container.streams.audio[0]
    origin = float(stream.start_time * stream.time_base) if (
        stream.start_time is not None and stream.time_base) else 0.0
    drop = skip * 2  # bytes still to drop from the output (counting from the start)
    seek_s: float | None = None
    if skip and stream.time_base:
        try:
            container.seek(round((origin + skip / SAMPLE_RATE) / stream.time_base),
                           stream=stream, backward=True)
            seek_s = skip / SAMPLE_RATE
        except (av.FFmpegError, OSError, ValueError):
            seek_s = None  # decoded from the start: `drop` counts
    resampler: av.AudioResampler | None = None
    layout: tuple[str, str, int] | None = None

    def trimmed(outs: Iterable[AudioFrame]) -> Iterator[bytes]:
        """The PCM of resampled frames, less what is still to drop."""
        nonlocal drop
        for out in outs:
            pcm = _pcm(out)
            if drop:
                cut = min(drop, len(pcm))
                pcm, drop = pcm[cut:], drop - cut
            if pcm:
                yield pcm

    bad = 0
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.InvalidDataError:
            bad += 1
            if bad > _MAX_BAD_PACKETS:
                raise
            continue
        bad = 0
        for frame in frames:
            if seek_s is not None:
                if frame.pts is None or not frame.time_base:
                    # No timestamps to trim by: the seek's landing is taken as exact.
                    drop, seek_s = 0, None
                else:
                    t0 = float(frame.pts * frame.time_base) - origin
                    if t0 + frame.samples / frame.sample_rate <= seek_s:
                        continue  # before the resume point (the seek lands before it)
                    drop = max(0, round((seek_s - t0) * SAMPLE_RATE)) * 2
                    seek_s = None
            # PyAV's resampler rejects a frame whose format differs from the first
            # (an HLS variant switch, a new encoder): start a new one instead.
            key = (frame.format.name, frame.layout.name, frame.sample_rate)
            if resampler is None or key != layout:
                if resampler is not None:
                    yield from (_pcm(f) for f in resampler.resample(None))
                resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
                layout = key
            yield from trimmed(resampler.resample(frame))
    if resampler is not None:
        yield from trimmed(resampler.resample(None))


class _PcmReader:
    """Blocking demux → decode → resample → re-chunk; one `read` at a time, any thread.

    Knows where each chunk ends in the container's audio (samples from its start,
    within the current pass of a repeated file), so a file can be opened again there.
    """

    def __init__(self, opener: Opener, *, repeat: bool, start: int = 0) -> None:
        self._opener = opener
        self._repeat = repeat
        self._lock = threading.Lock()
        self._closing = False
        self._container: InputContainer | None = None
        self._frames: Generator[bytes, None, None] | None = None
        self._pass_bytes = 0
        # Where the current pass began in the container (bytes): the resume point for
        # the first pass, 0 for every repeat; and the length of the pass before it.
        self._pass_origin = start * 2
        self._prev_pass_len = 0
        # Kept across a repeat's reopen so a looped file has no short chunk at the seam.
        self._pending = bytearray()

    def read(self) -> tuple[list[tuple[bytes, int]], bool]:
        """Decode until at least one full chunk is ready; returns ([(chunk, end sample
        in the container)], ended)."""
        with self._lock:
            result = self._read_locked()
        if self._closing:
            # close() found us busy and left the closing to us.
            self.close()
        return result

    def close(self) -> None:
        """Close the container now, or as soon as a running `read` returns."""
        self._closing = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_container()
            finally:
                self._lock.release()

    def _end_sample(self, unread_after: int) -> int:
        """The container position of the decoded audio's end less `unread_after` bytes
        (a chunk that straddles a repeat's seam ends in the pass before)."""
        end = self._pass_origin + self._pass_bytes - unread_after
        if end < 0:
            end += self._prev_pass_len
        return end // 2

    def _read_locked(self) -> tuple[list[tuple[bytes, int]], bool]:
        if self._closing:
            return [], True
        while len(self._pending) < CHUNK_BYTES:
            if self._frames is None:
                self._container = self._opener()
                self._frames = _pcm_frames(self._container, self._pass_origin // 2)
                self._pass_bytes = 0
            pcm = next(self._frames, None)
            if pcm is not None:
                self._pending += pcm
                self._pass_bytes += len(pcm)
                continue
            self._close_container()
            if self._repeat:
                if self._pass_bytes == 0 and self._pass_origin == 0:
                    raise NoAudioError("decodes to no audio")  # else we would reopen forever
                # The next pass starts at the container's start (a resume point at or
                # past the end of a looped file yields nothing and starts over).
                self._prev_pass_len = self._pass_origin + self._pass_bytes
                self._pass_origin, self._pass_bytes = 0, 0
                continue
            tail = bytes(self._pending)
            self._pending.clear()
            return ([(tail, self._end_sample(0))] if tail else []), True
        end = len(self._pending) // CHUNK_BYTES * CHUNK_BYTES
        chunks = [(bytes(self._pending[i : i + CHUNK_BYTES]),
                   self._end_sample(len(self._pending) - i - CHUNK_BYTES))
                  for i in range(0, end, CHUNK_BYTES)]
        del self._pending[:end]
        return chunks, False

    def _close_container(self) -> None:
        frames, self._frames = self._frames, None
        container, self._container = self._container, None
        if frames is not None:
            frames.close()
        if container is not None:
            container.close()


class PyAVDecoder:
    """Any PyAV container's first audio stream as 16 kHz mono PCM16 chunks, decoded off the loop.

    Not paced. Raises what PyAV raises (`av.FFmpegError`, `OSError`) and
    `NoAudioError`; sources turn those into `SourceError`. With `repeat` the
    container is reopened at its end and decoding continues seamlessly.
    `position`: samples into the container (within the current pass) at the end of
    the chunk yielded last; `start` (settable): where the next `chunks()` begins.
    """

    def __init__(
        self, opener: Opener, *, executor: Executor | None = None, repeat: bool = False
    ) -> None:
        self._opener = opener
        self._executor = executor
        self._repeat = repeat
        self._reader: _PcmReader | None = None
        self.start = 0
        self.position = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        reader = self._reader = _PcmReader(self._opener, repeat=self._repeat,
                                           start=self.start)
        self.position = self.start
        try:
            while True:
                batch, ended = await loop.run_in_executor(self._executor, reader.read)
                for chunk, end in batch:
                    self.position = end
                    yield chunk
                if ended:
                    return
        finally:
            await self._close(reader)

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._close(self._reader)

    async def _close(self, reader: _PcmReader) -> None:
        # Closing a network container can block (an RTSP TEARDOWN), so it runs in
        # the executor too; if a read is still running there, it closes on its way out.
        await asyncio.get_running_loop().run_in_executor(self._executor, reader.close)


class PyAVSource(AudioSource):
    """A pulled network source (http(s), HLS, RTMP, RTSP) decoded by PyAV's bundled FFmpeg.

    A live source is not supposed to end, so its end is a retryable
    `SourceError`: the ingest host reconnects.
    """

    def __init__(
        self,
        url: str,
        *,
        executor: Executor | None = None,
        open_timeout_s: float = 10.0,
        read_timeout_s: float = 10.0,
    ) -> None:
        self.url = url
        self._timeouts = (open_timeout_s, read_timeout_s)
        self._decoder = PyAVDecoder(self._open, executor=executor)

    def _open(self) -> InputContainer:
        options = dict(PROBE_OPTIONS)
        if self.url.lower().startswith("rtsp"):
            # RTSP over UDP loses packets behind NAT and firewalls; TCP interleaving just works.
            options["rtsp_transport"] = "tcp"
        return av.open(self.url, "r", container_options=options, timeout=self._timeouts)

    async def chunks(self) -> AsyncIterator[bytes]:
        where = f"source {redact_url(self.url)!r}"
        pacer = Pacer(lead_s=LIVE_LEAD_S)
        try:
            async for chunk in self._decoder.chunks():
                await pacer.wait(len(chunk) // 2)
                yield chunk
        except NoAudioError as exc:
            raise SourceError(f"{where} {exc}; check the encoder's audio settings") from None
        except (av.FFmpegError, OSError) as exc:
            raise SourceError(
                f"{where} failed: {describe_av_error(exc)}; "
                "check that the encoder is sending and the URL is reachable"
            ) from exc
        raise SourceError(f"{where} ended; check that the encoder is still sending")

    async def aclose(self) -> None:
        await self._decoder.aclose()
