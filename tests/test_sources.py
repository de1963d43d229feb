"""Pulled audio sources: real files, a real HTTP server and a real ffmpeg SRT sender."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import os
import shutil
import socket
import threading
import time
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import av
import numpy as np
import pytest

from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError, SourceEvent, SourceItem
from workers.sources.factory import open_source
from workers.sources.file import FileSource
from workers.sources.hls import HlsSource
from workers.sources.pyav import CHUNK_BYTES, LIVE_LEAD_S, Pacer, PyAVSource, redact_url
from workers.sources.rtmp_listen import RtmpListenSource
from workers.sources.srt import SrtSource

pytestmark = pytest.mark.integration

BYTES_PER_S = SAMPLE_RATE * 2
needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs Debian ffmpeg")


# --- fixtures and helpers ---------------------------------------------------------------


def write_tone(path: Path, seconds: float, *, rate: int = 44_100) -> Path:
    """Stereo WAV: 440 Hz left, 660 Hz right, so decoding must resample and downmix."""
    t = np.arange(int(seconds * rate)) / rate
    left = 0.3 * np.sin(2 * np.pi * 440 * t)
    right = 0.3 * np.sin(2 * np.pi * 660 * t)
    frames = (np.stack([left, right], axis=1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames.tobytes())
    return path


def write_flac(wav: Path, flac: Path) -> Path:
    with av.open(str(wav)) as src, av.open(str(flac), "w") as dst:
        out = dst.add_stream("flac", rate=44_100, layout="stereo")
        for frame in src.decode(audio=0):
            for packet in out.encode(frame):
                dst.mux(packet)
        for packet in out.encode(None):
            dst.mux(packet)
    return flac


@pytest.fixture
def tone(tmp_path: Path) -> Path:
    return write_tone(tmp_path / "tone.wav", 2.0)


async def collect(
    source: AudioSource, *, max_bytes: int | None = None, limit_s: float = 8.0
) -> tuple[list[SourceItem], SourceError | None]:
    """Chunks until the source ends, fails, or yields `max_bytes`; bounded by `limit_s`."""
    chunks: list[SourceItem] = []

    async def run() -> SourceError | None:
        try:
            async for chunk in source.chunks():
                chunks.append(chunk)
                audio = sum(len(c) for c in chunks if isinstance(c, bytes))
                if max_bytes is not None and audio >= max_bytes:
                    return None
        except SourceError as exc:
            return exc
        return None

    try:
        return chunks, await asyncio.wait_for(run(), limit_s)
    finally:
        await asyncio.wait_for(source.aclose(), 5)


def peak_frequencies(pcm: bytes, count: int) -> set[int]:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    spectrum = np.abs(np.fft.rfft(samples))
    freqs = np.fft.rfftfreq(samples.size, 1 / SAMPLE_RATE)
    return {round(freqs[i] / 10) * 10 for i in np.argsort(spectrum)[-count:]}


def free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


# --- Pacer (virtual clock) --------------------------------------------------------------


class VirtualClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_pacer_releases_chunks_at_real_time() -> None:
    clock = VirtualClock()
    pacer = Pacer(clock, clock.sleep)
    for _ in range(10):
        await pacer.wait(1600)
    # The first chunk goes at once; each later one when the audio before it has played.
    assert clock.now == pytest.approx(100.9)
    assert clock.slept[0] == pytest.approx(0.1)


async def test_pacer_catches_up_a_short_lag_without_sleeping() -> None:
    clock = VirtualClock()
    pacer = Pacer(clock, clock.sleep)
    await pacer.wait(1600)
    clock.now += 0.5  # the source stalled, less than max_lag_s
    slept = len(clock.slept)
    for _ in range(5):
        await pacer.wait(1600)
    assert len(clock.slept) == slept  # these chunks were already due
    await pacer.wait(1600)
    assert clock.now == pytest.approx(100.6)


async def test_a_live_pacer_lets_its_first_second_out_at_once_then_holds_real_time() -> None:
    clock = VirtualClock()
    pacer = Pacer(clock, clock.sleep, lead_s=LIVE_LEAD_S)
    for _ in range(10):  # what FFmpeg probed at connect: out at once, not kept as latency
        await pacer.wait(1600)
    assert clock.slept == []
    for _ in range(10):  # a sender faster than real time gets no further ahead
        await pacer.wait(1600)
    assert clock.now == pytest.approx(100.9)


async def test_pacer_rebases_after_a_long_stall_instead_of_bursting() -> None:
    clock = VirtualClock()
    pacer = Pacer(clock, clock.sleep)
    await pacer.wait(1600)
    clock.now += 3.0  # a network stall
    await pacer.wait(1600)  # released at once, and the schedule restarts here
    before = clock.now
    await pacer.wait(1600)
    assert clock.now - before == pytest.approx(0.1)


# --- FileSource ---------------------------------------------------------------------------


async def test_file_source_decodes_resamples_and_paces_at_real_time(tone: Path) -> None:
    started = time.monotonic()
    chunks, error = await collect(FileSource(str(tone)))
    elapsed = time.monotonic() - started

    assert error is None
    total = sum(map(len, chunks))
    assert abs(total - 2 * BYTES_PER_S) <= CHUNK_BYTES
    assert all(len(c) == CHUNK_BYTES for c in chunks[:-1])
    assert 0 < len(chunks[-1]) <= CHUNK_BYTES and len(chunks[-1]) % 2 == 0
    assert elapsed >= 1.7
    # Both channels survive the downmix at their pitch: the rate conversion is right.
    assert peak_frequencies(b"".join(chunks), 2) == {440, 660}


async def test_file_source_accepts_a_file_url_to_a_flac(tmp_path: Path) -> None:
    wav = write_tone(tmp_path / "short.wav", 0.5)
    flac = write_flac(wav, tmp_path / "short.flac")
    chunks, error = await collect(open_source(flac.as_uri()))
    assert error is None
    assert abs(sum(map(len, chunks)) - BYTES_PER_S // 2) <= CHUNK_BYTES


async def test_looping_file_continues_seamlessly_past_its_end(tmp_path: Path) -> None:
    short = write_tone(tmp_path / "short.wav", 0.45)  # 0.45 s: not a whole number of chunks
    wanted = int(1.2 * BYTES_PER_S)
    started = time.monotonic()
    chunks, error = await collect(FileSource(str(short), loop=True), max_bytes=wanted)
    elapsed = time.monotonic() - started

    assert error is None
    assert sum(map(len, chunks)) >= wanted
    assert all(len(c) == CHUNK_BYTES for c in chunks)  # no short chunk at the seams
    assert elapsed >= 1.0  # pacing carries on across the reopen


async def test_missing_file_is_a_non_retryable_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.wav"
    _, error = await collect(FileSource(str(missing)))
    assert error is not None and not error.retryable
    assert str(missing) in str(error)


async def test_a_file_that_is_not_audio_is_a_non_retryable_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not audio at all\n" * 100)
    _, error = await collect(FileSource(str(text)))
    assert error is not None and not error.retryable


# --- PyAVSource -------------------------------------------------------------------------


async def test_pyav_source_decodes_over_http_and_reports_the_end(
    tone: Path, http_root: str
) -> None:
    url = f"{http_root}/{tone.name}"
    chunks, error = await collect(PyAVSource(url))

    assert abs(sum(map(len, chunks)) - 2 * BYTES_PER_S) <= CHUNK_BYTES
    assert peak_frequencies(b"".join(chunks), 2) == {440, 660}
    # A network source is live: its end is a failure the ingest host retries.
    assert error is not None and error.retryable
    assert url in str(error) and "ended" in str(error)


async def test_pyav_source_fails_fast_on_a_closed_port() -> None:
    url = f"http://127.0.0.1:{free_port(socket.SOCK_STREAM)}/live.aac"
    started = time.monotonic()
    _, error = await collect(PyAVSource(url), limit_s=5)
    assert time.monotonic() - started < 2
    assert error is not None and error.retryable
    assert url in str(error) and "reachable" in str(error)


async def test_pyav_source_times_out_on_a_server_that_never_answers() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/live.aac"
        source = PyAVSource(url, open_timeout_s=0.5, read_timeout_s=0.5)
        started = time.monotonic()
        _, error = await collect(source, limit_s=5)
    assert time.monotonic() - started < 3
    assert error is not None and "timed out" in str(error)


def test_operator_messages_mask_secrets() -> None:
    shown = redact_url("rtsp://cam:hunter2@10.0.0.5/live?token=abc&x=1")
    assert "hunter2" not in shown and "abc" not in shown and "x=1" in shown
    assert "s3cret" not in redact_url("srt://h:9000?mode=caller&passphrase=s3cret")


# --- SrtSource --------------------------------------------------------------------------


async def start_srt_sender(wav: Path, port: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "ffmpeg", "-nostdin", "-loglevel", "error", "-re", "-i", str(wav),
        "-c:a", "aac", "-f", "mpegts", f"srt://127.0.0.1:{port}?mode=listener",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def first_chunk_with_retry(
    url: str, deadline_s: float
) -> tuple[SrtSource, AsyncIterator[bytes]]:
    """The listener needs a moment to bind, so connect until it answers."""
    deadline = time.monotonic() + deadline_s
    while True:
        source = SrtSource(url)
        chunks = source.chunks()
        try:
            await asyncio.wait_for(anext(chunks), 3)
            return source, chunks
        except SourceError:
            await asyncio.wait_for(source.aclose(), 5)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@needs_ffmpeg
async def test_srt_source_receives_audio_and_fails_when_the_sender_dies(tmp_path: Path) -> None:
    wav = write_tone(tmp_path / "long.wav", 10.0)
    port = free_port(socket.SOCK_DGRAM)
    sender = await start_srt_sender(wav, port)
    # connect_timeout keeps each retry short; timeout (µs) notices a silent peer in 1 s
    # instead of SRT's 5 s idle timeout.
    url = f"srt://127.0.0.1:{port}?mode=caller&connect_timeout=500&timeout=1000000"
    source: SrtSource | None = None
    try:
        source, chunks = await first_chunk_with_retry(url, deadline_s=5)
        received = CHUNK_BYTES
        while received < BYTES_PER_S // 2:
            chunk = await asyncio.wait_for(anext(chunks), 3)
            assert len(chunk) == CHUNK_BYTES
            received += len(chunk)

        sender.kill()
        with pytest.raises(SourceError) as failed:
            while True:
                await asyncio.wait_for(anext(chunks), 5)
        assert failed.value.retryable
        assert url in str(failed.value) and "ended" in str(failed.value)
        await asyncio.wait_for(chunks.aclose(), 5)
    finally:
        if sender.returncode is None:
            sender.kill()
        await asyncio.wait_for(sender.wait(), 5)
        if source is not None:
            await asyncio.wait_for(source.aclose(), 5)


@needs_ffmpeg
async def test_srt_source_reports_ffmpeg_errors_when_nobody_listens() -> None:
    url = f"srt://127.0.0.1:{free_port(socket.SOCK_DGRAM)}?mode=caller&connect_timeout=300"
    chunks, error = await collect(SrtSource(url), limit_s=5)
    assert chunks == []
    assert error is not None and error.retryable
    assert "Input/output error" in str(error)  # ffmpeg's own line reaches the operator


async def test_srt_source_without_ffmpeg_says_how_to_install_it() -> None:
    _, error = await collect(
        SrtSource("srt://127.0.0.1:9?mode=caller", ffmpeg="/nonexistent/ffmpeg")
    )
    assert error is not None and not error.retryable
    assert "apt-get install ffmpeg" in str(error)


@needs_ffmpeg
async def test_closing_an_srt_source_ends_its_ffmpeg(tmp_path: Path) -> None:
    port = free_port(socket.SOCK_DGRAM)
    before = child_pids()
    # A listener waits for a caller forever: only aclose() can end this one.
    source = SrtSource(f"srt://127.0.0.1:{port}?mode=listener")
    reading = asyncio.create_task(collect(source, limit_s=10))
    deadline = time.monotonic() + 3
    # Nothing signals that a child has started, so poll for it.
    while not child_pids() - before and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert child_pids() - before

    await asyncio.wait_for(source.aclose(), 5)
    chunks, error = await asyncio.wait_for(reading, 5)
    # Closed on purpose: a normal end, with no audio; it only said it was waiting.
    assert error is None
    assert [c.reason for c in chunks if isinstance(c, SourceEvent)] == ["srt-waiting"]
    assert not [c for c in chunks if isinstance(c, bytes)]
    assert not child_pids() - before


# --- factory ----------------------------------------------------------------------------


def test_open_source_picks_the_source_by_scheme(tone: Path) -> None:
    assert isinstance(open_source(str(tone)), FileSource)
    assert isinstance(open_source(tone.as_uri(), loop=True), FileSource)
    for url in ("https://h/a.aac", "rtmp://h/live/a", "rtmps://h/live/a", "rtsp://h/cam"):
        assert isinstance(open_source(url), PyAVSource)
    for url in ("http://h/a.m3u8", "https://h/live/index.m3u8?token=x"):
        assert isinstance(open_source(url), HlsSource)
    assert isinstance(open_source("srt://h:9000?mode=caller"), SrtSource)
    assert isinstance(open_source("srt://0.0.0.0:9000?mode=listener"), SrtSource)
    for url in ("rtmp://0.0.0.0:1935/live", "rtmp://127.0.0.1:1935/live?listen=1"):
        assert isinstance(open_source(url, key="k"), RtmpListenSource)


@pytest.mark.parametrize("url", ["http://0.0.0.0:8080/live.aac", "rtsp://h/cam?listen=1",
                                 "rtmp://0.0.0.0:1935/live/thekey",
                                 "rtmp://encoder.local:1935/live?listen=1"])
def test_open_source_refuses_listen_urls_it_cannot_serve(url: str) -> None:
    with pytest.raises(ValueError):
        open_source(url, key="k")


@pytest.mark.parametrize("url", ["push", "push://hall-a", "ftp://h/a.wav", "udp://h:1234"])
def test_open_source_rejects_push_and_unknown_schemes(url: str) -> None:
    with pytest.raises(ValueError):
        open_source(url)
