"""Liveness and readiness of a running event.

`/livez` answers 200 while the gateway process serves at all (restart it if not).
`/healthz` is readiness: 200 only when Redis answers and nothing that claims to be live
has gone quiet: a stream whose source says `live` must have audio newer than
`AUDIO_STALE_S`; every actor of the event (ASR, ingest, translators) must have
reported within `status.STALE_S` (they report every second). During a Redis outage
it answers 503, so a load balancer or an operator's probe sees what viewers see.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from orchestrator.status import ACTORS_KEY, STALE_S
from workers.bus import RedisBus, actor_key, as_str

AUDIO_STALE_S = 10.0
"""A live source writes every 100 ms; ten seconds without audio is a dead source."""


async def readiness(bus: RedisBus, stream_ids: Sequence[str],
                    now: float | None = None) -> tuple[bool, dict[str, Any]]:
    now = time.time() if now is None else now
    try:
        await bus.redis.ping()
    except Exception as exc:
        return False, {"ok": False, "redis": f"unreachable ({type(exc).__name__})"}
    problems: list[str] = []
    try:
        for sid in stream_ids:
            status = await bus.get_status(sid)
            if status.get("source_state") == "live":
                _, wall = await bus.last_audio_end(sid)
                if wall is None or now - wall > AUDIO_STALE_S:
                    age = "no audio" if wall is None else f"no audio for {now - wall:.0f} s"
                    problems.append(f"stream {sid}: source live but {age}")
        for member in sorted(as_str(m) for m in await bus.redis.smembers(ACTORS_KEY)):
            updated = await bus.redis.hget(actor_key(member), "updated")
            if updated is not None and now - float(updated) > STALE_S:
                problems.append(f"actor {member}: silent for {now - float(updated):.0f} s")
    except Exception as exc:
        return False, {"ok": False, "redis": f"read failed ({type(exc).__name__})"}
    return not problems, {"ok": not problems, "redis": "ok", "problems": problems}
