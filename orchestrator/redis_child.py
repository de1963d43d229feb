"""Keeps `babelcast run`'s local redis-server alive: restarted on the same port and data
folder when it dies, so it comes back with its append-only file (see redis_server)."""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator import metrics
from orchestrator.redis_server import LocalRedisServer, RedisServerError

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5
READY_TIMEOUT_S = 30.0  # loading a large append-only file takes a while


async def keep_alive(server: LocalRedisServer, every_s: float = CHECK_EVERY_S) -> None:
    """Runs until cancelled, on the event loop's thread (the child's parent-death
    signal follows the thread that started it)."""
    delay = every_s
    while True:
        await asyncio.sleep(delay)
        if server.alive():
            delay = every_s
            continue
        log.error("the local redis-server (port %s) died; starting it again from %s",
                  server.port, server.data_dir or "nothing (no data folder)")
        started = time.monotonic()
        try:
            server.spawn()
            while not server.ready():
                if time.monotonic() - started > READY_TIMEOUT_S:
                    raise RedisServerError("did not answer")
                await asyncio.sleep(0.05)
        except RedisServerError as exc:
            log.error("redis-server restart failed: %s; trying again", exc)
            delay = min(5.0, delay * 2)
            continue
        server.restarts += 1
        metrics.REDIS_RESTARTS.inc()
        log.warning("local redis-server is back after %.1f s", time.monotonic() - started)
