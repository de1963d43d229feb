"""The only code that makes Ray actors: event config → running actors.

It maps the YAML models to the plain options of the floors below, starts a
local `redis-server` when the event names none, starts (or joins) Ray, makes
the ingest and ASR actors, pins every stream through the router, and keeps
desired and running state in line (the supervisor loop): an actor that died
is replaced and its streams are added again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from orchestrator import metrics
from orchestrator.config import EventConfig, StreamConfig, TranslationConfig
from orchestrator.redis_server import LocalRedisServer
from orchestrator.router import PlacementError, Router
from translation.backends import BackendSettings, concrete
from translation.backends.openai_chat import OpenAIChatOptions
from translation.backends.vllm_chat import VllmChatOptions
from translation.glossary import GlossaryTerm
from translation.host import TranslationHost, TranslationHostOptions
from workers.asr import AsrHost, AsrHostOptions
from workers.engines.base import SpeechEngine
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.engines.realtime_ws import RealtimeWsEngine, RealtimeWsOptions
from workers.engines.vllm_voxtral import VllmEngineOptions, VllmVoxtralEngine
from workers.events import StreamOptions
from workers.ingest import IngestHost, IngestHostOptions
from workers.sessions.manager import SessionPolicy
from workers.sessions.watchdog import RutPolicy

log = logging.getLogger(__name__)


def stream_options(s: StreamConfig, t: TranslationConfig | None = None) -> StreamOptions:
    t = t or TranslationConfig()
    return StreamOptions(
        stream_id=s.id,
        name=s.name,
        source=s.resolved_source,
        language=s.language,
        targets=tuple(s.targets),
        loop=s.loop,
        context_sentences=t.context_sentences,
        partials_every_s=t.partials_every_s,
    )


def session_policy(cfg: EventConfig) -> SessionPolicy:
    c = cfg.engine.session
    return SessionPolicy(
        budget_s=c.budget_s, margin_s=c.margin_s, overlap_s=c.overlap_s,
        switch_pause_s=c.switch_pause_s,
        rut=RutPolicy(window_s=c.rut_window_s, speech_s=c.rut_speech_s,
                      chars_per_speech_s=c.rut_chars_per_speech_s),
        stall_s=c.stall_s, dither_lsb=c.dither_lsb, max_fill_s=c.max_fill_s,
    )


class RayMetricsSink:
    """Session-manager counters as `ray.util.metrics` instruments, so Ray's metrics
    agent exports them from every node (one scrape covers the cluster). Counter
    names map to bounded label sets: stream ids from the config, rollover reasons."""

    def __init__(self) -> None:
        from ray.util import metrics as rm

        self.rollovers = rm.Counter("babelcast_rollovers_total",
                                    "Engine session rollovers", tag_keys=("stream", "reason"))
        self.rut_recoveries = rm.Counter("babelcast_rut_recoveries_total",
                                         "Stuck sessions that captioned again after a rollover",
                                         tag_keys=("stream",))
        self.gaps = rm.Counter("babelcast_audio_gaps_total",
                               "Holes in a stream's audio seen by its session manager",
                               tag_keys=("stream",))
        self.gap_fill = rm.Counter("babelcast_audio_gap_fill_seconds_total",
                                   "Seconds of dithered noise fed for stalled or missing audio",
                                   tag_keys=("stream",))
        self.voiced = rm.Gauge("babelcast_voiced_without_text_seconds",
                               "Speech seconds since the stream's engine last emitted text",
                               tag_keys=("stream",))

    def stream_update(self, stream: str, counters: dict[str, float],
                      gauges: dict[str, float]) -> None:
        for name, value in counters.items():
            if value <= 0:
                continue
            if name.startswith("rollovers_"):
                self.rollovers.inc(value, tags={"stream": stream,
                                                "reason": name.removeprefix("rollovers_")})
            elif name == "rut_recoveries":
                self.rut_recoveries.inc(value, tags={"stream": stream})
            elif name == "gaps":
                self.gaps.inc(value, tags={"stream": stream})
            elif name == "gap_fill_s":
                self.gap_fill.inc(value, tags={"stream": stream})
        if "voiced_without_text_s" in gauges:
            self.voiced.set(gauges["voiced_without_text_s"], tags={"stream": stream})


class RayTranslationMetrics:
    """Translator figures as `ray.util.metrics` instruments (labels: language, backend)."""

    def __init__(self) -> None:
        from ray.util import metrics as rm

        self.lag = rm.Histogram(
            "babelcast_translation_lag_seconds",
            "Source final published to its translation published (seconds)",
            boundaries=[0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0],
            tag_keys=("lang", "backend"))
        self.translations = rm.Counter("babelcast_translations_total",
                                       "Translated captions published",
                                       tag_keys=("lang", "backend"))
        self.errors = rm.Counter("babelcast_translation_errors_total",
                                 "Translations published with an error marker",
                                 tag_keys=("lang", "backend"))
        self.depth = rm.Gauge("babelcast_translation_queue_jobs",
                              "Translation jobs waiting (lag) or being worked on (pending)",
                              tag_keys=("state",))
        self.age = rm.Gauge("babelcast_translation_queue_oldest_age_seconds",
                            "Age of the oldest translation job not yet done")

    def published(self, lang: str, backend: str, lag_s: float, error: bool) -> None:
        tags = {"lang": lang, "backend": backend}
        self.translations.inc(1, tags=tags)
        self.lag.observe(lag_s, tags=tags)
        if error:
            self.errors.inc(1, tags=tags)

    def queue(self, depth: dict[str, float]) -> None:
        self.depth.set(depth.get("pending", 0), tags={"state": "pending"})
        self.depth.set(depth.get("lag", 0), tags={"state": "waiting"})
        self.age.set(depth.get("oldest_age_s", 0.0))


def translation_backends(cfg: EventConfig) -> list[str]:
    """The concrete backends the event's pairs need (loaded when a translator starts)."""
    routes = cfg.translation.routing
    names = {concrete(routes.kind_for(s.language, t), s.language, t)
             for s in cfg.streams for t in s.targets}
    return sorted(n for n in names if n is not None)


def translation_host_options(cfg: EventConfig, translator_id: str,
                             redis_url: str) -> TranslationHostOptions:
    t = cfg.translation
    openai = vllm = None
    if t.openai is not None:
        o = t.openai
        openai = OpenAIChatOptions(url=o.url, model=o.model, api_key_env=o.api_key_env,
                                   timeout_s=o.timeout_s, max_retries=o.max_retries,
                                   batch_size=o.batch_size, concurrency=o.concurrency)
    if t.vllm is not None:
        v = t.vllm
        vllm = VllmChatOptions(model=v.model, max_model_len=v.max_model_len,
                               gpu_memory_utilization=v.gpu_memory_utilization,
                               batch_size=v.batch_size)
    return TranslationHostOptions(
        translator_id=translator_id, redis_url=redis_url, routes=t.routing,
        backends=BackendSettings(openai=openai, vllm=vllm, timeout_s=t.timeout_s),
        glossary=tuple(GlossaryTerm(g.term, dict(g.translations), g.keep, g.case_sensitive)
                       for g in cfg.glossary),
        batch_size=t.batch_size, claim_idle_s=t.claim_idle_s, job_timeout_s=t.timeout_s,
    )


EngineOptions = EmbeddedEngineOptions | RealtimeWsOptions | VllmEngineOptions


def engine_options(cfg: EventConfig) -> EngineOptions:
    e = cfg.engine
    if e.kind == "vllm":
        v = e.vllm
        assert v is not None
        return VllmEngineOptions(
            model=e.model, max_streams=e.streams_per_actor, max_model_len=v.max_model_len,
            gpu_memory_utilization=v.gpu_memory_utilization, load_format=v.load_format,
            enforce_eager=v.enforce_eager, cudagraph_mode=v.cudagraph_mode,
            max_num_batched_tokens=v.max_num_batched_tokens, delay_s=v.delay_ms / 1000,
        )
    if e.kind == "realtime-ws":
        assert e.url is not None
        return RealtimeWsOptions(url=e.url, model=e.model, delay_s=e.delay_s,
                                 max_session_s=e.max_session_s)
    return EmbeddedEngineOptions(
        model=e.model, cpu_threads=e.cpu_threads, step_s=e.step_s, pause_s=e.pause_s
    )


class _HostActor:
    """Ray wrapper of a host (async actor: its methods share one event loop). The
    host starts on first use, so a restarted actor comes back ready for the
    supervisor to add its streams again."""

    host: AsrHost | IngestHost

    def __init__(self) -> None:
        self._started = False

    async def _ensure(self) -> None:
        if not self._started:
            await self.host.start()
            self._started = True

    async def add_stream(self, opts: StreamOptions) -> None:
        await self._ensure()
        await self.host.add_stream(opts)

    async def remove_stream(self, stream_id: str) -> None:
        await self.host.remove_stream(stream_id)

    async def streams(self) -> list[str]:
        return self.host.streams()

    async def health(self) -> dict[str, Any]:
        await self._ensure()
        return dict(await self.host.health())

    async def stop(self) -> None:
        if self._started:
            await self.host.stop()


def build_engine(options: EngineOptions) -> SpeechEngine:
    if isinstance(options, RealtimeWsOptions):
        return RealtimeWsEngine(options)
    if isinstance(options, VllmEngineOptions):
        return VllmVoxtralEngine(options)
    return EmbeddedWhisperEngine(options)


class AsrActor(_HostActor):
    def __init__(self, options: AsrHostOptions, engine: EngineOptions) -> None:
        super().__init__()
        self.host = AsrHost(options, build_engine(engine), RayMetricsSink())


class IngestActor(_HostActor):
    def __init__(self, options: IngestHostOptions) -> None:
        super().__init__()
        self.host = IngestHost(options)


class TranslatorActor:
    """Ray wrapper of a translation host: starts consuming jobs at once and loads
    the backends the event needs before the first job arrives."""

    def __init__(self, options: TranslationHostOptions, warm: list[str]) -> None:
        self.host = TranslationHost(options, RayTranslationMetrics())
        self._warm = warm
        self._started = False

    async def start(self) -> None:
        if not self._started:
            await self.host.warm(self._warm)
            await self.host.start()
            self._started = True

    async def health(self) -> dict[str, Any]:
        await self.start()
        return dict(await self.host.health())

    async def stats(self) -> dict[str, float]:
        return self.host.stats()

    async def stop(self) -> None:
        if self._started:
            await self.host.stop()


@dataclass
class EventRuntime:
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

    # ---- lifecycle ---------------------------------------------------------
    def start_services(self) -> str:
        """Redis and Ray (blocking; call before the event loop work starts)."""
        if self.cfg.redis.url:
            self.redis_url = self.cfg.redis.url
        else:
            self._redis_child = LocalRedisServer()
            self.redis_url = self._redis_child.start()
        if not ray.is_initialized():
            ray.init(
                address=self.cfg.ray.address,
                num_cpus=self.cfg.ray.num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
            self._started_ray = True
        return self.redis_url

    async def start_actors(self) -> None:
        e = self.cfg.engine
        # num_cpus=0: actors are long-lived and CPU use is governed by the engine's
        # own threads; reserving CPUs would stop a 2-core laptop from placing them.
        actor_opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1}
        asr_cls = ray.remote(**actor_opts)(AsrActor)
        ingest_cls = ray.remote(**actor_opts)(IngestActor)
        # The vllm engine owns one GPU per ASR actor; Ray places actors on GPU nodes.
        asr_gpus = 1 if e.kind == "vllm" else 0
        for i in range(e.actors):
            actor_id = f"asr-{i}"
            self.asr[actor_id] = asr_cls.options(name=f"babelcast-{actor_id}",
                                                 num_gpus=asr_gpus).remote(
                AsrHostOptions(actor_id=actor_id, redis_url=self.redis_url,
                               max_streams=e.streams_per_actor,
                               session_policy=session_policy(self.cfg)),
                engine_options(self.cfg),
            )
        for i in range(self.cfg.ingest.actors):
            actor_id = f"ingest-{i}"
            self.ingest[actor_id] = ingest_cls.options(name=f"babelcast-{actor_id}").remote(
                IngestHostOptions(actor_id=actor_id, redis_url=self.redis_url)
            )
        await self.start_translators()
        self.router = Router(budget=e.streams_per_actor, actors=list(self.asr))
        await self.place_all()

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
        assert self.router is not None
        self.unplaced = []
        ingest_ids = list(self.ingest)
        for n, s in enumerate(self.cfg.streams):
            opts = stream_options(s, self.cfg.translation)
            try:
                actor = self.router.place(s.id)
            except PlacementError as exc:
                log.error("%s", exc)
                self.unplaced.append(s.id)
                continue
            await self.asr[actor].add_stream.remote(opts)
            if s.source_kind != "push":
                ing = self._ingest_pins.setdefault(s.id, ingest_ids[n % len(ingest_ids)])
                await self.ingest[ing].add_stream.remote(opts)
        self._export_placement()

    def _export_placement(self) -> None:
        assert self.router is not None
        for actor in self.asr:
            metrics.STREAMS_PLACED.labels(actor=actor).set(self.router.load(actor))
        metrics.STREAMS_UNPLACED.set(len(self.unplaced))

    async def reconcile(self, timeout_s: float = 20.0) -> list[str]:
        """Re-add streams to actors that lost them (restarted by Ray); returns problems."""
        assert self.router is not None
        problems: list[str] = []
        streams = {s.id: s for s in self.cfg.streams}
        for actor_id, handle in self.asr.items():
            want = {s for s, a in self.router.pins.items() if a == actor_id}
            try:
                have = set(await asyncio.wait_for(handle.streams.remote(), timeout_s))
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                problems.append(f"{actor_id}: {type(exc).__name__}")
                continue
            for sid in sorted(want - have):
                log.warning("re-adding stream %s to %s", sid, actor_id)
                await handle.add_stream.remote(
                    stream_options(streams[sid], self.cfg.translation))
        for actor_id, handle in self.translators.items():
            try:  # a restarted translator starts consuming again
                await asyncio.wait_for(handle.start.remote(), timeout_s)
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                problems.append(f"{actor_id}: {type(exc).__name__}")
        for actor_id, handle in self.ingest.items():
            want = {s for s, a in self._ingest_pins.items() if a == actor_id}
            try:
                have = set(await asyncio.wait_for(handle.streams.remote(), timeout_s))
            except (RayActorError, GetTimeoutError, TimeoutError) as exc:
                problems.append(f"{actor_id}: {type(exc).__name__}")
                continue
            for sid in sorted(want - have):
                await handle.add_stream.remote(
                    stream_options(streams[sid], self.cfg.translation))
        return problems

    async def supervise(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(Exception):
                await self.reconcile()

    async def stop(self) -> None:
        handles = [*self.ingest.values(), *self.asr.values(), *self.translators.values()]
        for handle in handles:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.stop.remote(), 10)
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle)
        self.asr.clear()
        self.ingest.clear()
        self.translators.clear()

    def stop_services(self) -> None:
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._redis_child is not None:
            self._redis_child.stop()
            self._redis_child = None

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every ASR actor has loaded its engine (first health answer)."""
        deadline = time.monotonic() + timeout_s
        for handle in self.asr.values():
            await asyncio.wait_for(handle.health.remote(), max(1.0, deadline - time.monotonic()))
