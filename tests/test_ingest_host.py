"""The ingest host on real parts: real sources (files, a local HTTP server) into a real Redis.

What a test checks is what the ASR side and operators see: the entries of
`audio:{stream}` and the `status:{stream}` hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import itertools
import os
import socket
import threading
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.speech import AUDIO
from tests.waiting import eventually
from workers.bus import RedisBus, audio_key
from workers.events import SAMPLE_RATE, StreamOptions
from workers.ingest import STOP_WAIT_S, IngestHost, IngestHostOptions, _default_factory
from workers.sources.base import AudioSource

pytestmark = pytest.mark.integration


# --- helpers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of `audio:{stream}`, as the ASR side would read it."""

    kind: str  # "pcm" or "gap"
    pos: int
    wall: float
    samples: int = 0
    reason: str = ""

    @property
    def end(self) -> int:
        return self.pos + self.samples


def new_host(redis_url: str) -> IngestHost:
    return IngestHost(
        IngestHostOptions(
            actor_id="ingest-t", redis_url=redis_url, backoff_initial_s=0.2, backoff_max_s=1.0
        )
    )


@pytest.fixture
async def host(redis_url: str) -> AsyncIterator[IngestHost]:
    host = new_host(redis_url)
    await host.start()
    try:
        yield host
    finally:
        await asyncio.wait_for(host.stop(), 15)


async def audio_entries(bus: RedisBus, stream: str) -> list[Entry]:
    out: list[Entry] = []
    for _, fields in await bus.redis.xrange(audio_key(stream)):
        kind = fields[b"k"].decode()
        pos, wall = int(fields[b"pos"]), float(fields[b"wall"])
        if kind == "pcm":
            out.append(Entry(kind, pos, wall, samples=len(fields[b"pcm"]) // 2))
        else:
            out.append(Entry(kind, pos, wall, reason=fields[b"reason"].decode()))
    return out


def runs_of_audio(entries: list[Entry]) -> list[list[Entry]]:
    """The pcm entries split at every gap entry: one run per connection."""
    runs: list[list[Entry]] = [[]]
    for e in entries:
        if e.kind == "gap":
            runs.append([])
        else:
            runs[-1].append(e)
    return [r for r in runs if r]


def write_tone_wav(path: Path, seconds: float) -> Path:
    """16 kHz mono 440 Hz tone; written aside and renamed so a reader never sees half a file."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes()
    partial = path.with_name(path.name + ".part")
    with wave.open(str(partial), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm)
    os.replace(partial, path)
    return path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A static HTTP server over a fresh folder: (base URL, folder)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def options(stream_id: str, source: str) -> StreamOptions:
    return StreamOptions(stream_id=stream_id, name=stream_id, source=source, language="en")


# --- tests --------------------------------------------------------------------------------


async def test_http_source_that_drops_is_reconnected_and_the_gap_is_recorded(
    http_root: tuple[str, Path], host: IngestHost, bus: RedisBus
) -> None:
    base, root = http_root
    write_tone_wav(root / "tone.wav", 1.0)
    # A live source is not supposed to end: each end of this 1 s file is a drop.
    await host.add_stream(options("radio", f"{base}/tone.wav"))

    async def reconnected_twice() -> bool:
        return len(runs_of_audio(await audio_entries(bus, "radio"))) >= 3

    await eventually(reconnected_twice, 8, "audio from three connections")

    entries = await audio_entries(bus, "radio")
    gaps = [i for i, e in enumerate(entries) if e.kind == "gap"]
    assert gaps, "no gap recorded between connections"
    for i in gaps:
        gap = entries[i]
        assert gap.reason == "source-error"
        before = [e for e in entries[:i] if e.kind == "pcm"]
        after = [e for e in entries[i + 1 :] if e.kind == "pcm"]
        assert before and after
        # The audio clock moved on by the time lost, never glued both sides together.
        assert gap.pos > before[-1].end
        assert after[0].pos == gap.pos
    # Audio positions never run backwards or overlap.
    pcm = [e for e in entries if e.kind == "pcm"]
    assert all(b.pos >= a.end for a, b in itertools.pairwise(pcm))

    status = await bus.get_status("radio")
    assert float(status["source_reconnects"]) >= 1
    assert status["source_state"] in {"live", "connecting", "reconnecting"}
    assert status["ingest_actor"] == "ingest-t"


async def test_missing_file_reports_an_operator_message_and_keeps_retrying(
    host: IngestHost, bus: RedisBus, tmp_path: Path
) -> None:
    path = tmp_path / "late.wav"
    await host.add_stream(options("late", str(path)))

    async def reported() -> bool:
        return (await bus.get_status("late")).get("source_state") == "reconnecting"

    await eventually(reported, 5, "the missing file to be reported")
    status = await bus.get_status("late")
    assert str(path) in status["source_error"]
    assert "check that the file exists" in status["source_error"]
    assert await bus.redis.xlen(audio_key("late")) == 0

    write_tone_wav(path, 1.0)

    async def audio_arrives() -> bool:
        return bool(await bus.redis.xlen(audio_key("late")) > 0)

    # Backoff is capped at 1 s, so the next attempt comes within about a second.
    await eventually(audio_arrives, 5, "audio once the file exists")

    async def live_or_ended() -> bool:
        return (await bus.get_status("late")).get("source_state") in {"live", "ended"}

    await eventually(live_or_ended, 5, "the source to be live or ended")
    assert (await bus.get_status("late")).get("source_error") == ""


async def test_one_failing_source_does_not_disturb_another(
    host: IngestHost, bus: RedisBus
) -> None:
    await host.add_stream(options("good", str(AUDIO / "room-a.flac")))
    await host.add_stream(options("broken", f"http://127.0.0.1:{closed_port()}/x.mp3"))

    async def enough() -> bool:
        pcm = [e for e in await audio_entries(bus, "good") if e.kind == "pcm"]
        status = await bus.get_status("broken")
        return (
            len(pcm) >= 2
            and pcm[-1].wall - pcm[0].wall >= 3.0
            and float(status.get("source_reconnects", 0)) >= 2
        )

    await eventually(enough, 15, "3 s of good audio and two failures of the broken source")

    good = await audio_entries(bus, "good")
    assert all(e.kind == "pcm" for e in good), "the good stream got a gap"
    # Real-time pace: the audio clock advances with the wall clock.
    audio_s = (good[-1].pos - good[0].pos) / SAMPLE_RATE
    wall_s = good[-1].wall - good[0].wall
    assert audio_s == pytest.approx(wall_s, rel=0.3)
    assert (await bus.get_status("good"))["source_state"] == "live"

    broken = await bus.get_status("broken")
    assert broken["source_state"] in {"connecting", "reconnecting"}
    assert "127.0.0.1" in broken["source_error"]
    assert await bus.redis.xlen(audio_key("broken")) == 0


async def test_audio_after_an_ingest_restart_is_not_glued_to_the_audio_before(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    tone = write_tone_wav(tmp_path / "tone.wav", 5.0)

    def more_entries_than(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return bool(await bus.redis.xlen(audio_key("hall")) > n)

        return check

    first = new_host(redis_url)
    await first.start()
    try:
        await first.add_stream(options("hall", str(tone)))
        await eventually(more_entries_than(5), 5, "audio from the first host")
    finally:
        await asyncio.wait_for(first.stop(), 15)
    before = await audio_entries(bus, "hall")

    # The outage under test: nobody ingests this stream for half a second.
    await asyncio.sleep(0.5)
    second = new_host(redis_url)
    await second.start()
    try:
        await second.add_stream(options("hall", str(tone)))
        await eventually(
            more_entries_than(len(before) + 2), 5, "audio from the second host"
        )
    finally:
        await asyncio.wait_for(second.stop(), 15)

    new = (await audio_entries(bus, "hall"))[len(before) :]
    first_new = next(e for e in new if e.kind == "pcm")
    assert any(e.kind == "gap" for e in new[: new.index(first_new)]), "no gap recorded"
    # The audio clock follows wall time across the hole, as it does across a reconnect.
    lost_s = first_new.wall - before[-1].wall - first_new.samples / SAMPLE_RATE
    assert (first_new.pos - before[-1].end) / SAMPLE_RATE == pytest.approx(lost_s, abs=0.1)


class _HungCloseSource(AudioSource):
    """TEST DOUBLE for a source whose release hangs and will not be cancelled (a network
    teardown stuck in a thread that no one can interrupt). It never yields audio."""

    url = "hung://close"

    def __init__(self, release: asyncio.Event) -> None:
        self._release = release

    async def chunks(self) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""  # pragma: no cover - never reached

    async def aclose(self) -> None:
        while not self._release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self._release.wait()


async def test_removing_a_stream_whose_source_will_not_close_returns_and_spares_the_others(
    redis_url: str, bus: RedisBus, caplog: pytest.LogCaptureFixture
) -> None:
    release = asyncio.Event()

    def factory(opts: StreamOptions, executor: Any) -> AudioSource:
        return (_HungCloseSource(release) if opts.stream_id == "hung"
                else _default_factory(opts, executor))

    host = IngestHost(IngestHostOptions(actor_id="ingest-t", redis_url=redis_url),
                      source_factory=factory)
    await host.start()
    try:
        await host.add_stream(options("hung", "hung://close"))
        await host.add_stream(options("good", str(AUDIO / "room-a.flac")))
        await eventually(lambda: _state_is(bus, "good", "live"), 10, "the good stream live")
        await eventually(lambda: _state_is(bus, "hung", "connecting"), 10, "the hung source open")

        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(host.remove_stream("hung"), STOP_WAIT_S + 10)
        took = asyncio.get_running_loop().time() - started
        assert STOP_WAIT_S - 0.5 <= took <= STOP_WAIT_S + 5, took
        assert "hung" not in host.streams()
        warning = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
        assert warning and "aclose" in warning[0], warning

        # The other stream never noticed: its audio runs on without a gap.
        before = await bus.redis.xlen(audio_key("good"))
        await asyncio.sleep(1.0)
        good = await audio_entries(bus, "good")
        assert len(good) > before and all(e.kind == "pcm" for e in good)
        assert (await bus.get_status("good"))["source_state"] == "live"
    finally:
        release.set()
        await asyncio.wait_for(host.stop(), 15)


async def _state_is(bus: RedisBus, stream: str, state: str) -> bool:
    return (await bus.get_status(stream)).get("source_state") == state
