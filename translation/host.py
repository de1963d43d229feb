"""The translation host: reads jobs in batches, translates, publishes, acks.

A plain class (the orchestrator's runtime wraps it in a Ray actor). One loop:
take up to `batch_size` jobs (jobs re-claimed from a dead translator first, then
new ones), expand them into one request per target language, hand each backend
its share of the batch at once, publish every result into `captions:{stream}:{lang}`
and only then ack the jobs. A backend error or timeout publishes that translation
with an `error` marker, so the client sees the hole and the other languages go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from translation.backends import BackendSettings, Routes, build
from translation.backends.base import (
    BackendError,
    BackendInterrupted,
    BackendTimeout,
    Result,
    TranslationRequest,
    Translator,
)
from translation.glossary import Glossary, GlossaryTerm
from translation.jobs import Delivery, JobQueue
from workers.aio import wait_for
from workers.bus import RedisBus, connect_redis, retry_redis
from workers.captions.linebreak import WEB, break_lines
from workers.events import CaptionSegment, TranslationJob

log = logging.getLogger(__name__)

MAX_INTERRUPTS = 3
"""Retries of a job whose backend process was killed under it (`BackendInterrupted`); killed
once more after them, it is published with the error. One such kill is a translator going
down or the OOM killer's choice, and the job is read again; a kill every time is a broken
host."""


class TranslationMetrics(Protocol):
    """Where the host reports what it did (Ray metrics in production, a recorder in tests)."""

    def published(self, stream: str, lang: str, backend: str, lag_s: float, error: bool,
                  final: bool) -> None:
        """One translation out; `lag_s`: its source final's publication to its own."""

    def queue(self, depth: dict[str, float]) -> None:
        """The job queue's figures (`JobQueue.depth`)."""

    def usage(self, backend: str, counters: dict[str, float]) -> None:
        """A backend's `requests`, `chars_in` and `prompt_chars` since the last call."""


@dataclass(frozen=True, slots=True)
class TranslationHostOptions:
    translator_id: str
    redis_url: str
    routes: Routes = field(default_factory=Routes)
    backends: BackendSettings = field(default_factory=BackendSettings)
    glossary: tuple[GlossaryTerm, ...] = ()
    batch_size: int = 32
    read_block_ms: int = 200
    claim_idle_s: float = 10.0
    """A job pending this long with another translator is taken over."""
    claim_every_s: float = 1.0
    job_timeout_s: float = 15.0
    """Longest a backend may take for its share of one batch."""
    max_tail_age_s: float = 5.0
    """Live-tail (non-final) jobs older than this are skipped: their final is near."""


@dataclass
class _Item:
    delivery: Delivery
    job: TranslationJob
    target: str
    backend: str = ""
    result: Result | None = None


class TranslationHost:
    def __init__(self, options: TranslationHostOptions,
                 metrics: TranslationMetrics | None = None) -> None:
        self.options = options
        self.metrics = metrics
        self.glossary = Glossary(options.glossary)
        self._backends: dict[str, Translator] = {}
        self._redis: Redis | None = None
        self._bus: RedisBus | None = None
        self._queue: JobQueue | None = None
        self._loop: asyncio.Task[None] | None = None
        self._reporter: asyncio.Task[None] | None = None
        self._last_claim = 0.0
        self._stopping = False
        self._tail_revisions: dict[tuple[str, str, int], int] = {}
        self.counters: dict[str, float] = defaultdict(float)
        self.lags: deque[float] = deque(maxlen=2000)
        self.lags_by_lang: dict[str, deque[float]] = {}
        self._usage_seen: dict[tuple[str, str], float] = {}
        # The last seq this host published per (stream, lang), and the Redis data set
        # it published into: after Redis came back empty no seq is given twice.
        self._floors: dict[tuple[str, str], int] = {}
        # How often each job (its entry id) was interrupted (see _try_again).
        self._interrupts: dict[str, int] = {}
        self._epoch = ""

    @property
    def bus(self) -> RedisBus:
        if self._bus is None:
            raise RuntimeError("TranslationHost.start() was not called")
        return self._bus

    async def start(self) -> None:
        self._redis = connect_redis(self.options.redis_url)
        self._bus = RedisBus(self._redis)
        self._queue = JobQueue(self._redis, self.options.translator_id,
                               claim_idle_s=self.options.claim_idle_s)
        await self._queue.ensure_group()
        self._epoch = await self.bus.epoch()
        self._loop = asyncio.create_task(self._run(), name="translate")
        self._reporter = asyncio.create_task(self._report_loop(), name="translate-report")

    async def warm(self, names: list[str]) -> None:
        """Load these backends now rather than on the first job."""
        for name in names:
            await self._backend(name)

    async def _backend(self, name: str) -> Translator:
        backend = self._backends.get(name)
        if backend is None:
            backend = build(name, self.options.backends)
            await backend.start()
            self._backends[name] = backend
        return backend

    # ---- the loop ------------------------------------------------------------
    async def _run(self) -> None:
        assert self._queue is not None
        queue = self._queue
        while not self._stopping:
            try:
                deliveries: list[Delivery] = []
                now = time.monotonic()
                if now - self._last_claim >= self.options.claim_every_s:
                    self._last_claim = now
                    deliveries = await queue.claim(self.options.batch_size)
                    self.counters["claimed"] += sum(d.job is not None for d in deliveries)
                if not deliveries:
                    deliveries = await queue.read(self.options.batch_size,
                                                  self.options.read_block_ms)
                if deliveries:
                    await self.process(deliveries)
                    await queue.ack([d.entry_id for d in deliveries])
                    for d in deliveries:
                        self._interrupts.pop(d.entry_id, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping:
                    return
                # Redis hiccup or a bug: the jobs stay pending and are read again.
                log.warning("translator %s: batch failed: %s", self.options.translator_id,
                            type(exc).__name__,
                            exc_info=not isinstance(exc, (OSError, BackendInterrupted)))
                self.counters["batch_failures"] += 1
                queue.reread_pending()
                await asyncio.sleep(0.5)

    async def process(self, deliveries: list[Delivery]) -> None:
        """Translate and publish every target of these jobs (without acking)."""
        items: list[_Item] = []
        now = time.time()
        for d in deliveries:
            if d.job is None:
                self.counters["undecodable"] += 1
                continue
            if not d.job.is_final and now - d.job.source_emit_time > self.options.max_tail_age_s:
                self.counters["stale_tail_jobs"] += 1
                continue
            items.extend(_Item(d, d.job, t) for t in d.job.targets)
        by_backend: dict[str, list[_Item]] = defaultdict(list)
        for it in items:
            try:
                it.backend = self.options.routes.backend_for(it.job.source_lang, it.target)
            except BackendError as exc:
                it.backend, it.result = "none", exc
                continue
            by_backend[it.backend].append(it)
        await asyncio.gather(*(self._translate(name, group)
                               for name, group in by_backend.items()))
        interrupted = [it.result for it in items if isinstance(it.result, BackendInterrupted)]
        if interrupted and self._try_again(deliveries):
            # Nothing of this batch is published: it is read again (the batch-failure path
            # of _run) or, if this translator is going down, claimed by another one.
            raise interrupted[0]
        # Source order within the batch, so each language's seq follows the source's.
        items.sort(key=lambda it: (it.job.stream, it.job.seq))
        for it in items:
            await self._publish(it)

    def _try_again(self, deliveries: list[Delivery]) -> bool:
        """Whether a batch with interrupted targets (a backend process killed by a signal,
        `BackendInterrupted`) is read again rather than published with those targets
        failed: no, once one of its jobs was interrupted `MAX_INTERRUPTS` times, so a
        backend that is killed every time cannot hold the queue."""
        worst = 0
        for d in deliveries:
            self._interrupts[d.entry_id] = n = self._interrupts.get(d.entry_id, 0) + 1
            worst = max(worst, n)
        while len(self._interrupts) > 10_000:  # jobs claimed away are never acked here
            self._interrupts.pop(next(iter(self._interrupts)))
        if worst > MAX_INTERRUPTS:
            return False
        self.counters["interrupted_retries"] += 1
        return True

    async def _translate(self, name: str, group: list[_Item]) -> None:
        try:
            try:
                backend = await self._backend(name)
            except Exception as exc:
                log.error("translation backend %s cannot start: %s", name, exc)
                raise
            requests = [TranslationRequest(it.job.text, it.job.source_lang, it.target,
                                           it.job.context if backend.uses_context else ())
                        for it in group]
            results = await wait_for(backend.translate(requests, self.glossary),
                                     self.options.job_timeout_s)
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                exc = BackendTimeout(f"{name} timed out after {self.options.job_timeout_s} s")
            results = [exc] * len(group)
        for it, res in zip(group, results, strict=True):
            it.result = res

    async def _publish(self, it: _Item) -> None:
        job, res = it.job, it.result
        error: str | None = None
        text = ""
        if isinstance(res, str) and res.strip():
            text = " ".join(res.split())
        else:
            exc = res if isinstance(res, BaseException) else BackendError("empty translation")
            error = f"{it.backend}: {type(exc).__name__}"
            log.warning("stream %s segment %d → %s: translation failed (%s)", job.stream,
                        job.segment_id, it.target, error)
        key = (job.stream, it.target, job.segment_id)
        revision = self._tail_revisions.get(key, 0) + 1
        if job.is_final:
            self._tail_revisions.pop(key, None)
        else:
            self._tail_revisions[key] = revision
            if len(self._tail_revisions) > 10_000:
                self._tail_revisions.pop(next(iter(self._tail_revisions)))
        seg = CaptionSegment(
            stream=job.stream, lang=it.target, segment_id=job.segment_id, seq=0,
            revision=revision, is_final=job.is_final, text=text,
            stable_prefix_len=len(text) if job.is_final else 0,
            lines=break_lines(text, WEB, it.target) if text else (),
            audio_start_s=job.audio_start_s, audio_end_s=job.audio_end_s,
            audio_end_wall=job.audio_end_wall, emit_time=time.time(), error=error,
            source_lang=job.source_lang,
        )
        seq = await self._publish_held(seg)
        if seq == 0:
            self.counters["duplicates_skipped"] += 1
            return
        lag = seg.emit_time - job.source_emit_time
        kind = "finals" if job.is_final else "tails"
        self.counters[f"{kind}_published"] += 1
        if error:
            self.counters["errors"] += 1
            self.counters[f"errors_{it.backend}"] += 1
        if job.is_final:
            self.lags.append(lag)
            self.lags_by_lang.setdefault(it.target, deque(maxlen=500)).append(lag)
        if self.metrics is not None:
            try:  # a metrics failure never holds a translation back
                self.metrics.published(job.stream, it.target, it.backend, lag,
                                       error is not None, job.is_final)
            except Exception as exc:
                log.warning("translator %s: metrics failed: %s", self.options.translator_id,
                            type(exc).__name__)

    async def _publish_held(self, seg: CaptionSegment) -> int:
        """Publish, holding the translation while Redis is away; when it came back empty
        (another epoch), wait until the orchestrator has set the seq floors and the new
        epoch, then publish above this host's own floor."""
        key = (seg.stream, seg.lang)
        while True:
            seq = await retry_redis(
                lambda: self.bus.publish_translation(seg, floor=self._floors.get(key, 0),
                                                     epoch=self._epoch),
                what=f"translator {self.options.translator_id}", log=log)
            if seq != -1:
                break
            epoch = await retry_redis(self.bus.epoch, what="epoch", log=log)
            if epoch and epoch != self._epoch:
                log.warning("translator %s: Redis was emptied; publishing above the last "
                            "known seqs", self.options.translator_id)
                self._epoch = epoch
                self.counters["epoch_changes"] += 1
                continue
            await asyncio.sleep(0.2)
        if seq > 0:
            self._floors[key] = max(seq, self._floors.get(key, 0))
        return int(seq)

    # ---- reporting -------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        for name, backend in self._backends.items():
            out.update(backend.stats.as_fields(name.replace("-", "_")))
        if self.lags:
            out["lag_p50_s"], out["lag_p95_s"] = _p50_p95(self.lags)
        for lang, lags in self.lags_by_lang.items():
            out[f"lag_p50_s_{lang}"], out[f"lag_p95_s_{lang}"] = _p50_p95(lags)
        return out

    def _export_usage(self) -> None:
        if self.metrics is None:
            return
        for name, backend in self._backends.items():
            st = backend.stats
            counters: dict[str, float] = {}
            for key, value in (("requests", st.requests), ("chars_in", st.chars_in),
                               ("prompt_chars", st.prompt_chars)):
                seen = self._usage_seen.get((name, key), 0.0)
                if value > seen:
                    counters[key] = value - seen
                self._usage_seen[(name, key)] = value
            if counters:
                self.metrics.usage(name, counters)

    async def _report_loop(self, every_s: float = 1.0) -> None:
        assert self._queue is not None
        while not self._stopping:
            with contextlib.suppress(Exception):
                fields: dict[str, Any] = {**self.stats(), "kind": "translator"}
                depth = await self._queue.depth()
                fields.update({f"queue_{k}": v for k, v in depth.items()})
                await self.bus.set_actor_status(self.options.translator_id, fields)
                if self.metrics is not None:
                    self.metrics.queue(depth)
                    self._export_usage()
            await asyncio.sleep(every_s)

    async def health(self) -> dict[str, Any]:
        return {"translator_id": self.options.translator_id,
                "backends": sorted(self._backends), "running": self._loop is not None
                and not self._loop.done()}

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._loop, self._reporter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for backend in self._backends.values():
            with contextlib.suppress(Exception):
                await backend.aclose()
        if self._redis is not None:
            await self._redis.aclose()


def _p50_p95(lags: deque[float]) -> tuple[float, float]:
    ordered = sorted(lags)
    return (round(ordered[len(ordered) // 2], 3),
            round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 3))
