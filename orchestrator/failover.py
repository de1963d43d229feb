"""The supervisor's failover, a part of `EventRuntime` (orchestrator/runtime.py).

The ASR actors' leases (workers/lease.py) are read every 0.1 s: an actor whose lease
lapsed is down at once, and one that answers with a dead engine is replaced. The streams
of an actor that is down move to the least loaded actors that are up and have room; a
stream whose captions stay behind real time moves to an actor that keeps up. Each resumes
on its new actor from its ASR cursor in Redis. docs/failover.md tells the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrator import metrics
from orchestrator.actor_options import stream_options
from orchestrator.config import EventConfig, StreamConfig
from orchestrator.router import Router
from workers.aio import wait_for
from workers.bus import RedisBus, connect_redis

log = logging.getLogger(__name__)

T = TypeVar("T")


class LeaseLapsed(Exception):
    """An ASR actor's lease lapsed while a call to it was pending (Failover.ask)."""


SPARE_WARM_DELAY_S = 5.0
"""A restarted ASR actor (its streams moved) starts its engine this long after it answers,
once the moved streams have caught up: it is then a warm spare."""


class Failover:
    """Lease watching, and moves of streams off actors that are down or behind: the
    methods of `EventRuntime` that keep its streams captioned when an actor fails."""

    # EventRuntime's fields (see there) that this part reads and writes
    cfg: EventConfig
    redis_url: str
    asr: dict[str, Any]
    router: Router | None
    _replacing: dict[str, int]
    _down_since: dict[str, float]
    _behind_since: dict[str, float]
    _lag_moved_at: dict[str, float]
    _lag_left_at: dict[str, float]
    _lagging_actors: set[str]
    _lease_seen: set[str]
    _lease_lapsed: dict[str, float]
    _lease_stale: dict[str, Any]
    _probing: set[str]
    lease_redis_restarts: int
    lease_all_lapsed: int
    _background: set[asyncio.Task[None]]

    if TYPE_CHECKING:  # EventRuntime's methods this part calls
        def _replace_dead_engine(self, actor_id: str, handle: Any, state: dict[str, Any]
                                 ) -> None: ...
        def _export_placement(self) -> None: ...
        def _actor_up(self, actor_id: str, role: str, up: bool) -> None: ...
        async def _report_status(self) -> None: ...

    async def ask(self, actor_id: str, call: Awaitable[T], timeout_s: float) -> T:
        """`await call` (a Ray call to the ASR actor `actor_id`) for at most `timeout_s`,
        cut short with `LeaseLapsed` as soon as the actor's lease lapses meanwhile. A pass
        asks every actor in turn, and one that froze or vanished just before the pass
        reached it does not answer: without this the pass waited its whole timeout (20 s)
        even though the lease said "down" after 1.5 s, and every stream of every actor
        waited with it (a node vanished on a loaded 2-core host: the pass held 2 s on it
        after its lease lapsed, 2026-12-04)."""
        task = asyncio.ensure_future(call)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{actor_id} did not answer in {timeout_s} s")
                done, _ = await asyncio.wait({task}, timeout=min(0.1, left))
                if done:
                    return task.result()
                if actor_id in self._lease_lapsed:
                    raise LeaseLapsed(actor_id)
        finally:
            if not task.done():
                task.cancel()

    def _mark_lapsed(self, actor_id: str, handle: Any, now: float,
                     problems: list[str]) -> None:
        """Down at once (its streams move at the end of this pass); asked over Ray in the
        background only, where a dead engine gets the actor replaced."""
        problems.append(f"{actor_id}: lease lapsed")
        self._actor_up(actor_id, "asr", False)
        # down for sure: no restart to wait for (a death signal's pass may have started
        # that wait already)
        self._down_since[actor_id] = min(self._down_since.get(actor_id, now),
                                         now - self.cfg.engine.failover_after_s)
        self._probe_lapsed(actor_id, handle)

    def _probe_lapsed(self, actor_id: str, handle: Any, timeout_s: float = 5.0) -> None:
        """Ask an actor whose lease lapsed how it is, off the pass: one that answers
        with a dead engine is replaced (Ray restarts it without its engine's fault); one
        that Ray restarted (its host starts on first use) is started, so its engine loads
        and its lease comes back: a warm spare; one that does not answer (vanished,
        frozen) is Ray's to notice."""
        if actor_id in self._probing:
            return

        async def probe() -> None:
            try:
                state = await wait_for(handle.state.remote(), timeout_s)
                if state.get("started") and state.get("engine_ok") is False and \
                        self._replacing.get(actor_id) != state.get("pid"):
                    dead_pid = state.get("pid")
                    self._replace_dead_engine(actor_id, handle, state)
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:  # until Ray's new process answers
                        await asyncio.sleep(0.5)
                        with contextlib.suppress(Exception):
                            state = await wait_for(handle.state.remote(), timeout_s)
                            if state.get("pid") != dead_pid:
                                break
                if not state.get("started"):
                    # after the moved streams' catch-up: a model load beside it (CPU
                    # actors) slowed their first captions by seconds on 2 cores. Streams
                    # still pinned to it (nowhere had room) wait for it: no delay then.
                    assert self.router is not None
                    if actor_id not in self.router.pins.values():
                        await asyncio.sleep(SPARE_WARM_DELAY_S)
                    await wait_for(handle.health.remote(), 600)
            except Exception as exc:  # out of reach: nothing to do here
                log.info("ASR actor %s (lease lapsed) did not answer: %s", actor_id,
                         type(exc).__name__)
            finally:
                self._probing.discard(actor_id)

        self._probing.add(actor_id)
        task = asyncio.create_task(probe())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def withdraw_lease(self, actor_id: str) -> bool:
        """Ray says the ASR actor's process is gone (a watch on it failed): its lease ends
        now instead of at its expiry, so its streams move at once. On the lent H200 Ray's
        signal came before the lease lapsed and streams moved ~3 s after the kill, against
        ~2 s for a frozen node (bench/results/failover/README.md; the log has no times:
        most likely the pass the signal started waited on the restarting actor). The key
        is deleted (GETDEL), so a renewal the process made just before it died cannot look
        like it is back, and the value deleted is kept, so a read in flight across the
        delete cannot either. A process that is in fact alive renews within `RENEW_S`: its
        lease is back, and a stream moved off it meanwhile is removed there (the new
        owner's claim fences its captions).
        False where leases are off, this actor's was never seen, or it had lapsed already."""
        from workers.lease import lease_key

        if not self.cfg.engine.lease_ttl_s or actor_id not in self._lease_seen:
            return False
        try:
            redis = connect_redis(self.redis_url)
            try:
                held = await wait_for(redis.getdel(lease_key(actor_id)), 1.0)
            finally:
                await redis.aclose()
        except Exception as exc:  # Redis away: the lease lapses on its own
            log.warning("ASR actor %s: lease not withdrawn: %s", actor_id,
                        type(exc).__name__)
            return False
        if held is not None:
            self._lease_stale[actor_id] = held
        elif actor_id not in self._lease_seen:  # it lapsed on its own, and the reader saw it
            return False
        # The reader may have read the key between the delete and here and taken it for a
        # lapse: the withdraw is still this call's, and the lapse is counted once.
        self._lease_seen.discard(actor_id)
        if actor_id not in self._lease_lapsed:
            self._lease_lapsed[actor_id] = time.monotonic()
            metrics.LEASE_LAPSES.labels(actor=actor_id).inc()
        log.warning("ASR actor %s: Ray says its process is gone; lease withdrawn, moving "
                    "its streams", actor_id)
        return True

    async def watch_leases(self, every_s: float = 0.1,
                           wake: asyncio.Event | None = None) -> None:
        """Read every ASR actor's lease every `every_s`: an actor whose lease was seen and
        is gone is down from now (its streams move at the next pass, which `wake` starts);
        one whose lease is back (a restarted actor with its engine up, a node that woke)
        is asked over Ray again. Redis out of reach says nothing about the actors, nor
        does a Redis that came back empty (a new run id): every lease is gone then, and
        the actors renew theirs within half a second; they count again once seen."""
        from workers.lease import lease_key

        redis = connect_redis(self.redis_url)
        run_id = None
        last_ok = time.monotonic()
        try:
            while True:
                actors = list(self.asr)
                try:
                    values = await redis.mget([lease_key(a) for a in actors])
                    server = (await redis.info("server")).get("run_id")
                except Exception:
                    await asyncio.sleep(every_s)
                    continue
                now = time.monotonic()
                stalled = now - last_ok > max(1.0, 4 * every_s)
                last_ok = now
                if server != run_id or stalled:
                    # A new run id: Redis came back empty. A gap in these reads: Redis
                    # stalled (a SIGSTOP, a slow disk, a paused VM), and its clock expired
                    # leases the actors could not renew meanwhile. Neither says an actor
                    # is lost: leases count again once renewed.
                    if run_id is not None:
                        log.warning("Redis %s: ASR leases are judged again once renewed",
                                    "restarted" if server != run_id else "stalled")
                        self._lease_seen.clear()
                        self.lease_redis_restarts += 1
                    run_id = server
                    await asyncio.sleep(every_s)
                    continue
                gone = [a for a, v in zip(actors, values, strict=True)
                        if v is None and a in self._lease_seen]
                if len(gone) >= 2 and set(gone) >= self._lease_seen:
                    # Every lease at once: a Redis that stalled past the expiry (its clock
                    # ran on), more likely than every actor lost; and with every actor
                    # lost there is nowhere to move to. Judged again once renewed.
                    log.warning("all %d ASR leases lapsed at once: Redis stalled? not moving "
                                "streams for it", len(gone))
                    self._lease_seen.clear()
                    self.lease_all_lapsed += 1
                    await asyncio.sleep(every_s)
                    continue
                for actor_id, value in zip(actors, values, strict=True):
                    if value is not None and value == self._lease_stale.get(actor_id):
                        continue  # read before withdraw_lease deleted it: not renewed
                    if value is not None:
                        self._lease_stale.pop(actor_id, None)
                        self._lease_seen.add(actor_id)
                        if self._lease_lapsed.pop(actor_id, None) is not None:
                            log.warning("ASR actor %s: lease back", actor_id)
                            self._down_since.pop(actor_id, None)
                            if wake is not None:
                                wake.set()
                    elif actor_id in self._lease_seen and actor_id not in self._lease_lapsed:
                        self._lease_lapsed[actor_id] = now
                        self._lease_seen.discard(actor_id)
                        metrics.LEASE_LAPSES.labels(actor=actor_id).inc()
                        log.warning("ASR actor %s: lease lapsed; moving its streams",
                                    actor_id)
                        if wake is not None:
                            wake.set()
                await asyncio.sleep(every_s)
        finally:
            await redis.aclose()

    async def _move_streams(self, actor_id: str, streams: dict[str, StreamConfig]
                            ) -> list[str]:
        """The streams of an actor that is down go to the least loaded actors that are
        up and have room; each resumes there from its ASR cursor in Redis."""
        assert self.router is not None
        problems: list[str] = []
        for sid in sorted(s for s, a in self.router.pins.items() if a == actor_id):
            target = self.router.move(sid, avoid=set(self._down_since))
            if target is None:
                problems.append(f"{sid}: no actor with room to move to")
                continue
            log.warning("stream %s: actor %s is down; moving it to %s", sid, actor_id, target)
            metrics.STREAM_MOVES.labels(actor=target).inc()
            try:
                await wait_for(self.asr[target].add_stream.remote(
                    stream_options(streams[sid], self.cfg.translation)), 30)
            except Exception as exc:  # pinned there: the next pass re-adds it
                problems.append(f"{sid}: move to {target} failed: {type(exc).__name__}")
        self._export_placement()
        return problems

    def _observe_lag(self, actor_id: str, reported: dict[str, Any], now: float) -> None:
        """Note which of the actor's streams are behind real time (`AsrHost.health`:
        the latency of each stream's latest caption with text, and its age). A latency
        older than twice the threshold says nothing about now (the room went quiet), and
        a stream in its cooldown after a move for lag is not watched: its new owner
        catches up on old audio, and those captions are late by design."""
        e = self.cfg.engine
        limit = e.move_after_lag_s
        assert self.router is not None
        self._lagging_actors.discard(actor_id)
        if limit is None:
            return
        for sid in [s for s, a in self.router.pins.items() if a == actor_id]:
            if sid not in reported:  # not running there (yet): nothing to judge
                self._behind_since.pop(sid, None)
        for sid, info in reported.items():
            if self.router.pins.get(sid) != actor_id or not isinstance(info, dict):
                continue
            lag, age = info.get("caption_lag_s"), info.get("caption_lag_age_s")
            if lag is None or age is None or age > 2 * limit:
                lag = 0.0  # unknown, or stale
            cooling = now - self._lag_moved_at.get(sid, -math.inf) < e.move_cooldown_s
            if lag > limit / 2:
                self._lagging_actors.add(actor_id)
            if lag > limit and not cooling:
                self._behind_since.setdefault(sid, now)
            else:
                self._behind_since.pop(sid, None)

    async def _move_lagging(self, streams: dict[str, StreamConfig]) -> list[str]:
        """A stream behind real time for `move_lag_sustain_s` moves to the least loaded
        actor with room that is up, has no stream behind itself and had no stream moved
        off it for lag within `move_cooldown_s` (so two slow actors never trade a stream
        back and forth). It leaves its actor first — one owner at a time — and resumes
        on the new one from its cursor, like a failover."""
        assert self.router is not None
        e = self.cfg.engine
        now = time.monotonic()
        problems: list[str] = []
        moved = False
        for sid, since in sorted(self._behind_since.items()):
            source = self.router.pins.get(sid)
            if now - since < e.move_lag_sustain_s or source is None \
                    or source in self._down_since:
                continue
            cooled = {a for a, t in self._lag_left_at.items() if now - t < e.move_cooldown_s}
            target = self.router.move(sid, avoid={source, *self._down_since,
                                                  *self._lagging_actors, *cooled})
            if target is None:
                problems.append(f"{sid}: behind real time on {source}; "
                                "no actor with room that keeps up")
                continue
            try:  # one owner at a time: the slow actor lets go before the new one starts
                await wait_for(self.asr[source].remove_stream.remote(sid), 30)
            except Exception as exc:
                self.router.pins[sid] = source  # still there; the next pass tries again
                problems.append(f"{sid}: cannot take it off {source}: {type(exc).__name__}")
                continue
            del self._behind_since[sid]
            self._lag_moved_at[sid] = self._lag_left_at[source] = now
            moved = True
            log.warning("stream %s: captions behind real time by more than %.0f s on %s "
                        "for %.0f s; moving it to %s", sid, e.move_after_lag_s, source,
                        now - since, target)
            metrics.STREAM_MOVES.labels(actor=target).inc()
            await self._count_lag_move(sid)
            try:
                await wait_for(self.asr[target].add_stream.remote(
                    stream_options(streams[sid], self.cfg.translation)), 30)
            except Exception as exc:  # pinned there: the next pass re-adds it
                problems.append(f"{sid}: move to {target} failed: {type(exc).__name__}")
        if moved:
            self._export_placement()
            await self._report_status()
        return problems

    async def _count_lag_move(self, sid: str) -> None:
        """`lag_moves` in the stream's status hash (the metric counts every move)."""
        try:
            redis = connect_redis(self.redis_url)
            try:
                await RedisBus(redis).incr_status(sid, "lag_moves")
            finally:
                await redis.aclose()
        except Exception as exc:  # status is a view; the move is done without it
            log.warning("stream %s: lag move not counted in its status: %s", sid,
                        type(exc).__name__)
