"""Seq numbers never go back, even when Redis comes back empty.

Clients resume by seq, so a (stream, lang) must never give a seq twice. When Redis
restarts from its append-only file it comes back at most a second short; when it
restarts empty (no persistence, a new server) the Streams are gone and the next
publication would start over at seq 1: every client at seq 40 would take it for a
caption it already has.

`EpochGuard` runs in `babelcast run`. At start it sets `babelcast:epoch` (a random id)
unless Redis has one. Every `every_s` it reads each caption key's last generated id
and keeps the highest it has seen (also what the gateway delivered, which may be newer
than its last read). When the epoch key is gone, Redis was emptied: it sets every
caption key's last generated id back to that floor (an entry added and deleted, so the
Stream is empty but takes only higher ids), then sets a new epoch. Translators publish
only under the epoch they know and wait for the new one (translation.host); the ASR
side keeps its seq in memory and continues above the floor. A key found below its
floor without the epoch changing (an append-only file that lost its last second) is
raised to the floor the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence

from redis.asyncio import Redis

from workers.bus import EPOCH_KEY, RedisBus, captions_key

log = logging.getLogger(__name__)

_RAISE_FLOOR = """
local top = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      top = tonumber(string.match(info[i + 1], '^(%d+)'))
    end
  end
end
local floor = tonumber(ARGV[1])
if top >= floor then return 0 end
redis.call('XADD', KEYS[1], floor .. '-0', 'd', '')
redis.call('XDEL', KEYS[1], floor .. '-0')
return 1
"""


class EpochGuard:
    def __init__(self, redis: Redis, keys: Sequence[tuple[str, str]], *,
                 seen: Callable[[], Mapping[str, int]] | None = None,
                 on_reset: Callable[[], Awaitable[None]] | None = None,
                 every_s: float = 0.5) -> None:
        self.bus = RedisBus(redis)
        self.keys = list(keys)
        self._seen = seen
        self._on_reset = on_reset
        self.every_s = every_s
        self.floors: dict[tuple[str, str], int] = {}
        self.epoch = ""
        self.resets = 0
        self.raised = 0

    async def start(self) -> str:
        """Adopt Redis's epoch, or set one; returns it."""
        await self.bus.redis.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        self.epoch = await self.bus.epoch()
        await self._read_floors()
        return self.epoch

    async def _read_floors(self) -> None:
        seen = dict(self._seen()) if self._seen is not None else {}
        for stream, lang in self.keys:
            top = await self.bus.last_seq(stream, lang)
            key = (stream, lang)
            self.floors[key] = max(self.floors.get(key, 0), top,
                                   seen.get(captions_key(stream, lang), 0))

    async def check(self) -> None:
        """One round: detect an emptied Redis (or a key below its floor) and repair."""
        epoch = await self.bus.epoch()
        reset = epoch == ""
        if not reset and epoch != self.epoch:
            self.epoch = epoch  # another orchestrator (or a restore) set it: adopt
        if reset:
            log.warning("Redis came back empty (no %s); continuing every caption seq from "
                        "where it was", EPOCH_KEY)
        seen = dict(self._seen()) if self._seen is not None else {}
        for stream, lang in self.keys:
            key = (stream, lang)
            floor = max(self.floors.get(key, 0), seen.get(captions_key(stream, lang), 0))
            top = await self.bus.last_seq(stream, lang)
            if top < floor:  # the script checks again, atomically
                raised = await self.bus.redis.eval(_RAISE_FLOOR, 1, captions_key(stream, lang),
                                                   floor)
                if int(raised) and not reset:
                    self.raised += 1
                    log.warning("%s was behind seq %d (Redis lost recent data); raised",
                                captions_key(stream, lang), floor)
            self.floors[key] = max(floor, top)
        if reset:
            self.epoch = uuid.uuid4().hex
            await self.bus.redis.set(EPOCH_KEY, self.epoch)
            self.resets += 1
            if self._on_reset is not None:
                with contextlib.suppress(Exception):
                    await self._on_reset()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next round tries again
                log.debug("epoch check skipped: %s", type(exc).__name__)
