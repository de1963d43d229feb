"""Operators' encoders, for ingest tests and `bench.ingest`: ffmpeg fed PCM at real time.

An `Encoder` is a real ffmpeg that encodes what a capture card would hand it
(PCM16 16 kHz mono on its stdin, written at wall-clock pace by this process) to
AAC and pushes or serves it over one transport, exactly as an operator's
ffmpeg would. Because this process writes the audio, it knows when each sample
reached the encoder: a caption's delay behind the encoder is its emit time
minus the time its last word reached ffmpeg. The stream's audio clock and the
encoder's are tied by a beep at a known place at the start (`with_beep`).

`Pipeline` is the ingest and ASR hosts of an event (the classes the runtime
wraps in Ray actors), in this process, on a real Redis.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import http.server
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from orchestrator.status import collect
from workers.asr import AsrHost, AsrHostOptions
from workers.bus import RedisBus, audio_key
from workers.engines.base import (
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
    WrappedEngine,
)
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.events import SAMPLE_RATE, AudioChunk, AudioGap, CaptionSegment, StreamOptions
from workers.ingest import IngestHost, IngestHostOptions

BEEP_AT_S = 0.5
"""Where the beep starts in what the encoder is fed (after silence)."""
STREAM_KEY = "bench-key-7f3c"
SRT_PASSPHRASE = "bench-passphrase-42"
CHUNK_S = 0.1

TRANSPORTS = ("hls", "rtmp-push", "rtmp-pull", "srt-listener", "srt-pull")


def with_beep(pcm: bytes) -> bytes:
    """0.5 s of silence, 0.2 s of 1 kHz, 1 s of silence (longer than the engine's 0.6 s
    pause: the beep never shares an utterance with the first words), then `pcm`."""
    t = np.arange(int(0.2 * SAMPLE_RATE)) / SAMPLE_RATE
    beep = (0.5 * 32767 * np.sin(2 * np.pi * 1000 * t)).astype("<i2").tobytes()
    return bytes(int(BEEP_AT_S * SAMPLE_RATE) * 2) + beep + bytes(SAMPLE_RATE * 2) + pcm


def beep_onset(pcm: bytes) -> int | None:
    """The sample where `with_beep`'s beep starts in `pcm` (PCM16); None if it is not in."""
    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, dtype="<i2").astype(np.int32)) > 8000)
    return int(loud[0]) if loud.size else None


def from_beep(fed: bytes, length: int) -> bytes:
    """`length` bytes of `fed` (PCM16 that carries `with_beep`'s beep), starting where
    `with_beep` starts: two recordings of one `with_beep` clip, cut so, line up
    (within the beep onset's few samples), whatever came before them in their stream."""
    onset = beep_onset(fed)
    assert onset is not None, "no beep in the audio"
    start = max(0, onset - int(BEEP_AT_S * SAMPLE_RATE))
    return fed[2 * start:2 * start + length]


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """A static HTTP server over `folder` (the web server in front of an HLS encoder)."""
    handler = functools.partial(_QuietFiles, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@dataclass(frozen=True)
class Transport:
    """One ingest path: what Babelcast's stream says, and what the encoder's ffmpeg writes."""

    name: str
    source: str
    output: tuple[str, ...]
    key: str = ""


def transport(name: str, folder: Path, http_base: str = "") -> Transport:
    """`folder`/`http_base`: where an HLS encoder writes and how it is served."""
    aac = ("-c:a", "aac", "-b:a", "128k")
    if name == "hls":
        return Transport(name, f"{http_base}/{folder.name}/live.m3u8",
                         (*aac, "-f", "hls", "-hls_time", "2", "-hls_list_size", "6",
                          str(folder / "live.m3u8")))
    if name == "rtmp-push":
        port = free_port()
        return Transport(name, f"rtmp://127.0.0.1:{port}/live?listen=1",
                         (*aac, "-f", "flv", f"rtmp://127.0.0.1:{port}/live/{STREAM_KEY}"),
                         key=STREAM_KEY)
    if name == "rtmp-pull":  # the encoder is the server (ffmpeg -listen 1)
        port = free_port()
        url = f"rtmp://127.0.0.1:{port}/live/feed"
        return Transport(name, url, (*aac, "-f", "flv", "-listen", "1", url))
    if name == "srt-listener":  # Babelcast listens, the encoder calls
        port = free_port(socket.SOCK_DGRAM)
        return Transport(name, f"srt://127.0.0.1:{port}?mode=listener",
                         (*aac, "-f", "mpegts",
                          f"srt://127.0.0.1:{port}?mode=caller&passphrase={SRT_PASSPHRASE}"),
                         key=SRT_PASSPHRASE)
    if name == "srt-pull":  # the encoder listens, Babelcast calls
        port = free_port(socket.SOCK_DGRAM)
        # connect_timeout: a try against an encoder that is down fails in 1 s, not 3.
        return Transport(name, f"srt://127.0.0.1:{port}?mode=caller&connect_timeout=1000",
                         (*aac, "-f", "mpegts", f"srt://127.0.0.1:{port}?mode=listener"))
    raise ValueError(name)


class Encoder:
    """ffmpeg encoding PCM written to its stdin at real time, to one transport's output."""

    def __init__(self, output: tuple[str, ...]) -> None:
        self.output = output
        self.proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.Task[None] | None = None
        self._ends: list[int] = []  # sample position after each write
        self._walls: list[float] = []  # wall time each write was handed to ffmpeg
        self.started_at = 0.0

    async def start(self, pcm: bytes) -> None:
        # No input probing: the format is given, and probing the pipe held ~1.4 s of
        # audio back before the first packet left (an operator's encoder does not wait
        # like that). Packets are flushed as soon as they are muxed.
        self.proc = await asyncio.create_subprocess_exec(
            "ffmpeg", "-nostdin", "-loglevel", "error", "-probesize", "32",
            "-analyzeduration", "0", "-fflags", "nobuffer", "-f", "s16le", "-ar",
            str(SAMPLE_RATE), "-ac", "1", "-i", "pipe:0", "-flush_packets", "1", *self.output,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        self.started_at = time.time()
        self._ends, self._walls = [], []
        self._writer = asyncio.create_task(self._write(pcm))

    async def _write(self, pcm: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        step = int(CHUNK_S * SAMPLE_RATE) * 2
        t0 = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for i, off in enumerate(range(0, len(pcm), step)):
                # Captured: a chunk is handed over once its last sample was "spoken".
                await asyncio.sleep(max(0.0, t0 + (i + 1) * CHUNK_S - time.monotonic()))
                self.proc.stdin.write(pcm[off : off + step])
                await self.proc.stdin.drain()
                self._ends.append((off + step) // 2)
                self._walls.append(time.time())

    async def finish(self, timeout_s: float = 30.0) -> int:
        """Wait for all audio to be written, then end the input: a clean stop."""
        assert self.proc is not None and self._writer is not None
        await self._writer
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def kill(self) -> float:
        """A crash (SIGKILL): nothing is flushed. Returns when it happened."""
        assert self.proc is not None
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        at = time.time()
        await self.proc.wait()
        return at

    def wall_of(self, pos_s: float) -> float:
        """When the encoder got the sample at `pos_s` of what it was fed."""
        pos = int(pos_s * SAMPLE_RATE)
        i = min(bisect.bisect_left(self._ends, pos), len(self._ends) - 1)
        return self._walls[i] - (self._ends[i] - pos) / SAMPLE_RATE


class TimedWhisperEngine(EmbeddedWhisperEngine):
    """Test tool: the real embedded engine, plus the wall-clock span of every decode its
    one thread ran. The rooms of an actor share that thread, so a room's wait for its
    next caption is its own audio's time plus the thread's busy time on the others' turns;
    `busy_s` gives the second for any stretch of time."""

    def __init__(self, options: EmbeddedEngineOptions) -> None:
        super().__init__(options)
        self.spans: list[tuple[float, float]] = []  # (start, end), time.time()

    def _decode_sync(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return super()._decode_sync(*args, **kwargs)
        finally:
            self.spans.append((t0, time.time()))  # list.append: safe from the thread

    def busy_s(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] the decode thread spent decoding (any room's audio)."""
        return sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in list(self.spans))


async def first_write_after(path: Path, since: float, timeout_s: float,
                            every_s: float = 0.01) -> float:
    """When `path` was first written (replaced or modified) after `since` (time.time()),
    by its own mtime; polled every `every_s`. An HLS encoder writes its playlist once a
    segment is whole, so for a restarted encoder this is when its first audio became
    available to any reader."""
    def mtime() -> float | None:
        try:
            return path.stat().st_mtime
        except FileNotFoundError:
            return None

    deadline = time.monotonic() + timeout_s
    while True:
        at = mtime()
        if at is not None and at > since:
            return at
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not written within {timeout_s} s")
        await asyncio.sleep(every_s)


class RecordingEngine(WrappedEngine):
    """Test tool: the real engine, plus a copy of every chunk its sessions get (real
    audio and the session manager's filler alike), per stream."""

    def __init__(self, inner: SpeechEngine) -> None:
        super().__init__(inner)
        self.fed: dict[str, dict[int, bytes]] = {}

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        inner = self.inner.open_session(options)
        fed = self.fed.setdefault(options.stream_id, {})

        class _Recording(RecognizeSession):
            async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
                async def forward() -> None:
                    async for delta in inner:
                        await self._emit(delta)

                task = asyncio.create_task(forward())
                try:
                    while True:
                        item = await inputs.get()
                        if not isinstance(item, AudioChunk | AudioGap):  # END
                            await inner.end_input()
                            await task
                            return
                        if isinstance(item, AudioChunk):
                            fed[item.pos] = item.pcm
                        await inner.push(item)
                finally:
                    task.cancel()
                    await inner.aclose()

        session = _Recording(options)
        session.start()
        return session

    def audio(self, stream_id: str) -> bytes:
        """What the engine was fed for the stream, in order (a re-fed overlap once)."""
        fed = self.fed.get(stream_id, {})
        out = bytearray()
        end = None
        for pos in sorted(fed):
            pcm = fed[pos]
            if end is not None and pos < end:
                pcm = pcm[(end - pos) * 2 :]
            out += pcm
            end = max(end or 0, pos + len(fed[pos]) // 2)
        return bytes(out)


def offline_text(pcm: bytes, model: str = "whisper-base") -> str:
    """The embedded model's transcript of `pcm` in one offline pass (beam 1, no VAD):
    a decode that does not depend on when the audio arrived."""
    from workers.engines.models import load_whisper

    whisper = load_whisper(model, cpu_threads=2)
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    segments, _ = whisper.transcribe(audio, language="en", beam_size=1, vad_filter=False,
                                     condition_on_previous_text=False)
    return " ".join(seg.text for seg in segments)


@dataclass
class Pipeline:
    """The ingest and ASR hosts of one event, in this process, on a real Redis."""

    redis_url: str
    model: str = "tiny.en"
    max_streams: int = 6
    ingest: IngestHost | None = None
    asr: AsrHost | None = None
    bus: RedisBus | None = None
    streams: dict[str, StreamOptions] = field(default_factory=dict)
    engine: RecordingEngine | None = None
    whisper: TimedWhisperEngine | None = None

    async def start(self) -> None:
        self.bus = RedisBus(Redis.from_url(self.redis_url))
        self.ingest = IngestHost(IngestHostOptions(actor_id="ingest-0",
                                                   redis_url=self.redis_url))
        self.whisper = TimedWhisperEngine(
            EmbeddedEngineOptions(model=self.model, cpu_threads=2))
        self.engine = RecordingEngine(self.whisper)
        self.asr = AsrHost(AsrHostOptions(actor_id="asr-0", redis_url=self.redis_url,
                                          max_streams=self.max_streams, read_block_ms=100),
                           self.engine)
        await self.ingest.start()
        await self.asr.start()

    async def stop(self) -> None:
        if self.ingest is not None:
            await asyncio.wait_for(self.ingest.stop(), 30)
        if self.asr is not None:
            await asyncio.wait_for(self.asr.stop(), 30)
        if self.bus is not None:
            await self.bus.redis.aclose()

    async def add(self, stream_id: str, source: str, *, key: str = "",
                  language: str = "en") -> StreamOptions:
        assert self.ingest is not None and self.asr is not None
        opts = StreamOptions(stream_id=stream_id, name=stream_id, source=source,
                             language=language, key=key)
        self.streams[stream_id] = opts
        await self.asr.add_stream(opts)
        await self.ingest.add_stream(opts)
        return opts

    async def captions(self, stream_id: str) -> list[CaptionSegment]:
        assert self.bus is not None
        return await self.bus.captions_after(stream_id, "en", 0, count=100_000)

    async def room(self, stream_id: str) -> dict[str, Any]:
        """The room as `babelcast status` shows it."""
        assert self.bus is not None
        body = await collect(self.bus, [self.streams[stream_id]], "test", {})
        room: dict[str, Any] = body["streams"][0]
        return room

    async def beep_offset_s(self, stream_id: str) -> float | None:
        """Stream audio time minus encoder time, from where the beep landed in the stream."""
        assert self.bus is not None
        for _, fields in await self.bus.redis.xrange(audio_key(stream_id)):
            if fields.get(b"k") != b"pcm":
                continue
            onset = beep_onset(fields[b"pcm"])
            if onset is not None:
                return (int(fields[b"pos"]) + onset) / SAMPLE_RATE - BEEP_AT_S
        return None


@contextlib.asynccontextmanager
async def pipeline(redis_url: str, model: str = "tiny.en") -> AsyncIterator[Pipeline]:
    run = Pipeline(redis_url, model)
    await run.start()
    try:
        yield run
    finally:
        await run.stop()


def caption_delays(captions: list[CaptionSegment], encoder: Encoder,
                   offset_s: float) -> list[float]:
    """Each final's emit time minus when its last word reached the encoder."""
    return [c.emit_time - encoder.wall_of(c.audio_end_s - offset_s)
            for c in captions if c.is_final and c.text]
