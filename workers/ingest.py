"""Ingest: sources → `audio:{stream}`, one asyncio task per stream.

`IngestHost` is a plain class (the orchestrator's runtime wraps it in a Ray
actor). Blocking decode work runs in the host's thread pool, so one host
decodes many streams. A failing source is retried with exponential backoff,
its state and error are written to the stream's status, and when audio comes
back the hole is recorded as an `AudioGap` with the audio clock moved on by
the time lost: audio from both sides of a hole is never glued together.

A resumable source (a file) has its position kept in `ingest:cursor:{stream}`
after every entry written; when the stream's task starts again in the same run
(its ingest actor was restarted by Ray, or the task died), the source goes on
from there, so no speech is heard twice. The audio clock goes on after the
stream's last entry either way, with the time lost as an `ingest-restart` gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from workers.aio import cancel_and_wait
from workers.bus import AUDIO_CHUNK_S, RETRYABLE, RedisBus, connect_redis, retry_redis
from workers.events import SAMPLE_RATE, SOURCE_ENDED, AudioChunk, AudioGap, StreamOptions
from workers.sessions.stall import StallThreshold, ingest_threshold
from workers.sources.base import AudioSource, SourceError, SourceEvent
from workers.sources.factory import open_source
from workers.telemetry import MetricsSink

log = logging.getLogger(__name__)

INGEST_GAP_REASONS = ("late", "ingest-restart", "source-error", "source-crash")
"""Gap reasons of ingest itself (a source adds its own: `AudioSource.gap_reasons`)."""


def ingest_cursor_key(stream: str) -> str:
    """Where a resumable source of `stream` stands (see the module doc)."""
    return f"ingest:cursor:{stream}"


def source_fingerprint(url: str) -> str:
    """Names the source a cursor belongs to without storing its URL (it may hold a
    key): a stream whose source changed starts the new one from its start."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


class AudioClock:
    """Stamps one stream's audio with its position and records gaps.

    The audio clock follows wall time across holes: after a 5 s outage the next
    chunk starts 5 s later in audio time, so captions and archives stay aligned
    with the event's clock. A pause is a hole only when it is longer than the
    transport's usual delivery gaps (`late`, learned: see workers/sessions/stall.py);
    shorter ones are bursts of contiguous audio and move nothing.
    """

    def __init__(self, stream: str, pos: int, clock: Callable[[], float] = time.time,
                 *, last_wall: float | None = None, reason: str | None = None,
                 late: StallThreshold | None = None) -> None:
        """`last_wall`: when the audio before `pos` was captured, for a clock that
        takes over a stream (a restarted ingest, a new push connection): the time in
        between becomes a gap with `reason`. `late`: when a pause is a hole; by
        default ingest's side of the session manager's default threshold."""
        self.stream = stream
        self.pos = pos
        self._clock = clock
        self.real_time = clock is time.time
        """Stamps may be derived from time.time() (an injected clock is used as is)."""
        self._last_wall = last_wall
        self._late = late or ingest_threshold()
        self.pending_reason: str | None = reason if last_wall is not None else None

    def stamp(self, pcm: bytes, now: float | None = None) -> tuple[AudioGap | None, AudioChunk]:
        """`now`: when the end of `pcm` was captured (default: the clock)."""
        now = self._clock() if now is None else now
        samples = len(pcm) // 2
        gap: AudioGap | None = None
        threshold = self._late.threshold_s(now)  # before this pause teaches it anything
        self._late.arrival(now)
        if self._last_wall is not None:
            lost = now - self._last_wall - samples / SAMPLE_RATE
            if now - self._last_wall > threshold or self.pending_reason is not None:
                lost = max(lost, 0.0)
                self.pos += round(lost * SAMPLE_RATE)
                gap = AudioGap(self.stream, self.pos, lost, self.pending_reason or "late", now)
        self.pending_reason = None
        chunk = AudioChunk(self.stream, self.pos, pcm, now)
        self.pos += samples
        self._last_wall = now
        return gap, chunk


MAX_ENTRY_BYTES = round(AUDIO_CHUNK_S * SAMPLE_RATE) * 2
"""Audio per Redis entry (100 ms): the audio Stream is capped in entries, so with a
bounded entry its cap is a byte cap too (a 4 MiB frame once became one entry)."""


async def write_audio(bus: RedisBus, clock: AudioClock, pcm: bytes, *,
                      max_wait_s: float | None = None) -> AudioGap | None:
    """Stamp and write audio in entries of at most 100 ms (and the gap before it, if
    any). Each write is retried while Redis is unreachable, for up to `max_wait_s`
    (None: until it is back), so a Redis restart costs a gap, never a dead source."""
    first_gap: AudioGap | None = None
    now = time.time()
    total = len(pcm)
    for start in range(0, total, MAX_ENTRY_BYTES):
        piece = pcm[start : start + MAX_ENTRY_BYTES]
        # Each piece's capture time: the frame ends now, so earlier pieces ended earlier.
        after = (total - start - len(piece)) // 2 / SAMPLE_RATE
        gap, chunk = clock.stamp(piece, now - after if clock.real_time else None)
        if gap is not None:
            first_gap = first_gap or gap
            await retry_redis(functools.partial(bus.add_gap, gap), what=f"stream {clock.stream}",
                              log=log, max_wait_s=max_wait_s)
            try:  # counters are a view: one lost increment is not worth holding audio
                await bus.incr_status(clock.stream, "gaps")
                await bus.incr_status(clock.stream, "gap_seconds", gap.duration_s)
            except RETRYABLE:
                pass
        await retry_redis(functools.partial(bus.add_audio, chunk), what=f"stream {clock.stream}",
                          log=log, max_wait_s=max_wait_s)
    return first_gap


@dataclass(frozen=True, slots=True)
class IngestHostOptions:
    actor_id: str
    redis_url: str
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 1.0
    """A source down for a while is tried this often: a pulled encoder that comes back is
    heard again within about this long (10 s made a 20 s outage last up to 30 s). One
    ffmpeg start or HTTP request a second per dead source is cheap."""
    decode_threads: int = 8
    stall_s: float = 1.0
    stall_max_s: float = 3.0
    """The ASR side's stall settings (engine.session): ingest's audio clock moves past a
    pause just before the ASR side fills it (workers/sessions/stall.py)."""
    report_every_s: float = 1.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The run a source cursor belongs to. Made once with the options, so an actor
    that Ray restarts (same constructor arguments) resumes its files where they
    stopped, while the next `babelcast run` of the event plays them from the start."""


SourceFactory = Callable[[StreamOptions, Any], AudioSource]


def _default_factory(opts: StreamOptions, executor: Any) -> AudioSource:
    return open_source(opts.source, loop=opts.loop, executor=executor, key=opts.key,
                       tls_cert=opts.tls_cert, tls_key=opts.tls_key,
                       hls_start_segments=opts.hls_start_segments)


SOURCE_STATES = ("starting", "connecting", "live", "idle", "reconnecting", "ended", "failed")
"""A stream's `source_state`: `idle` is a listener (or HLS playlist) with nobody sending."""

METRICS_EVERY_S = 1.0
"""How often a stream's decoded audio seconds reach the metrics sink."""
STOP_WAIT_S = 5.0
"""How long `remove_stream` waits for a cancelled stream task to finish."""


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where a pending task waits: its coroutines from the outermost to the innermost
    (`Task.get_stack` shows only the outermost)."""
    parts: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(parts) < 8:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        parts.append(f"{frame.f_code.co_name} "
                     f"({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return " -> ".join(parts) or "?"


class IngestHost:
    def __init__(self, options: IngestHostOptions, source_factory: SourceFactory | None = None,
                 metrics: MetricsSink | None = None):
        self.options = options
        self._factory = source_factory or _default_factory
        self.metrics = metrics
        self._redis: Redis | None = None
        self._bus: RedisBus | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._state: dict[str, str] = {}
        self._reporter: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._redis = connect_redis(self.options.redis_url)
        self._bus = RedisBus(self._redis)
        self._pool = ThreadPoolExecutor(
            max_workers=self.options.decode_threads, thread_name_prefix="decode"
        )
        self._reporter = asyncio.create_task(self._report_loop(), name="ingest-report")

    async def _report_loop(self) -> None:
        """`actor:{id}` for `babelcast status`: this actor is alive, and its streams' states."""
        while True:
            states = list(self._state.values())
            fields: dict[str, float | str] = {
                "kind": "ingest", "streams": len(states),
                **{f"streams_{s}": states.count(s) for s in SOURCE_STATES},
            }
            try:
                await self.bus.set_actor_status(self.options.actor_id, fields)
            except Exception as exc:  # status is a view; audio goes on without it
                log.warning("actor %s: status report failed: %s", self.options.actor_id,
                            type(exc).__name__)
            await asyncio.sleep(self.options.report_every_s)

    @property
    def bus(self) -> RedisBus:
        if self._bus is None:
            raise RuntimeError("IngestHost.start() was not called")
        return self._bus

    async def add_stream(self, opts: StreamOptions) -> None:
        if opts.stream_id in self.streams():
            return
        self._state[opts.stream_id] = "starting"
        self._tasks[opts.stream_id] = asyncio.create_task(
            self._run(opts), name=f"ingest:{opts.stream_id}"
        )

    async def remove_stream(self, stream_id: str) -> None:
        task = self._tasks.pop(stream_id, None)
        if task is not None:
            if not await cancel_and_wait(task, STOP_WAIT_S):
                log.warning("stream %s: its ingest task did not stop within %.0f s, left to "
                            "finish on its own; it waits in %s", stream_id, STOP_WAIT_S,
                            awaiting(task))
        self._state.pop(stream_id, None)

    async def health(self) -> dict[str, str]:
        return dict(self._state)

    def streams(self) -> list[str]:
        """Streams being ingested, or whose source ended: a task that died is not
        listed, so the supervisor adds its stream again."""
        return [s for s, t in self._tasks.items()
                if not t.done() or self._state.get(s) == "ended"]

    async def stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reporter
        for stream_id in list(self._tasks):
            await self.remove_stream(stream_id)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._redis is not None:
            await self._redis.aclose()

    async def _set(self, stream: str, state: str, **fields: str | float | int) -> None:
        self._state[stream] = state
        try:  # status is a view: Redis being away must not stop the audio
            await self.bus.set_status(stream, source_state=state,
                                      ingest_actor=self.options.actor_id, **fields)
        except RETRYABLE as exc:
            log.warning("stream %s: status %s not written: %s", stream, state,
                        type(exc).__name__)

    def _count(self, stream: str, counters: dict[str, float]) -> None:
        if self.metrics is None:
            return
        try:  # a metrics failure never stops audio
            self.metrics.stream_update(stream, counters, {})
        except Exception as exc:
            log.warning("stream %s: ingest metrics failed: %s", stream, type(exc).__name__)

    async def _on_event(self, stream: str, clock: AudioClock, event: SourceEvent) -> None:
        """What a source says besides audio. Details are operator text without secrets."""
        if event.kind == "refused":
            log.warning("stream %s: %s", stream, event.detail)
            self._count(stream, {"source_refused": 1.0})
            with contextlib.suppress(*RETRYABLE):  # status is a view; Redis away is no crash
                await self.bus.incr_status(stream, "source_refused")
                await self.bus.set_status(stream, source_refused_last=event.detail)
            return
        # The audio after an idle spell or a gap is never glued to the audio before.
        clock.pending_reason = event.reason
        if event.kind == "idle":
            await self._set(stream, "idle", source_error="", source_note=event.detail)
        else:
            with contextlib.suppress(*RETRYABLE):
                await self.bus.set_status(stream, source_note=event.detail)

    async def _resume(self, stream: str, source: AudioSource) -> None:
        """Start the source where this run's ingest of it stopped, if it did."""
        try:
            raw = await self.bus.redis.hgetall(ingest_cursor_key(stream))
        except RETRYABLE as exc:  # unknown: start over rather than never start
            log.warning("stream %s: source position not read: %s", stream, type(exc).__name__)
            return
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        if fields.get("run") != self.options.run_id or \
                fields.get("source") != source_fingerprint(source.url):
            return
        try:
            samples = int(fields["samples"])
        except (KeyError, ValueError):
            return
        source.resume_at(samples)
        log.warning("stream %s: source resumes %.1f s in, where this run's ingest stopped",
                    stream, samples / SAMPLE_RATE)
        with contextlib.suppress(*RETRYABLE):  # status is a view
            await self.bus.incr_status(stream, "source_resumes")
            await self.bus.set_status(stream, source_resumed_at_s=round(samples / SAMPLE_RATE, 3))

    async def _save_cursor(self, stream: str, source: AudioSource) -> None:
        """After each entry written (100 ms): a restart re-reads at most that entry's audio
        if it dies between the two writes."""
        try:
            await self.bus.redis.hset(ingest_cursor_key(stream), mapping={
                "run": self.options.run_id, "source": source_fingerprint(source.url),
                "samples": source.position()})
        except RETRYABLE as exc:  # the next entry writes it again
            log.debug("stream %s: source position not written: %s", stream,
                      type(exc).__name__)

    async def _run(self, opts: StreamOptions) -> None:
        stream = opts.stream_id
        pos, wall = await retry_redis(lambda: self.bus.last_audio_end(stream),
                                      what=f"stream {stream}", log=log)
        late = ingest_threshold(self.options.stall_s, self.options.stall_max_s)
        clock = AudioClock(stream, pos, last_wall=wall, reason="ingest-restart", late=late)
        attempt = 0
        audio_s = 0.0
        counted_at = time.monotonic()
        try:
            # One source for the stream's life: it keeps what it learned across
            # reconnects (HLS: the next segment due), and a listener its port.
            source = self._factory(opts, self._pool)
        except ValueError as exc:  # a URL validation should have refused
            await self._set(stream, "failed", source_error=str(exc))
            return
        # Every gap, reconnect and refusal series exists from the start, at 0 (dashboards,
        # rate() alerts).
        self._count(stream, {**{f"source_gaps_{r}": 0.0
                                for r in (*INGEST_GAP_REASONS, *source.gap_reasons)},
                             "source_reconnects": 0.0, "source_refused": 0.0})
        if source.resumable:
            await self._resume(stream, source)
        while True:
            await self._set(stream, "connecting")
            try:
                live = False
                async for item in source.chunks():
                    if isinstance(item, SourceEvent):
                        await self._on_event(stream, clock, item)
                        live = live and item.kind != "idle"
                        continue
                    gap = await write_audio(self.bus, clock, item)
                    if gap is not None:
                        self._count(stream, {f"source_gaps_{gap.reason}": 1.0})
                    if source.resumable:
                        await self._save_cursor(stream, source)
                    audio_s += len(item) / 2 / SAMPLE_RATE
                    if time.monotonic() - counted_at >= METRICS_EVERY_S:
                        self._count(stream, {"source_audio_s": audio_s})
                        audio_s, counted_at = 0.0, time.monotonic()
                    if not live:
                        live = True
                        attempt = 0
                        await self._set(stream, "live", source_error="", source_note="")
                if audio_s:
                    self._count(stream, {"source_audio_s": audio_s})
                # Tell the ASR side: it finishes the stream and frees its session.
                try:
                    await retry_redis(functools.partial(self.bus.add_gap, AudioGap(
                        stream, clock.pos, 0.0, SOURCE_ENDED, time.time())),
                        what=f"stream {stream}", log=log, max_wait_s=10.0)
                except RETRYABLE as exc:
                    log.warning("stream %s: end of source not written: %s", stream,
                                type(exc).__name__)
                await self._set(stream, "ended", source_note="")
                return
            except SourceError as exc:
                # Message is operator-facing and carries no caption text.
                log.warning("stream %s: source error: %s", stream, exc)
                clock.pending_reason = "source-error"
                self._count(stream, {"source_reconnects": 1.0})
                with contextlib.suppress(*RETRYABLE):
                    await self.bus.incr_status(stream, "source_reconnects")
                await self._set(stream, "reconnecting", source_error=str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in one source never stops the others
                log.exception("stream %s: source crashed", stream)
                clock.pending_reason = "source-crash"
                self._count(stream, {"source_reconnects": 1.0})
                await self._set(stream, "reconnecting", source_error=f"{type(exc).__name__}")
            finally:
                with contextlib.suppress(Exception):
                    await source.aclose()
            delay = min(self.options.backoff_max_s, self.options.backoff_initial_s * 2**attempt)
            attempt += 1
            await asyncio.sleep(delay)
