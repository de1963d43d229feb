"""The only code that makes Ray actors: event config → running actors.

It starts a local `redis-server` when the event names none, starts (or joins) Ray, makes
the ingest, ASR and translator actors (`ray_actors.py`, with the options of
`actor_options.py`), pins every stream through the router, and keeps desired and running
state in line (the supervisor loop): an actor that died is replaced and its streams are
added again, or moved to another actor (`failover.py`: leases, moves of streams off
actors that are down or behind); hot apply adds, drains and updates streams
(`hot_apply.py`). The Ray code of the project lives here, in `ray_actors.py` and in
`ray_metrics.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from orchestrator import metrics
from orchestrator.actor_options import (
    engine_options,
    session_policy,
    stream_options,
    translation_backends,
    translation_host_options,
)
from orchestrator.config import EventConfig
from orchestrator.failover import Failover, LeaseLapsed
from orchestrator.hot_apply import HotApply
from orchestrator.ray_actors import AsrActor, IngestActor, TranslatorActor
from orchestrator.ray_metrics import write_ray_metrics_targets
from orchestrator.redis_server import LocalRedisServer
from orchestrator.router import PlacementError, Router
from orchestrator.status import register_actors
from workers.aio import wait_for
from workers.asr import AsrHostOptions
from workers.bus import RedisBus, connect_redis
from workers.engines import vad
from workers.events import StreamOptions
from workers.ingest import IngestHostOptions

log = logging.getLogger(__name__)


INGEST_RETRY_S = 1.0
"""How soon the supervisor tries again an ingest actor it could not reach: a pass that
meets it mid-restart fails, and nothing else would wake the supervisor before its poll
(5 s; in tests 120 s). Ingest has no failover wait: the sooner, the less audio lost."""


def ray_namespace(event: str) -> str:
    """The Ray namespace of an event's actors. Actor names (`babelcast-asr-0`, ...) are
    unique within it, so two events can share one cluster. The actors are owned by the
    `babelcast run` that made them, not detached: they die with it, so a restarted run
    starts fresh ones under the same names and never finds stale duplicates (a detached
    actor would outlive a crashed run, still holding its GPU and reading its streams)."""
    slug = re.sub(r"[^a-z0-9]+", "-", event.lower()).strip("-")
    return f"babelcast-{slug or 'event'}"


@dataclass
class EventRuntime(Failover, HotApply):
    cfg: EventConfig
    redis_url: str = ""
    asr: dict[str, Any] = field(default_factory=dict)
    ingest: dict[str, Any] = field(default_factory=dict)
    translators: dict[str, Any] = field(default_factory=dict)
    router: Router | None = None
    unplaced: list[str] = field(default_factory=list)
    _redis_child: LocalRedisServer | None = None
    _started_ray: bool = False
    _ingest_pins: dict[str, str] = field(default_factory=dict)
    _sd_files: list[tuple[Path, str]] = field(default_factory=list)
    # actor id -> pid of the process killed for a dead engine: ray.kill returns before the
    # process is gone, so a pass that still reaches that pid must wait, not kill again (a
    # second kill would land on the fresh replacement)
    _replacing: dict[str, int] = field(default_factory=dict)
    # actor id -> monotonic time the supervisor first failed to reach it
    _down_since: dict[str, float] = field(default_factory=dict)
    # actor id -> monotonic time Ray's death signal came (supervise's watch failed)
    _died_at: dict[str, float] = field(default_factory=dict)
    # Moves for lag (engine.move_after_lag_s): stream -> monotonic time its captions were
    # first seen behind, in the current run of passes that saw it behind; stream -> when
    # it last moved for lag; actor -> when a stream last left it for lag; and the actors
    # seen with a stream at least half the threshold behind at their last answer.
    _behind_since: dict[str, float] = field(default_factory=dict)
    _lag_moved_at: dict[str, float] = field(default_factory=dict)
    _lag_left_at: dict[str, float] = field(default_factory=dict)
    _lagging_actors: set[str] = field(default_factory=set)
    # ingest actors the last pass could not reach (their streams are not re-added yet)
    _ingest_unreached: set[str] = field(default_factory=set)
    # ASR actors whose lease (workers/lease.py) was seen, and those whose lease lapsed
    # since: a lapsed actor is down at once and not asked over Ray (a frozen node would
    # hold a pass for its whole timeout), until its lease is back
    _lease_seen: set[str] = field(default_factory=set)
    _lease_lapsed: dict[str, float] = field(default_factory=dict)
    # the value a withdrawn lease held (Failover.withdraw_lease: reading it again is not
    # the actor back)
    _lease_stale: dict[str, Any] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)
    lease_redis_restarts: int = 0  # Redis restarts or stalls the lease reader saw
    lease_all_lapsed: int = 0  # times every seen lease was gone at once (not acted on)
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    # Held by each supervisor pass and by each hot apply's changes to pins and config
    # (orchestrator.apply): a pass that read the pins before a stream was removed would
    # otherwise add it back.
    control_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # ---- lifecycle ---------------------------------------------------------
    def start_services(self) -> str:
        """Redis and Ray (blocking; call before the event loop work starts)."""
        if self.cfg.redis.url:
            self.redis_url = self.cfg.redis.url
        else:
            # Persistent (append-only file in the event's data folder) and restarted by
            # orchestrator.redis_child if it dies.
            self._redis_child = LocalRedisServer(data_dir=self.cfg.redis.resolved_data_dir)
            self.redis_url = self._redis_child.start()
        if not ray.is_initialized():
            ray.init(
                # "local": a Ray of this run's own. Without it, ray.init joins whatever Ray
                # was started last on this machine (another event's, a test's).
                address=self.cfg.ray.address or "local",
                num_cpus=self.cfg.ray.num_cpus,
                namespace=ray_namespace(self.cfg.event),
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
            self._started_ray = True
            # Without the dashboard nobody writes Ray's metrics targets for Prometheus.
            try:
                self._sd_files = write_ray_metrics_targets()
            except Exception as exc:  # monitoring is missing a target; the event runs
                log.warning("cannot list Ray's metrics endpoints for Prometheus: %r", exc)
        return self.redis_url

    async def start_actors(self) -> None:
        e = self.cfg.engine
        # num_cpus=0: actors are long-lived and CPU use is governed by the engine's
        # own threads; reserving CPUs would stop a 2-core laptop from placing them.
        actor_opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1}
        asr_cls = ray.remote(**actor_opts)(AsrActor)
        ingest_cls = ray.remote(**actor_opts)(IngestActor)
        # The vllm engine owns a GPU, or a 1/engines_per_gpu share of one, per ASR actor;
        # Ray places actors on GPU nodes.
        asr_gpus: float = 0
        if e.kind == "vllm":
            assert e.vllm is not None
            asr_gpus = 1 / e.vllm.engines_per_gpu
        for i in range(e.actors):
            actor_id = f"asr-{i}"
            # SPREAD: on a cluster, ASR actors go to different nodes where they can, so
            # losing a node takes the fewest streams (they move to the others).
            metrics.LEASE_LAPSES.labels(actor=actor_id)  # at 0 from the start
            self.asr[actor_id] = asr_cls.options(name=f"babelcast-{actor_id}",
                                                 num_gpus=asr_gpus,
                                                 scheduling_strategy="SPREAD").remote(
                AsrHostOptions(actor_id=actor_id, redis_url=self.redis_url,
                               max_streams=e.streams_per_actor,
                               session_policy=session_policy(self.cfg),
                               vad_process=e.kind == "vllm",
                               vad_processes=math.ceil(e.streams_per_actor
                                                       / vad.STREAMS_PER_PROCESS),
                               lease_ttl_s=e.lease_ttl_s),
                engine_options(self.cfg),
            )
        for i in range(self.cfg.ingest.actors):
            actor_id = f"ingest-{i}"
            self.ingest[actor_id] = ingest_cls.options(name=f"babelcast-{actor_id}").remote(
                IngestHostOptions(actor_id=actor_id, redis_url=self.redis_url,
                                  stall_s=e.session.stall_s,
                                  stall_max_s=e.session.stall_max_s)
            )
        await self.start_translators()
        self.router = Router(budget=e.streams_per_actor, actors=list(self.asr))
        await self.place_all()
        await self.warm_spares()

    async def start_translators(self) -> None:
        """The translator pool, when any stream has targets; each actor restarts under
        the same consumer name, so it re-reads its own pending jobs first."""
        if not any(s.targets for s in self.cfg.streams):
            return
        warm = translation_backends(self.cfg)
        gpus = 1 if "vllm" in warm else 0
        cls = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=-1)(TranslatorActor)
        for i in range(self.cfg.translation.actors):
            tid = f"translator-{i}"
            self.translators[tid] = cls.options(name=f"babelcast-{tid}").remote(
                translation_host_options(self.cfg, tid, self.redis_url), warm)
        for handle in self.translators.values():
            handle.start.remote()

    async def place_all(self) -> None:
        """Pin every stream to an actor, then hand the actors their streams side by side,
        each actor's in order. An actor's first stream starts its engine (a minute or
        more for vLLM): handed one actor after another, N engines took N times as long
        before the last actor's rooms had captions (three vLLM engines on one H200
        wait for each other only where they must profile memory in turn; see
        `engine.vllm.kv_cache_gib`)."""
        assert self.router is not None
        self.unplaced = []
        ingest_ids = list(self.ingest)
        # actor → its streams' options, each with its ingest actor (None: pushed audio)
        handed: dict[str, list[tuple[StreamOptions, str | None]]] = {}
        for n, s in enumerate(self.cfg.streams):
            try:
                actor = self.router.place(s.id)
            except PlacementError as exc:
                log.error("%s", exc)
                self.unplaced.append(s.id)
                continue
            ing = (self._ingest_pins.setdefault(s.id, ingest_ids[n % len(ingest_ids)])
                   if s.source_kind != "push" else None)
            handed.setdefault(actor, []).append((stream_options(s, self.cfg.translation), ing))

        async def hand(actor: str, items: list[tuple[StreamOptions, str | None]]) -> None:
            for opts, ing in items:
                await self.asr[actor].add_stream.remote(opts)
                if ing is not None:
                    await self.ingest[ing].add_stream.remote(opts)

        results = await asyncio.gather(*(hand(a, items) for a, items in handed.items()),
                                       return_exceptions=True)
        # As before, a stream that cannot be handed stops the start, but only once every
        # other actor's hand has finished: none is left running behind the error.
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        self._export_placement()
        await self._report_status()

    async def warm_spares(self, timeout_s: float = 600.0) -> None:
        """Start the engine of every ASR actor that got no stream: a stream that moves
        to it after a failure would otherwise wait for a model load (a minute or more
        for vLLM)."""
        assert self.router is not None
        spares = [a for a in self.asr if self.router.load(a) == 0]
        results = await asyncio.gather(
            *(wait_for(self.asr[a].health.remote(), timeout_s) for a in spares),
            return_exceptions=True)
        for actor_id, result in zip(spares, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("spare ASR actor %s did not start: %s", actor_id,
                            type(result).__name__)

    def _export_placement(self) -> None:
        assert self.router is not None
        for actor in self.asr:
            metrics.STREAMS_PLACED.labels(actor=actor).set(self.router.load(actor))
            metrics.STREAMS_BUDGET.labels(actor=actor).set(self.cfg.engine.streams_per_actor)
        metrics.STREAMS_UNPLACED.set(len(self.unplaced))
        for s in self.cfg.streams:
            metrics.STREAM_UNPLACED.labels(stream=s.id).set(int(s.id in self.unplaced))

    @property
    def redis_child(self) -> LocalRedisServer | None:
        return self._redis_child

    async def report_status(self) -> None:
        """Again after Redis came back empty (orchestrator.epoch)."""
        if self.router is not None:
            await self._report_status()

    async def _report_status(self) -> None:
        """For the gateway's /v1/status and `babelcast status`: the event's actors, and
        each stream's placement in its status hash (the ASR actor, or `unplaced`)."""
        assert self.router is not None
        try:
            redis = connect_redis(self.redis_url)
            try:
                bus = RedisBus(redis)
                await register_actors(bus, [*self.asr, *self.ingest, *self.translators])
                for s in self.cfg.streams:
                    where = "unplaced" if s.id in self.unplaced else self.router.pins.get(s.id, "")
                    await bus.set_status(s.id, placement=where)
            finally:
                await redis.aclose()
        except Exception as exc:  # status is a view; the event runs without it
            log.warning("cannot write stream placement to Redis: %s", type(exc).__name__)

    def _actor_up(self, actor_id: str, role: str, up: bool) -> None:
        metrics.ACTOR_UP.labels(actor=actor_id, role=role).set(int(up))

    async def reconcile(self, timeout_s: float = 20.0) -> list[str]:
        """Re-add streams to actors that lost them (restarted by Ray); returns problems."""
        assert self.router is not None
        problems: list[str] = []
        streams = {s.id: s for s in self.cfg.streams}
        failover_s = self.cfg.engine.failover_after_s
        for actor_id, handle in self.asr.items():
            want = {s for s, a in self.router.pins.items() if a == actor_id}
            now = time.monotonic()
            if actor_id in self._lease_lapsed:
                self._mark_lapsed(actor_id, handle, now, problems)
                continue
            # After Ray's death signal a restarted process answers at once (state never
            # waits for the engine), so failover_after_s is enough to tell; without one,
            # a slow answer is a busy actor (a saturated vLLM front end), not a dead one.
            wait_s = min(timeout_s, failover_s) if actor_id in self._died_at else timeout_s
            try:
                # (cut short if its lease lapses meanwhile: Failover.ask)
                state = await self.ask(actor_id, handle.state.remote(), wait_s)
                if state.get("pid") is not None and \
                        self._replacing.get(actor_id) == state["pid"]:
                    problems.append(f"{actor_id}: replacement pending")
                    continue
                if state.get("started") and state.get("engine_ok") is False:
                    # The actor answers but its engine is dead (a crashed vLLM engine
                    # core): only a new process brings it back. Ray restarts the actor
                    # (max_restarts=-1); the next pass re-adds its streams.
                    self._actor_up(actor_id, "asr", False)
                    self._replace_dead_engine(actor_id, handle, state)
                    problems.append(f"{actor_id}: engine dead, actor replaced")
                    continue
                have = set(await self.ask(actor_id, handle.streams.remote(), timeout_s))
            except LeaseLapsed:  # it froze or vanished while this pass waited on it
                self._mark_lapsed(actor_id, handle, time.monotonic(), problems)
                continue
            except ActorDiedError as exc:  # dead for good (no restart left): move now
                problems.append(f"{actor_id}: {type(exc).__name__}")
                self._actor_up(actor_id, "asr", False)
                self._down_since.setdefault(actor_id, now - failover_s)
                continue
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                problems.append(f"{actor_id}: {type(exc).__name__}")
                self._actor_up(actor_id, "asr", False)
                self._down_since.setdefault(actor_id, self._died_at.get(actor_id, now))
                continue
            self._down_since.pop(actor_id, None)
            self._died_at.pop(actor_id, None)
            self._actor_up(actor_id, "asr", True)
            self._observe_lag(actor_id, state.get("streams") or {}, now)
            for sid in sorted(have - want):
                # moved away while this actor was out of reach: one owner per stream
                log.warning("stream %s moved off %s; removing it there", sid, actor_id)
                await handle.remove_stream.remote(sid)
            for sid in sorted(want - have):
                log.warning("re-adding stream %s to %s", sid, actor_id)
                metrics.STREAM_READDS.labels(actor=actor_id).inc()
                await handle.add_stream.remote(
                    stream_options(streams[sid], self.cfg.translation))
        for actor_id, since in list(self._down_since.items()):
            if time.monotonic() - since >= failover_s:
                problems.extend(await self._move_streams(actor_id, streams))
        problems.extend(await self._move_lagging(streams))
        for actor_id, handle in self.translators.items():
            try:  # a restarted translator starts consuming again
                await wait_for(handle.start.remote(), timeout_s)
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                problems.append(f"{actor_id}: {type(exc).__name__}")
                self._actor_up(actor_id, "translator", False)
            else:
                self._actor_up(actor_id, "translator", True)
        for actor_id, handle in self.ingest.items():
            want = {s for s, a in self._ingest_pins.items() if a == actor_id}
            try:
                have = set(await wait_for(handle.streams.remote(), timeout_s))
                self._actor_up(actor_id, "ingest", True)
                for sid in sorted(want - have):
                    metrics.STREAM_READDS.labels(actor=actor_id).inc()
                    await wait_for(handle.add_stream.remote(
                        stream_options(streams[sid], self.cfg.translation)), timeout_s)
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                # Caught while Ray restarts it (ActorUnavailableError): its new process
                # sends no second death signal, so supervise() tries again soon.
                problems.append(f"{actor_id}: {type(exc).__name__}")
                self._actor_up(actor_id, "ingest", False)
                self._ingest_unreached.add(actor_id)
                continue
            self._ingest_unreached.discard(actor_id)
        return problems

    def _replace_dead_engine(self, actor_id: str, handle: Any, state: dict[str, Any]
                             ) -> None:
        """The actor answers but its engine is dead: only a new process brings it back.
        Ray restarts the actor (max_restarts=-1); its pid is remembered, so a pass that
        still reaches the dying process does not kill again (that kill would land on the
        replacement)."""
        log.error("ASR actor %s: its engine is dead; replacing the actor", actor_id)
        metrics.ENGINE_REPLACEMENTS.labels(actor=actor_id).inc()
        if state.get("pid") is not None:
            self._replacing[actor_id] = state["pid"]
        ray.kill(handle, no_restart=False)

    async def supervise(self, every_s: float = 5.0, min_gap_s: float = 0.5) -> None:
        """Reconcile every `every_s`, and at once when an actor dies: one pending
        `watch()` call per actor fails when its process goes (Ray's death signal), so a
        restarted actor gets its streams back as soon as it answers, not a poll later."""
        died = asyncio.Event()
        watches: dict[int, asyncio.Task[None]] = {}
        failed_at: dict[int, float] = {}
        leases = (asyncio.create_task(self.watch_leases(wake=died), name="lease-watch")
                  if self.cfg.engine.lease_ttl_s else None)

        async def watch(handle: Any) -> None:
            try:
                await handle.watch.remote()
            except Exception as exc:
                failed_at[id(handle)] = time.monotonic()
                actor_id = self._actor_of(handle)
                # a pass that cannot reach it counts it down from now, not from then
                self._died_at.setdefault(actor_id, failed_at[id(handle)])
                log.warning("actor %s: its process is gone (%s)", actor_id,
                            type(exc).__name__)
                if actor_id in self.asr:  # down now, not when its lease expires
                    await self.withdraw_lease(actor_id)
                died.set()

        try:
            while True:
                handles = [*self.asr.values(), *self.ingest.values(),
                           *self.translators.values()]
                for handle in handles:
                    task = watches.get(id(handle))
                    # A failed watch is armed again once the actor is not known to be
                    # down, and not within 2 s: a dead actor's watch fails at once.
                    if task is None or (
                            task.done() and self._actor_of(handle) not in self._down_since
                            and time.monotonic() - failed_at.get(id(handle), 0.0) >= 2.0):
                        watches[id(handle)] = asyncio.create_task(watch(handle))
                # A pass when an actor dies, every `every_s`, and when an actor that is
                # down has been down for failover_after_s (its streams move then).
                wait_s = every_s
                pinned = set(self.router.pins.values()) if self.router is not None else set()
                # (an actor that is down and holds no stream any more needs no pass)
                waiting = [t for a, t in self._down_since.items() if a in pinned]
                if waiting:
                    due = min(waiting) + self.cfg.engine.failover_after_s
                    wait_s = max(0.0, min(every_s, due - time.monotonic()))
                if self._behind_since:  # and when a stream has been behind long enough
                    due = min(self._behind_since.values()) + self.cfg.engine.move_lag_sustain_s
                    wait_s = max(0.0, min(wait_s, due - time.monotonic()))
                if self._ingest_unreached:  # restarting: its streams wait for a pass
                    wait_s = min(wait_s, INGEST_RETRY_S)
                with contextlib.suppress(TimeoutError):
                    await wait_for(died.wait(), wait_s)
                died.clear()
                with contextlib.suppress(Exception):
                    async with self.control_lock:
                        await self.reconcile()
                await asyncio.sleep(min_gap_s)  # a restarting actor fails watches at once
        finally:
            for task in watches.values():
                task.cancel()
            if leases is not None:
                leases.cancel()

    def _actor_of(self, handle: Any) -> str:
        for group in (self.asr, self.ingest, self.translators):
            for actor_id, h in group.items():
                if h is handle:
                    return actor_id
        return ""

    async def stop(self) -> None:
        handles = [*self.ingest.values(), *self.asr.values(), *self.translators.values()]
        for handle in handles:
            with contextlib.suppress(Exception):
                await wait_for(handle.stop.remote(), 10)
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle)
        self.asr.clear()
        self.ingest.clear()
        self.translators.clear()

    def stop_services(self) -> None:
        for path, content in self._sd_files:  # the targets are gone with this Ray
            with contextlib.suppress(OSError):
                if path.read_text() == content:  # not a newer Ray's
                    path.unlink()
        self._sd_files = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._redis_child is not None:
            self._redis_child.stop()
            self._redis_child = None

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every ASR actor has loaded its engine (first health answer)."""
        deadline = time.monotonic() + timeout_s
        for handle in self.asr.values():
            await wait_for(handle.health.remote(), max(1.0, deadline - time.monotonic()))
