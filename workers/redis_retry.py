"""Riding out a Redis restart: retry an operation until Redis answers again.

Redis restarting (a crash, a failover, the local child being restarted) shows as
connection errors for a few seconds. Audio and captions in flight are held and written
once it is back instead of being dropped, and the task that holds them stays alive;
without this, file ingest died for good on the first error and the ASR side skipped a
seq for the caption it could not write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

RETRYABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError,
                                              ConnectionError, TimeoutError)
"""Redis unreachable, restarting or still loading its data (BusyLoadingError is a
ConnectionError); never a command error, which would fail again the same way."""

FIRST_DELAY_S = 0.1
MAX_DELAY_S = 1.0


async def retry_redis(op: Callable[[], Awaitable[T]], *, what: str, log: logging.Logger,
                      max_wait_s: float | None = None) -> T:
    """`op()`, retried with backoff (0.1 s doubling to 1 s) while Redis is unreachable;
    after `max_wait_s` (None: never) the last error is raised."""
    started = time.monotonic()
    delay = FIRST_DELAY_S
    warned = False
    while True:
        try:
            result = await op()
        except RETRYABLE as exc:
            if max_wait_s is not None and time.monotonic() - started >= max_wait_s:
                raise
            if not warned:
                log.warning("%s: Redis unavailable (%s); holding it and retrying", what,
                            type(exc).__name__)
                warned = True
            await asyncio.sleep(delay)
            delay = min(MAX_DELAY_S, delay * 2)
            continue
        if warned:
            log.warning("%s: Redis is back after %.1f s", what, time.monotonic() - started)
        return result
