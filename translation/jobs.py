"""The translation job queue: the Redis Stream `mt:jobs` read through one consumer group.

Every translator is a consumer of the group `translators`. A job it reads stays in
its pending list until it acks it (after publishing every target). A translator
that dies leaves its jobs pending; any other translator re-claims jobs idle for
longer than `claim_idle_s` with XAUTOCLAIM, so no job is lost. A translator that
restarts under the same consumer name first re-reads its own pending jobs.

When Redis comes back without the group (emptied, or the group's creation was lost),
reads answer NOGROUP: the group is created again at the last job id this consumer
has seen, so jobs enqueued since are read and jobs already done are not translated
again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from workers.bus import JOBS_KEY, as_str, job_from_json
from workers.events import TranslationJob

log = logging.getLogger(__name__)

GROUP = "translators"


@dataclass(frozen=True, slots=True)
class Delivery:
    entry_id: str
    job: TranslationJob | None
    """None: the entry could not be decoded (acked and counted, never retried)."""
    claimed: bool = False
    """True when re-claimed from another (dead or stuck) consumer."""


class JobQueue:
    def __init__(self, redis: Redis, consumer: str, *, claim_idle_s: float = 10.0) -> None:
        self.redis: Any = redis
        self.consumer = consumer
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self._own_pending_done = False
        self._claim_cursor = "0-0"
        self.undecodable = 0
        self.last_seen_id = "0"
        self.groups_recreated = 0

    async def ensure_group(self, start_id: str = "0") -> None:
        # From the start of the Stream: jobs enqueued before any translator came up
        # are translated too (publishing is idempotent per segment, so an old job
        # that was already done publishes nothing).
        try:
            await self.redis.xgroup_create(JOBS_KEY, GROUP, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _recreate_on_nogroup(self, exc: ResponseError) -> None:
        if "NOGROUP" not in str(exc):
            raise exc
        log.warning("translation job group is gone (Redis restarted empty?); creating it "
                    "again after job %s", self.last_seen_id)
        self.groups_recreated += 1
        self._own_pending_done = False
        self._claim_cursor = "0-0"
        await self.ensure_group(self.last_seen_id)

    def _decode(self, entries: list[Any], claimed: bool) -> list[Delivery]:
        out: list[Delivery] = []
        for entry_id, fields in entries:
            if _id_key(as_str(entry_id)) > _id_key(self.last_seen_id):
                self.last_seen_id = as_str(entry_id)
            if fields is None:  # deleted (trimmed) while pending
                out.append(Delivery(as_str(entry_id), None, claimed))
                continue
            try:
                job: TranslationJob | None = job_from_json(fields[b"d"])
            except (KeyError, ValueError, TypeError) as exc:
                self.undecodable += 1
                log.warning("undecodable translation job %s: %s", as_str(entry_id),
                            type(exc).__name__)
                job = None
            out.append(Delivery(as_str(entry_id), job, claimed))
        return out

    def reread_pending(self) -> None:
        """Read this consumer's own pending jobs again (after a batch failed)."""
        self._own_pending_done = False

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        """New jobs for this consumer (its own pending ones first, after a restart)."""
        try:
            return await self._read(count, block_ms)
        except ResponseError as exc:
            await self._recreate_on_nogroup(exc)
            return []

    async def _read(self, count: int, block_ms: int) -> list[Delivery]:
        if not self._own_pending_done:
            resp = await self.redis.xreadgroup(GROUP, self.consumer, {JOBS_KEY: "0"},
                                               count=count)
            entries = resp[0][1] if resp else []
            if entries:
                return self._decode(entries, claimed=True)
            self._own_pending_done = True
        resp = await self.redis.xreadgroup(GROUP, self.consumer, {JOBS_KEY: ">"},
                                           count=count, block=block_ms)
        return self._decode(resp[0][1], claimed=False) if resp else []

    async def claim(self, count: int) -> list[Delivery]:
        """Jobs other consumers have held for longer than `claim_idle_s`."""
        try:
            resp = await self.redis.xautoclaim(JOBS_KEY, GROUP, self.consumer,
                                               min_idle_time=self.claim_idle_ms,
                                               start_id=self._claim_cursor, count=count)
        except ResponseError as exc:
            await self._recreate_on_nogroup(exc)
            return []
        next_id, entries = as_str(resp[0]), resp[1]
        self._claim_cursor = next_id
        deleted = resp[2] if len(resp) > 2 else []
        out = self._decode(entries, claimed=True)
        out += [Delivery(as_str(d), None, True) for d in deleted]
        return out

    async def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            try:
                await self.redis.xack(JOBS_KEY, GROUP, *entry_ids)
            except ResponseError as exc:  # the group went with an emptied Redis
                await self._recreate_on_nogroup(exc)

    async def depth(self) -> dict[str, float]:
        """Queue figures for metrics: pending (read, not acked), lag (not yet read),
        and the age in seconds of the oldest job not acked."""
        groups = await self.redis.xinfo_groups(JOBS_KEY)
        info = next((g for g in groups if as_str(g["name"]) == GROUP), None)
        if info is None:
            return {"pending": 0, "lag": 0, "oldest_age_s": 0.0}
        pending = int(info.get("pending", 0))
        lag = int(info.get("lag") or 0)
        oldest_id: str | None = None
        if pending:
            summary = await self.redis.xpending(JOBS_KEY, GROUP)
            oldest_id = as_str(summary["min"]) if summary.get("min") else None
        elif lag:
            last = as_str(info.get("last-delivered-id", "0-0"))
            after = await self.redis.xrange(JOBS_KEY, min=f"({last}", count=1)
            oldest_id = as_str(after[0][0]) if after else None
        age = 0.0
        if oldest_id is not None:
            t = await self.redis.time()
            now_ms = t[0] * 1000 + t[1] // 1000
            age = max(0.0, (now_ms - int(oldest_id.split("-")[0])) / 1000)
        return {"pending": pending, "lag": lag, "oldest_age_s": round(age, 3)}


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    try:
        return int(ms), int(n or 0)
    except ValueError:
        return 0, 0
