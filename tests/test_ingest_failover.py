"""An ingest actor killed for real mid-speech (real local Ray, real Redis, real speech
through Whisper tiny.en, the supervisor as `babelcast run` runs it but with a poll too
slow to matter): the process playing a file source is SIGKILLed by pid; Ray restarts
it, the supervisor adds the stream back at Ray's death signal, and the file goes on
where it stopped (the ingest cursor), not from its start. The audio clock goes on
after the hole (an `ingest-restart` gap), so no speech is heard twice, captions
resume, and seq and segment ids go on without a gap or a double."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
import wave
from pathlib import Path
from typing import Any

import jiwer
import pytest
from ray.exceptions import ActorUnavailableError

from orchestrator import metrics
from orchestrator.config import parse_event
from orchestrator.router import Router
from orchestrator.runtime import INGEST_RETRY_S, EventRuntime
from tests.speech import AUDIO, decode_pcm16, normalize
from tests.waiting import eventually
from workers.bus import RedisBus, audio_key
from workers.events import SAMPLE_RATE, StreamOptions
from workers.ingest import IngestHost, IngestHostOptions
from workers.sources.file import FileSource
from workers.sources.pyav import Pacer

pytestmark = pytest.mark.integration

EVENT = """
event: ingest failover
redis: {{url: "{url}"}}
engine: {{model: tiny.en, actors: 1, streams_per_actor: 1, cpu_threads: 1}}
ingest: {{actors: 1}}
streams:
  - {{id: hall, source: "{path}", language: en}}
"""
LEAD_IN_S = 0.5
KILL_AT_S = 8.0  # file seconds: inside the second of room-b's two sentences (7.4-10.6 s)


def talk_wav(path: Path) -> bytes:
    """room-b after a short silence, as a WAV; returns its PCM."""
    pcm = bytes(2 * int(LEAD_IN_S * SAMPLE_RATE)) + decode_pcm16(AUDIO / "room-b.flac")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    return pcm


async def audio_entries(bus: RedisBus, stream: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await bus.redis.xrange(audio_key(stream))]


async def test_a_killed_ingest_actor_resumes_its_file_where_it_stopped(
        local_ray: None, bus: RedisBus, redis_url: str, tmp_path: Path) -> None:
    pcm = talk_wav(tmp_path / "talk.wav")
    cfg = parse_event(EVENT.format(url=redis_url, path=tmp_path / "talk.wav"))
    runtime = EventRuntime(cfg, redis_url=redis_url)
    readds = metrics.STREAM_READDS.labels(actor="ingest-0")._value.get()
    tasks: list[asyncio.Task[None]] = []
    try:
        await runtime.start_actors()
        ingest = runtime.ingest["ingest-0"]
        first_pid = (await ingest.state.remote())["pid"]
        tasks.append(asyncio.create_task(runtime.supervise(every_s=120)))

        async def written_s() -> float:
            return (await bus.last_audio_end("hall"))[0] / SAMPLE_RATE

        async def at_kill() -> bool:
            return await written_s() >= KILL_AT_S

        await eventually(at_kill, 60, f"{KILL_AT_S} s of the file ingested")
        killed_wall = time.time()
        os.kill(first_pid, signal.SIGKILL)  # the process dies; Ray starts another
        killed_at_s = await written_s()

        async def back() -> bool:
            try:
                state = await asyncio.wait_for(ingest.state.remote(), 5)
                return state["pid"] != first_pid and bool(
                    await asyncio.wait_for(ingest.streams.remote(), 5))
            except Exception:
                return False

        await eventually(back, 30, "the stream on the restarted ingest actor")
        back_s = time.time() - killed_wall

        async def settled() -> bool:
            status = await bus.get_status("hall")
            last = await bus.last_caption("hall", "en")
            return (status.get("source_state") == "ended" and last is not None
                    and last.is_final and last.audio_end_s > 9.5)

        await eventually(settled, 60, "the file played to its end and captioned")
        status = await bus.get_status("hall")
        entries = await audio_entries(bus, "hall")
    finally:
        for task in tasks:
            task.cancel()
        await runtime.stop()

    assert metrics.STREAM_READDS.labels(actor="ingest-0")._value.get() == readds + 1
    assert status.get("source_resumes") == "1", status
    # The file went on from where it stopped: the PCM written before and after the hole
    # is the file's, once (a kill between an entry and its cursor may repeat one entry).
    # The file's end is marked last (the ASR side finishes the stream on it).
    assert entries[-1][b"k"] == b"gap" and entries[-1][b"reason"] == b"source-ended"
    entries = entries[:-1]
    gaps = [f for f in entries if f[b"k"] == b"gap"]
    assert [g[b"reason"] for g in gaps] == [b"ingest-restart"], gaps
    split = next(i for i, f in enumerate(entries) if f[b"k"] == b"gap")
    before = b"".join(f[b"pcm"] for f in entries[:split])
    after = b"".join(f[b"pcm"] for f in entries[split + 1:])
    resumed_at_s = float(status["source_resumed_at_s"])
    repeated = len(before) - round(resumed_at_s * SAMPLE_RATE) * 2
    assert 0 <= repeated <= 2 * SAMPLE_RATE // 10, "more than one entry heard twice"
    assert before + after[repeated:] == pcm, "the file's audio was not ingested once, in order"
    # Audio time and capture time go on monotonically across the restart.
    ends = [(int(f[b"pos"]), float(f[b"wall"])) for f in entries]
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in itertools.pairwise(ends))

    caps = await bus.captions_after("hall", "en", 0, count=10_000)
    finals = [c for c in caps if c.is_final]
    text = normalize(" ".join(c.text for c in finals))
    reference = normalize((AUDIO / "room-b.txt").read_text())
    wer = float(jiwer.wer(reference, text))
    times = [killed_wall, *sorted(c.emit_time for c in caps if c.emit_time > killed_wall)]
    silence = max(b - a for a, b in itertools.pairwise(times))
    print(f"ingest killed at {killed_at_s:.1f} s of audio, stream back after {back_s:.1f} s, "
          f"file resumed at {resumed_at_s:.1f} s, longest caption silence {silence:.1f} s, "
          f"WER {wer:.3f}, {len(finals)} finals")
    assert [c.seq for c in caps] == list(range(1, len(caps) + 1)), "seq must go on"
    ids = [c.segment_id for c in finals]
    assert ids == sorted(set(ids)), "a caption was made final twice"
    assert {c.segment_id for c in caps} == set(ids), "a caption was left open"
    # docs/failover.md's bound for every failure (3.5 s measured with the 2-core box's load
    # average at 6.8: the audio before the hole is still being captioned meanwhile)
    assert silence <= 5.0, "captions must be back within 5 s of the kill"
    # The hole splits the sentence under way at the kill into two utterances, each decoded
    # on its own: tiny.en read the 0.6 s "he might" as "he invited" and the rest worse on an
    # AMD EPYC host (WER 0.259, 7 of 27 words), better on others. Speech heard twice or lost
    # (the audio checks above are exact) would cost more than that.
    assert wer <= 0.3, text


@pytest.fixture
def unpaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files decoded as fast as they decode (these tests are about positions, not pace)."""
    async def at_once(self: Pacer, samples: int) -> None:
        return None

    monkeypatch.setattr(Pacer, "wait", at_once)


async def read_all(source: FileSource, limit: int = 1 << 30) -> tuple[bytes, list[int]]:
    out, positions = bytearray(), []
    async for chunk in source.chunks():
        out += chunk
        positions.append(source.position())
        if len(out) >= limit:
            break
    await source.aclose()
    return bytes(out), positions


async def test_a_file_source_resumed_mid_file_yields_exactly_the_rest(unpaced: None) -> None:
    path = AUDIO / "room-a.flac"
    pcm = decode_pcm16(path)
    at = 5 * SAMPLE_RATE + 37  # not on a chunk or frame boundary
    source = FileSource(str(path))
    source.resume_at(at)
    rest, positions = await read_all(source)
    assert rest == pcm[2 * at:]
    assert positions[-1] == len(pcm) // 2
    source = FileSource(str(path))
    source.resume_at(len(pcm) // 2)  # where a file that ended stopped: it ends again
    assert (await read_all(source))[0] == b""


async def test_a_looping_file_resumed_near_its_end_wraps_and_counts_from_its_start(
        unpaced: None) -> None:
    path = AUDIO / "room-a.flac"
    pcm = decode_pcm16(path)
    n = len(pcm) // 2
    source = FileSource(str(path), loop=True)
    source.resume_at(n - SAMPLE_RATE)
    out, positions = await read_all(source, limit=4 * SAMPLE_RATE)
    assert out[: 2 * SAMPLE_RATE] == pcm[-2 * SAMPLE_RATE:]
    assert out[2 * SAMPLE_RATE:] == pcm[: len(out) - 2 * SAMPLE_RATE]
    assert positions[-1] == len(out) // 2 - SAMPLE_RATE  # within the second pass


async def test_the_ingest_cursor_resumes_within_a_run_and_not_in_the_next(
        unpaced: None, bus: RedisBus, redis_url: str) -> None:
    opts = StreamOptions(stream_id="hall", name="hall", source=str(AUDIO / "room-b.flac"),
                         language="en")
    run = IngestHostOptions(actor_id="ingest-t", redis_url=redis_url)
    samples = len(decode_pcm16(AUDIO / "room-b.flac")) // 2

    async def pcm_samples() -> int:
        return sum(len(f[b"pcm"]) // 2 for f in await audio_entries(bus, "hall")
                   if f[b"k"] == b"pcm")

    async def ingest(options: IngestHostOptions) -> int:
        """Plays the stream until its source ends; returns the audio samples it wrote."""
        before = await pcm_samples()
        await bus.set_status("hall", source_state="")
        host = IngestHost(options)
        await host.start()
        try:
            await host.add_stream(opts)

            async def ended() -> bool:
                return (await bus.get_status("hall")).get("source_state") == "ended"

            await eventually(ended, 20, "the file played")
        finally:
            await host.stop()
        return await pcm_samples() - before

    assert await ingest(run) == samples
    # The same run (Ray restarts an actor with the same options): the file had ended.
    assert await ingest(run) == 0
    assert (await bus.get_status("hall")).get("source_resumes") == "1"
    # The next run of the event plays it from its start.
    assert await ingest(IngestHostOptions(actor_id="ingest-t", redis_url=redis_url)) == samples


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class RestartingIngestHandle:
    """An ingest actor's handle as the supervisor meets it while Ray restarts the actor:
    its pending watch fails (the death signal), the next call fails as unavailable, then
    the new process answers with no streams."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.calls = 0
        self.watches = 0
        self.watch = _Call(self._watch)
        self.streams = _Call(self._streams)
        self.add_stream = _Call(self._add)

    async def _watch(self) -> None:
        self.watches += 1
        if self.watches == 1:
            await asyncio.sleep(0.1)
            raise ActorUnavailableError("restarting", None)
        await asyncio.Event().wait()

    async def _streams(self) -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise ActorUnavailableError("restarting", None)
        return list(self.added)

    async def _add(self, opts: StreamOptions) -> None:
        self.added.append(opts.stream_id)


@pytest.mark.unit
async def test_an_ingest_actor_met_mid_restart_gets_its_streams_back_within_a_second(
        ) -> None:
    cfg = parse_event(EVENT.format(url="redis://127.0.0.1:1", path=AUDIO / "room-b.flac"))
    runtime = EventRuntime(cfg, redis_url="redis://127.0.0.1:1")
    handle = RestartingIngestHandle()
    runtime.ingest = {"ingest-0": handle}
    runtime.router = Router(budget=1, actors=[])
    runtime._ingest_pins = {"hall": "ingest-0"}
    # Only the death signal wakes it (poll at 120 s): the retry must not wait for the poll.
    supervisor = asyncio.create_task(runtime.supervise(every_s=120, min_gap_s=0.1))
    try:
        t0 = time.monotonic()

        async def readded() -> bool:
            return handle.added == ["hall"]

        await eventually(readded, 5, "the stream added again")
        assert time.monotonic() - t0 < 0.1 + 0.1 + INGEST_RETRY_S + 1.0
        assert handle.calls == 2
    finally:
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
