"""ASR actors killed for real in the middle of a sentence (real local Ray, real Redis, real
speech through Whisper tiny.en), with the supervisor running as `babelcast run` runs it
but with a poll too slow to matter (only Ray's death signal can act in time):
- `hall`: its actor's process is killed and Ray restarts it; the stream is re-added there;
- `annex`: its actor is killed for good; the stream moves to the spare actor.
Either way the new owner resumes after the last final: the audio spoken while no actor
listened is captioned, not skipped; the caption open at the kill is decoded again and
made final once; seq and segment ids go on without a gap or a double."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import jiwer
import pytest
import ray

from orchestrator import metrics
from orchestrator.config import parse_event
from orchestrator.router import Router
from orchestrator.runtime import AsrActor, EventRuntime
from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize, reference_text
from tests.waiting import eventually
from workers.asr import AsrHostOptions
from workers.bus import RedisBus
from workers.engines.embedded import EmbeddedEngineOptions
from workers.events import SAMPLE_RATE, AudioChunk

pytestmark = pytest.mark.integration

EVENT = """
event: failover
redis: {{url: "{url}"}}
streams:
  - {{id: hall, source: push, language: en}}
  - {{id: annex, source: push, language: en}}
"""
CHUNK = SAMPLE_RATE // 10
KILL_AT_S = 14.0  # inside the third sentence (12.0-17.0 s of the talk)
ACTORS = ("asr-0", "asr-1", "asr-2")  # hall, annex, spare


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_killed_asr_actors_hand_their_streams_on_and_the_speech_meanwhile_is_captioned(
        local_ray: None, bus: RedisBus, redis_url: str) -> None:
    pcm = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    pcm += bytes(3 * 2 * SAMPLE_RATE)  # the last sentence ends
    runtime = EventRuntime(parse_event(EVENT.format(url=redis_url)), redis_url=redis_url)
    cls = ray.remote(num_cpus=0, max_restarts=-1)(AsrActor)
    for actor_id in ACTORS:
        runtime.asr[actor_id] = cls.options(name=f"babelcast-failover-{actor_id}").remote(
            AsrHostOptions(actor_id=actor_id, redis_url=redis_url, max_streams=1,
                           read_block_ms=100),
            EmbeddedEngineOptions(model="tiny.en", cpu_threads=1))
    runtime.router = Router(budget=1, actors=list(ACTORS))
    readds = metrics.STREAM_READDS.labels(actor="asr-0")._value.get()
    moves = metrics.STREAM_MOVES.labels(actor="asr-2")._value.get()
    fed = [0]  # samples written to each stream so far
    at_kill = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def feed() -> None:
        t0 = time.monotonic()
        for i in range(0, len(pcm), CHUNK * 2):
            await asyncio.sleep(max(0.0, t0 + (i // 2 + CHUNK) / SAMPLE_RATE
                                    - time.monotonic()))
            for sid in ("hall", "annex"):
                await bus.add_audio(AudioChunk(sid, i // 2, pcm[i:i + CHUNK * 2], time.time()))
            fed[0] = i // 2 + CHUNK
            if fed[0] >= KILL_AT_S * SAMPLE_RATE:
                at_kill.set()

    hall, annex = runtime.asr["asr-0"], runtime.asr["asr-1"]
    try:
        await runtime.place_all()
        assert runtime.router.pins == {"hall": "asr-0", "annex": "asr-1"}
        first_pid = (await hall.state.remote())["pid"]
        tasks.append(asyncio.create_task(runtime.supervise(every_s=120)))
        tasks.append(asyncio.create_task(feed()))
        await asyncio.wait_for(at_kill.wait(), 60)
        ray.kill(hall, no_restart=False)  # the process dies; Ray starts another
        ray.kill(annex, no_restart=True)  # gone for good
        killed_at_s = fed[0] / SAMPLE_RATE

        async def hall_back() -> bool:
            try:
                state = await asyncio.wait_for(hall.state.remote(), 5)
                return state["pid"] != first_pid and bool(
                    await asyncio.wait_for(hall.streams.remote(), 5))
            except Exception:
                return False

        async def annex_moved() -> bool:
            return await asyncio.wait_for(runtime.asr["asr-2"].streams.remote(), 5) == [
                "annex"]

        await eventually(hall_back, 30, "hall on its restarted actor")
        back_at = {"hall": fed[0] / SAMPLE_RATE}
        await eventually(annex_moved, 30, "annex on the spare actor")
        back_at["annex"] = fed[0] / SAMPLE_RATE
        await tasks[1]

        async def settled() -> bool:
            for sid in ("hall", "annex"):
                last = await bus.last_caption(sid, "en")
                if last is None or not last.is_final or last.audio_end_s < 26.0:
                    return False
            return True

        await eventually(settled, 60, "the last sentences made final")
        status = {sid: await bus.get_status(sid) for sid in ("hall", "annex")}
    finally:
        for task in tasks:
            task.cancel()
        for handle in runtime.asr.values():
            ray.kill(handle, no_restart=True)

    assert runtime.router.pins == {"hall": "asr-0", "annex": "asr-2"}
    assert metrics.STREAM_READDS.labels(actor="asr-0")._value.get() == readds + 1
    assert metrics.STREAM_MOVES.labels(actor="asr-2")._value.get() == moves + 1
    for sid in ("hall", "annex"):
        caps = await bus.captions_after(sid, "en", 0, count=10_000)
        finals = [c for c in caps if c.is_final]
        text = normalize(" ".join(c.text for c in finals))
        wer = float(jiwer.wer(normalize(reference_text()), text))
        print(f"{sid}: killed at {killed_at_s:.1f} s of audio, back at {back_at[sid]:.1f} s, "
              f"WER {wer:.3f}, {len(finals)} finals")
        assert back_at[sid] > killed_at_s + 0.5, "the outage left no audio to catch up on"
        assert back_at[sid] < killed_at_s + 10, "the supervisor did not act on the death"
        assert [c.seq for c in caps] == list(range(1, len(caps) + 1)), "seq must go on"
        ids = [c.segment_id for c in finals]
        assert ids == sorted(set(ids)), "a caption was made final twice"
        assert {c.segment_id for c in caps} == set(ids), "a caption was left open"
        # The sentence under way at the kill was decoded again from its start: one final
        # spans the kill; speech spoken while no actor listened is in the captions.
        assert any(f.audio_start_s < killed_at_s - 0.5 and f.audio_end_s > killed_at_s + 0.5
                   for f in finals), [(f.audio_start_s, f.audio_end_s) for f in finals]
        assert wer <= 0.15, text
        assert status[sid].get("resumes") == "1"
