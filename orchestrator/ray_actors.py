"""The Ray actor classes: thin async wrappers of the ingest, ASR and translation hosts. The
runtime (`orchestrator/runtime.py`) makes them with `ray.remote` and supervises them."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from orchestrator.actor_options import EngineOptions
from orchestrator.ray_metrics import RayMetricsSink, RayTranslationMetrics
from translation.glossary import Glossary, GlossaryTerm
from translation.host import TranslationHost, TranslationHostOptions
from workers.asr import AsrHost, AsrHostOptions
from workers.engines.base import SpeechEngine
from workers.engines.embedded import EmbeddedWhisperEngine
from workers.engines.realtime_ws import RealtimeWsEngine, RealtimeWsOptions
from workers.engines.vllm.engine import VllmEngineOptions, VllmVoxtralEngine
from workers.events import StreamOptions
from workers.ingest import IngestHost, IngestHostOptions

log = logging.getLogger(__name__)


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

    async def watch(self) -> None:
        """Never returns: the supervisor keeps one call pending per actor, and Ray fails
        it the moment the actor's process dies — the death signal, without polling."""
        await asyncio.Event().wait()

    async def state(self) -> dict[str, Any]:
        """Like health, but never waits for a starting engine (a vLLM engine takes a
        minute or two to load): {"started": False} until it is up."""
        where = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                 "gpus": [str(g) for g in ray.get_gpu_ids()]}  # Ray's share: which GPU
        if not self._started:
            return {"started": False, **where}
        return {"started": True, **where, **await self.host.health()}

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
        self.host = AsrHost(options, build_engine(engine), RayMetricsSink(options.actor_id))

    async def update_stream(self, opts: StreamOptions) -> bool:
        assert isinstance(self.host, AsrHost)
        return await self.host.update_stream(opts)

    async def drain_stream(self, stream_id: str, lang: str) -> int:
        assert isinstance(self.host, AsrHost)
        await self._ensure()
        return await self.host.drain_stream(stream_id, lang)


class IngestActor(_HostActor):
    def __init__(self, options: IngestHostOptions) -> None:
        super().__init__()
        self.host = IngestHost(options, metrics=RayMetricsSink(options.actor_id))


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

    async def watch(self) -> None:
        """See _HostActor.watch."""
        await asyncio.Event().wait()

    async def stats(self) -> dict[str, float]:
        return self.host.stats()

    async def set_glossary(self, terms: tuple[GlossaryTerm, ...]) -> None:
        """A hot apply's glossary: the next batch is translated with it."""
        self.host.glossary = Glossary(terms)

    async def stop(self) -> None:
        if self._started:
            await self.host.stop()
