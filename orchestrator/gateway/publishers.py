"""One publisher per push stream, across every gateway process: a lease in Redis.

With several gateway workers (or `babelcast gateway` on other machines) a second
publisher of a stream may land on another process than the first, whose in-memory claim
(`limits.ConnectionCaps`) it cannot see. So a publisher also holds
`babelcast:publisher:{stream}`: set only if absent (SET NX) with a random token and a
`LEASE_S` expiry, renewed every `RENEW_S` while its socket is open and deleted (only if
still its own) when it closes. A worker killed with its publisher's socket open cannot
delete the key; the expiry frees the stream `LEASE_S` later (a dropped connection was
already held as long: uvicorn pings every 20 s). A renewal that finds the key gone (it
expired while Redis or the host stood still, or Redis restarted empty) takes it back:
only a lease another publisher holds closes the publisher (4409).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

log = logging.getLogger(__name__)

LEASE_S = 15
RENEW_S = 5.0
RELEASE_WAIT_S = 2.0
"""How long `release()` waits for the renewal to stop before it frees the lease anyway."""

# Held by us: extended. Held by nobody (it expired while Redis, or this host, stood
# still past LEASE_S, or Redis restarted empty): taken back, since no one else has the
# stream. Only a lease another publisher holds is lost (0).
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def lease_key(stream: str) -> str:
    return f"babelcast:publisher:{stream}"


class PublisherLease:
    """The lease of one publisher connection. `claim()` is False when another holds the
    stream; raises what redis-py raises when Redis is away. `on_lost` is awaited when a
    renewal finds the lease gone (it expired through a long Redis outage and another
    publisher took the stream)."""

    def __init__(self, redis: Redis, stream: str, on_lost: Callable[[], Awaitable[None]]) -> None:
        self._redis = redis
        self.stream = stream
        self._key = lease_key(stream)
        self._token = secrets.token_hex(16)
        self._on_lost = on_lost
        self._renewer: asyncio.Task[None] | None = None
        self._released = False

    async def claim(self) -> bool:
        if not await self._redis.set(self._key, self._token, nx=True, ex=LEASE_S):
            return False
        self._renewer = asyncio.create_task(self._renew(), name=f"lease-{self.stream}")
        return True

    async def _renew(self) -> None:
        # The flag, not only the cancel, ends the loop: a cancel that lands inside a Redis
        # call can come out of redis-py as another exception (or not at all), which the
        # loop below would take for Redis being away and go on; `release()` then waited
        # for it for ever (seen once in the suite: 300 s, the renewal still running).
        while not self._released:
            await asyncio.sleep(RENEW_S)
            if self._released:
                return
            try:
                held = await self._redis.eval(
                    _RENEW, 1, self._key, self._token, LEASE_S * 1000)
            except Exception as exc:  # Redis away: the audio path reports it; try again
                log.debug("publisher lease renewal failed: %s", type(exc).__name__)
                continue
            if not held:
                log.warning("stream %s: publisher lease lost (Redis was away longer than "
                            "%d s and another publisher took the stream)", self.stream,
                            LEASE_S)
                await self._on_lost()
                return

    async def release(self) -> None:
        if self._renewer is None:
            return
        self._released = True
        self._renewer.cancel()
        # bounded: a Redis call in flight may take its own timeout to give up
        done, _ = await asyncio.wait({self._renewer}, timeout=RELEASE_WAIT_S)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a renewal's error is nobody's now
        self._renewer = None
        with contextlib.suppress(Exception):  # Redis away: the expiry frees it
            await self._redis.eval(_RELEASE, 1, self._key, self._token)
