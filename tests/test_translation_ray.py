"""Two translator actors on a real local Ray, real Redis, real embedded backends: one is
killed while it holds jobs, and every final still gets exactly one translation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from orchestrator.actor_options import translation_backends, translation_host_options
from orchestrator.config import parse_event
from orchestrator.ray_actors import TranslatorActor
from tests.translation_jobs import enqueue_talk, published
from tests.waiting import eventually
from translation.jobs import GROUP
from workers.bus import JOBS_KEY, RedisBus, actor_key

pytestmark = pytest.mark.integration


EVENT = """
event: translators
redis: {{url: "{url}"}}
streams:
  - {{id: talk, source: push, language: en, targets: [es, pt]}}
translation: {{actors: 2, batch_size: 8, claim_idle_s: 2, timeout_s: 60}}
glossary:
  - {{term: Dashwood, keep: true}}
"""


async def _pending_of(bus: RedisBus, consumer: str) -> int:
    info = await bus.redis.xpending_range(JOBS_KEY, GROUP, min="-", max="+", count=1000,
                                          consumername=consumer)
    return len(info)


async def test_killing_one_of_two_translators_loses_no_translation(
        local_ray: None, bus: RedisBus, redis_url: str) -> None:
    cfg = parse_event(EVENT.format(url=redis_url))
    warm = translation_backends(cfg)
    assert warm == ["apertium", "bergamot"]
    cls = ray.remote(num_cpus=0, max_restarts=0)(TranslatorActor)
    actors: dict[str, Any] = {
        tid: cls.remote(translation_host_options(cfg, tid, redis_url), warm)
        for tid in ("translator-0", "translator-1")
    }
    await asyncio.gather(*(a.start.remote() for a in actors.values()))
    jobs = await enqueue_talk(bus, "talk", ("es", "pt"), copies=40)

    async def victim_holds_jobs() -> bool:
        return await _pending_of(bus, "translator-0") > 0

    await eventually(victim_holds_jobs, 30, "translator-0 to hold jobs", every_s=0.01)
    ray.kill(actors["translator-0"], no_restart=True)
    survivor = actors["translator-1"]

    async def all_out() -> bool:
        counts = [len(await published(bus, "talk", lang)) for lang in ("es", "pt")]
        return min(counts) >= len(jobs)

    await eventually(all_out, 120, "every job translated after the kill", every_s=0.5)
    await asyncio.sleep(1.0)  # time for a duplicate to show, if one were coming
    for lang in ("es", "pt"):
        segs = await published(bus, "talk", lang)
        ids = [s.segment_id for s in segs]
        assert sorted(ids) == [j.segment_id for j in jobs], f"{lang}: each final exactly once"
        bad = [(s.segment_id, s.is_final, len(s.text), s.error) for s in segs
               if not (s.is_final and s.text and s.error is None)]
        assert not bad, f"{lang}: (segment, final, chars, error) not translated: {bad}"
        assert [s.seq for s in segs] == list(range(1, len(jobs) + 1))
    stats = await survivor.stats.remote()
    assert stats.get("claimed", 0) > 0, "the survivor took over the killed one's jobs"
    summary = await bus.redis.xpending(JOBS_KEY, GROUP)
    assert summary["pending"] == 0
    # What the survivor reports for operators (and bench.translation) is in Redis.
    fields = await bus.redis.hgetall(actor_key("translator-1"))
    assert float(fields[b"finals_published"]) > 0
    await survivor.stop.remote()
    ray.kill(survivor)
