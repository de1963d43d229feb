"""GPU tier, production shape: the runtime's own ASR actor on the GPU under Ray (the
`vllm` engine with re-anchoring, its VAD in a helper process), audio written into a
real Redis as ingest writes it, captions read back out of Redis. Then the engine core
is SIGKILLed: the actor reports a dead engine, the supervisor replaces the actor, the
new one loads the model again and the stream is captioned again, seq continuing.

Runs where BABELCAST_VOXTRAL_DIR is set (see test_vllm_engine.py); needs Ray, the Redis
client and a redis-server on PATH (`EXTRAS=1` staging for the lent H200).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.tier import gpu_tier

pytestmark = pytest.mark.gpu

MODEL_DIR = gpu_tier(modules=("vllm", "ray"), tools=("nvidia-smi", "redis-server"))

import psutil  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from orchestrator.config import parse_event  # noqa: E402
from orchestrator.redis_server import LocalRedisServer  # noqa: E402
from orchestrator.runtime import EventRuntime  # noqa: E402
from tests.gpu.voxtral_model import short_window_copy  # noqa: E402
from tests.speech import AUDIO  # noqa: E402
from workers.bus import RedisBus  # noqa: E402
from workers.events import SAMPLE_RATE, AudioChunk  # noqa: E402

EVENT = """
event: gpu production path
redis: {{url: "{url}"}}
engine:
  kind: vllm
  model: {model}
  actors: 1
  streams_per_actor: 2
  vllm: {{max_model_len: 2048, gpu_memory_utilization: 0.45, load_format: babelcast_scaled,
          reanchor: "on", reanchor_every: 256}}
  session: {{rut_chars_per_speech_s: 0}}
streams:
  - {{id: hall, source: push, language: auto}}
"""
REPORT: dict[str, Any] = {}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    server = LocalRedisServer()
    yield server.start()
    server.stop()


def speech() -> bytes:
    import soundfile

    data, rate = soundfile.read(str(AUDIO / "room-a.flac"), dtype="int16")
    assert rate == SAMPLE_RATE
    return bytes(data.tobytes())


async def feed(bus: RedisBus, pcm: bytes, stop: asyncio.Event) -> None:
    """Real speech, looped, at wall-clock pace in 100 ms entries (what ingest writes)."""
    step = SAMPLE_RATE // 10
    pos, t0 = 0, time.monotonic()
    while not stop.is_set():
        off = (pos * 2) % (len(pcm) - step * 2)
        await bus.add_audio(AudioChunk("hall", pos, pcm[off : off + step * 2], time.time()))
        pos += step
        await asyncio.sleep(max(0.0, t0 + pos / SAMPLE_RATE - time.monotonic()))


def engine_cores() -> list[psutil.Process]:
    """vLLM engine-core processes (named VLLM::EngineCore) under a Ray ASR actor."""
    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            text = " ".join([*(p.info["cmdline"] or []), p.info["name"] or ""])
            if "EngineCore" in text:
                parents = " ".join(" ".join(q.cmdline()) for q in p.parents())
                if "AsrActor" in parents:
                    found.append(p)
        except psutil.Error:
            continue
    return found


async def test_asr_actor_on_the_gpu_captions_from_redis_and_survives_an_engine_crash(
        redis_server: str, tmp_path: Path) -> None:
    model = short_window_copy(MODEL_DIR, tmp_path / "voxtral-w256", 256)
    cfg = parse_event(EVENT.format(url=redis_server, model=model))
    runtime = EventRuntime(cfg)
    runtime.start_services()
    redis = Redis.from_url(redis_server)
    bus = RedisBus(redis)
    stop = asyncio.Event()
    feeder: asyncio.Task[None] | None = None
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(runtime.start_actors(), 600)  # loads the model in the actor
        REPORT["engine_start_s"] = round(time.monotonic() - t0, 1)
        actor = runtime.asr["asr-0"]
        state = await actor.state.remote()
        REPORT["state"] = state
        assert state["engine_ok"] and state["engine_mode"] == "reanchor", state

        feeder = asyncio.create_task(feed(bus, speech(), stop))

        async def seq() -> int:
            last = await bus.last_caption("hall", "src")
            return last.seq if last else 0

        async def until(cond: Any, limit_s: float, what: str) -> None:
            deadline = time.monotonic() + limit_s
            while not await cond():
                assert time.monotonic() < deadline, f"timed out: {what}"
                await asyncio.sleep(0.5)

        async def some() -> bool:
            return await seq() >= 10

        await until(some, 120, "captions from the GPU actor")
        REPORT["first_captions_s"] = round(time.monotonic() - t0, 1)

        cores = engine_cores()
        assert len(cores) == 1, [c.info for c in cores]
        seq_at_kill = await seq()
        cores[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        async def dead() -> bool:
            s = await actor.state.remote()
            return s.get("engine_ok") is False

        await until(dead, 60, "the actor to report its engine dead")
        REPORT["dead_noticed_s"] = round(time.monotonic() - killed_at, 1)
        problems = await runtime.reconcile()
        assert problems == ["asr-0: engine dead, actor replaced"], problems

        async def readded() -> bool:
            await runtime.reconcile()
            try:
                return "hall" in await asyncio.wait_for(actor.streams.remote(), 10)
            except Exception:
                return False

        await until(readded, 600, "the stream on the replacement actor")
        REPORT["replaced_and_loaded_s"] = round(time.monotonic() - killed_at, 1)

        async def again() -> bool:
            return await seq() >= seq_at_kill + 10

        await until(again, 120, "captions after the replacement")
        REPORT["captions_again_s"] = round(time.monotonic() - killed_at, 1)
        state = await actor.state.remote()
        assert state["engine_ok"] and state["engine_mode"] == "reanchor", state
        segs = await bus.captions_after("hall", "src", 0, count=100_000)
        seqs = [s.seq for s in segs]
        assert seqs == list(range(1, len(seqs) + 1)), "seq must continue without a gap"
        finals = [s.segment_id for s in segs if s.is_final]
        assert finals == sorted(set(finals)), "a final was published twice"
        REPORT["captions"] = len(segs)
        REPORT["actor_status"] = {k.decode(): v.decode() for k, v in
                                  (await redis.hgetall("actor:asr-0")).items()}
    finally:
        stop.set()
        if feeder is not None:
            await feeder
        await runtime.stop()
        runtime.stop_services()
        await redis.aclose()
        out = os.environ.get("OUT")
        if out:
            await asyncio.to_thread(Path(out, "gpu_actor_report.json").write_text,
                                    json.dumps(REPORT, indent=1, default=str))
