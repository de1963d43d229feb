"""The ASR actors' engines start side by side when an event starts (real local Ray, real
Redis, the embedded engine): an actor's first stream starts its engine, and the runtime
used to hand the streams over one actor after another, so N vLLM engines took N times a
minute or more before the last actor's rooms had captions (the 75-stream product run on
the H200, 2026-12-05, spent its 10-minute call that way)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from orchestrator.actor_options import engine_options
from orchestrator.config import parse_event
from orchestrator.ray_actors import AsrActor
from orchestrator.router import Router
from orchestrator.runtime import EventRuntime
from workers.asr import AsrHostOptions

pytestmark = pytest.mark.integration

EVENT = """
event: actors start together
redis: {{url: "{url}"}}
engine: {{kind: embedded, model: tiny.en, cpu_threads: 1, actors: 2, streams_per_actor: 1}}
streams:
  - {{id: hall, source: push, language: en}}
  - {{id: annex, source: push, language: en}}
"""


async def test_every_actors_engine_starts_while_the_others_do(
        local_ray: None, redis_url: str) -> None:
    cfg = parse_event(EVENT.format(url=redis_url))
    runtime = EventRuntime(cfg, redis_url=redis_url)
    cls = ray.remote(num_cpus=0, max_restarts=-1)(AsrActor)
    for i in range(2):
        runtime.asr[f"asr-{i}"] = cls.options(name=f"babelcast-test-start-{i}").remote(
            AsrHostOptions(actor_id=f"asr-{i}", redis_url=redis_url, max_streams=1),
            engine_options(cfg))
    try:
        # Both processes are up and no engine has started (that waits for a stream), so
        # what follows measures the hand-over alone, not Ray starting workers.
        for actor in runtime.asr.values():
            assert (await actor.state.remote())["started"] is False
        runtime.router = Router(budget=1, actors=list(runtime.asr))
        await runtime.place_all()
        assert runtime.router.pins == {"hall": "asr-0", "annex": "asr-1"}
        spans = []
        for actor in runtime.asr.values():
            state = await actor.state.remote()
            began = state["engine_start_at"]
            spans.append((began, began + state["engine_start_s"]))
            assert state["engine_start_s"] > 0
        # Side by side: each engine's start began before the other's ended. One after
        # another (the old hand-over), the second began only after the first had ended.
        assert max(b for b, _ in spans) < min(e for _, e in spans), spans
    finally:
        await asyncio.gather(*(a.stop.remote() for a in runtime.asr.values()))
        for actor in runtime.asr.values():
            ray.kill(actor)
