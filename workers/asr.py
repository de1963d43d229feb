"""The ASR host: one speech engine, one session per pinned stream.

A plain class (the orchestrator's runtime wraps it in a Ray actor). One reader
task pulls audio for all pinned streams from Redis with a single blocking
XREAD and hands each item to its stream's session; one task per stream turns
the session's deltas into caption segments and publishes them. A stream whose
session fails gets a new session after a backoff, its open caption is closed,
and no other stream notices.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from redis.asyncio import Redis

from workers.aio import cancel_and_join, cancel_and_wait, wait_for
from workers.backlog import BacklogGuard
from workers.bus import RETRYABLE, RedisBus, connect_redis, cursor_key, entry_ms, retry_redis
from workers.captions.segmenter import Segmenter
from workers.engines.base import SessionOptions, SpeechEngine
from workers.engines.vad import VadService
from workers.events import (
    SAMPLE_RATE,
    SOURCE_ENDED,
    AudioChunk,
    AudioGap,
    CaptionSegment,
    StreamOptions,
    TranscriptDelta,
    TranslationJob,
)
from workers.sessions.manager import (
    ROLLOVER_REASONS,
    SKIP_REASONS,
    SessionManager,
    SessionPolicy,
)
from workers.telemetry import MetricsSink

log = logging.getLogger(__name__)

LAG_BEHIND_S = 10.0
"""A stream whose captions are more than this behind real time counts as behind (the
actor's `streams_behind`, the live view, the CaptionsBehind alert)."""

FINISH_S = 5.0
"""How long a stop waits for the streams' sessions to finish what they heard (the
runtime gives an actor's stop 10 s)."""

ZERO_AT_START = ("gaps", "rut_recoveries", "session_errors", "stalls", "gap_fill_s",
                 "late_audio_dropped_s")
"""Stream counters reported at 0 when the stream starts (with `rollovers_<reason>`)."""


class WallMap:
    """Maps a stream's audio time to the wall time at which that audio was captured."""

    def __init__(self, keep: int = 2000) -> None:
        self._ends: deque[int] = deque(maxlen=keep)
        self._walls: deque[float] = deque(maxlen=keep)

    def add(self, chunk: AudioChunk) -> None:
        self._ends.append(chunk.pos + chunk.samples)
        self._walls.append(chunk.wall)

    def wall_of(self, t_s: float) -> float:
        if not self._ends:
            return time.time()
        pos = int(t_s * SAMPLE_RATE)
        ends = list(self._ends)
        i = min(bisect.bisect_left(ends, pos), len(ends) - 1)
        return self._walls[i] - (ends[i] - pos) / SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class AsrHostOptions:
    actor_id: str
    redis_url: str
    max_streams: int
    restart_backoff_s: float = 1.0
    read_block_ms: int = 200
    session_policy: SessionPolicy = field(default_factory=SessionPolicy)
    max_backlog_s: float = 20.0
    """Audio seconds one stream may get ahead of real time in this actor (a publisher's
    catch-up burst fits); beyond it its audio is skipped (see workers.backlog)."""
    max_catchup_s: float = 15.0
    """A stream that comes to this actor from another (a restart, a failover) resumes
    where its last final ended, at most this far behind the live edge, and catches up
    faster than real time; audio older than that is skipped and counted. Below
    `max_backlog_s`, so the catch-up burst is admitted."""
    vad_process: bool = False
    """Voice activity in a helper process (GPU actors: keeps Silero, which holds the
    GIL, off the event loop that also runs vLLM's front end)."""
    vad_processes: int = 1
    """Helper processes for that (`VadService`); each holds ~`vad.STREAMS_PER_PROCESS`
    streams."""
    lease_ttl_s: float | None = None
    """Keep this actor's lease in Redis (workers/lease.py) with this expiry while its
    engine works, so the supervisor moves its streams within seconds of a lost node, a
    frozen process or a dead engine; None: no lease (a host outside an event)."""


class Fenced(Exception):
    """Another runner claimed the stream: this one must not publish for it again."""


class _StreamRunner:
    def __init__(self, host: AsrHost, opts: StreamOptions) -> None:
        self.host = host
        self.opts = opts
        # This runner's claim on the stream's captions (bus.claim_stream): an actor cut
        # off from Ray goes on captioning for a while (~15 s after its node's raylet died)
        # and must not write once the stream's new owner has claimed it.
        self.owner = f"{host.options.actor_id}:{uuid.uuid4().hex[:12]}"
        self.walls = WallMap()
        self.session: SessionManager | None = None
        self._exported: dict[str, float] = {}
        self.segmenter: Segmenter | None = None
        self.task: asyncio.Task[None] | None = None
        self.failures = 0
        self._context: deque[str] = deque(maxlen=max(0, opts.context_sentences))
        self._last_tail_job = 0.0
        # Metrics only (see export): audio handed to the session since the last export,
        # failures already exported, the last caption with text, and speech seconds since it.
        self._audio_unexported = 0.0
        self._failures_exported = 0
        self._last_caption_at = 0.0
        self._speech_since_caption = 0.0
        self._voiced_seen = 0.0
        # Failover: the audio entries handed to the session (id, end sample), to find
        # where a final's audio ended; words ending at or before floor_s were captioned
        # by the stream's previous owner.
        self._consumed: deque[tuple[str, int]] = deque(maxlen=3000)
        self.floor_s = 0.0
        # How far behind real time the stream's captions are: the latency (emit time less
        # the capture time of its audio's end) of its latest publication with text, and
        # when that was (the supervisor moves a stream that stays behind; see health()).
        self.caption_lag_s: float | None = None
        self.caption_lag_at = 0.0
        # The latest partial with text, while its segment is open: a graceful stop
        # makes it final as shown if the session could not finish it.
        self._open_seg: CaptionSegment | None = None
        self.ended = False  # its source ended: the session finished and was freed

    @property
    def bus(self) -> RedisBus:
        return self.host.bus

    def lag_s(self) -> float | None:
        """How far behind real time the stream's captions are, now: the session
        manager's figure (the oldest speech fed and not yet recognised, to the newest
        audio), which grows while captions stall; for an engine that does not say how
        far it has heard, the latency of the latest caption with text."""
        live = None if self.session is None else self.session.gauges.get("caption_lag_s")
        return live if live is not None else self.caption_lag_s

    async def start(self, resumed: bool = False) -> None:
        """`resumed`: the audio after the previous owner's last final is read again, so
        a caption it left open is decoded again and goes on; otherwise it is closed as
        it was shown."""
        lang = self.opts.caption_lang
        # Claimed before anything is read: a previous owner still running can then no
        # longer publish after what this runner reads as the stream's last caption.
        await retry_redis(functools.partial(self.bus.claim_stream, self.opts.stream_id,
                                            self.owner),
                          what=f"stream {self.opts.stream_id}", log=log)
        last = await self.bus.last_caption(self.opts.stream_id, lang)
        # The Stream's last generated id, not its last entry: it stays when entries were
        # trimmed or when Redis came back empty and orchestrator.epoch set the floor.
        last_seq = max(await self.bus.last_seq(self.opts.stream_id, lang),
                       last.seq if last else 0)
        # Continue seq and segment ids after a restart: clients resume by seq.
        self.segmenter = Segmenter(
            self.opts.stream_id,
            lang,
            next_seq=last_seq + 1,
            next_segment_id=last.segment_id + 1 if last else 1,
            wall_of=self.walls.wall_of,
        )
        if last is not None and not last.is_final and last.text:
            if resumed:
                self.segmenter.resume(last)
            else:
                closed = self.segmenter.close(last)
                await retry_redis(functools.partial(self.bus.publish_caption, closed,
                                                    self.owner),
                                  what=f"stream {self.opts.stream_id}", log=log)
        self.session = self._open()
        self._zero_series()
        self.task = asyncio.create_task(self._consume(), name=f"asr:{self.opts.stream_id}")
        await self.bus.set_status(
            self.opts.stream_id, asr_state="listening", asr_actor=self.host.options.actor_id
        )

    def _zero_series(self) -> None:
        """Every counter series of the stream exists from its start, at 0: a dashboard
        panel reads "No data" until a series' first event, and a `rate()` alert misses
        that first increment."""
        sink = self.host.metrics
        if sink is None:
            return
        keys = [*ZERO_AT_START, *(f"rollovers_{r}" for r in ROLLOVER_REASONS),
                *(f"skipped_s_{r}" for r in SKIP_REASONS)]
        try:
            sink.stream_update(self.opts.stream_id, dict.fromkeys(keys, 0.0), {})
        except Exception as exc:
            log.warning("stream %s: metrics failed: %s", self.opts.stream_id,
                        type(exc).__name__)

    def _open(self) -> SessionManager:
        # The manager keeps the stream captioned across engine session ends, ruts and
        # errors; the runner only sees one endless session.
        service = self.host.vad_service
        manager = SessionManager(
            self.host.engine,
            SessionOptions(stream_id=self.opts.stream_id, language=self.opts.language),
            self.host.options.session_policy,
            vad=service.stream(self.opts.stream_id) if service is not None else None,
        )
        manager.start()
        return manager

    async def push(self, item: AudioChunk | AudioGap, entry_id: str | None = None) -> None:
        if isinstance(item, AudioGap) and item.reason == SOURCE_ENDED:
            await self._source_ended()
            return
        if isinstance(item, AudioChunk) and self.ended:
            self._reopen()  # the source came back (a restarted ingest, a new file)
        if isinstance(item, AudioChunk):
            if entry_id is not None:
                self._consumed.append((entry_id, item.pos + item.samples))
            self.walls.add(item)
            self._audio_unexported += item.samples / SAMPLE_RATE
            self.host.audio_s += item.samples / SAMPLE_RATE
        if self.session is not None:
            await self.session.push(item)

    async def _source_ended(self) -> None:
        """The source ended for good: the session finishes what it heard (its last words
        become finals) and is freed; no filler is fed from here on (issue 36: an ended
        HLS room kept its session and its FILLER count kept rising)."""
        if self.ended or self.session is None:
            return
        self.ended = True
        await self.session.end_input()  # _consume publishes the rest, then frees it

    def _reopen(self) -> None:
        self.ended = False
        self.session = self._open()
        self.task = asyncio.create_task(self._consume(), name=f"asr:{self.opts.stream_id}")

    def _above_floor(self, delta: TranscriptDelta) -> TranscriptDelta:
        """Without the words the previous owner already made final (audio read again
        after a failover starts a little before its last final's end)."""
        floor = self.floor_s + 0.01
        return replace(delta, committed=tuple(w for w in delta.committed if w.end_s > floor),
                       tentative=tuple(w for w in delta.tentative if w.end_s > floor))

    def _cursor_for(self, seg: CaptionSegment) -> tuple[str, float] | None:
        """Where a new owner resumes after this final: the last audio entry that ended
        at or before it, and its end (words up to there are captioned)."""
        if not (seg.is_final and seg.text):
            return None
        end = round(seg.audio_end_s * SAMPLE_RATE)
        after = next((i for i, e in reversed(self._consumed) if e <= end), None)
        return None if after is None else (after, seg.audio_end_s)

    async def _publish(self, delta: TranscriptDelta) -> None:
        assert self.segmenter is not None
        if self.floor_s:
            delta = self._above_floor(delta)
        for seg in self.segmenter.feed(delta):
            # Held until Redis takes it: its seq is given, and a seq never published
            # would be a hole every client sees.
            # The cursor moves with the final, in one step (see publish_caption).
            if not await retry_redis(functools.partial(self.bus.publish_caption, seg,
                                                       self.owner, self._cursor_for(seg)),
                                     what=f"stream {self.opts.stream_id}", log=log):
                raise Fenced(self.opts.stream_id)
            self._count_caption(seg)
            self._open_seg = seg if not seg.is_final and seg.text else None
            fields: dict[str, str | float | int] = {
                "asr_state": "captioning",
                "last_caption_at": seg.emit_time,
                "last_seq": seg.seq,
            }
            try:  # status is a view: Redis being away must not hold captions back
                if seg.is_final:
                    fields["last_final_latency_s"] = round(seg.emit_time - seg.audio_end_wall,
                                                           3)
                    await self.bus.incr_status(self.opts.stream_id, "finals")
                await self.bus.set_status(self.opts.stream_id, **fields)
            except RETRYABLE as exc:
                log.warning("stream %s: status not written: %s", self.opts.stream_id,
                            type(exc).__name__)
            await self._enqueue_translation(seg)

    def _count_caption(self, seg: CaptionSegment) -> None:
        if seg.text:
            self._last_caption_at = seg.emit_time
            self.caption_lag_s = max(0.0, seg.emit_time - seg.audio_end_wall)
            self.caption_lag_at = seg.emit_time
            # The watchdog's voiced-without-text count restarts with this text too.
            self._speech_since_caption = 0.0
            self._voiced_seen = 0.0
        sink = self.host.metrics
        if sink is None:
            return
        latency = seg.emit_time - seg.audio_end_wall if seg.text else None
        try:  # a metrics failure never stops captions
            sink.caption_published(self.opts.stream_id, seg.is_final, latency)
        except Exception as exc:
            log.warning("stream %s: caption metrics failed: %s", self.opts.stream_id,
                        type(exc).__name__)

    def _count_speech(self, voiced_without_text_s: float) -> None:
        """Speech seconds since the last caption, from the watchdog's gauge: it grows
        with speech and restarts at 0 on text or on a rollover, so a drop means the
        speech since the restart is all new (a rut that rolls over and over keeps
        growing this sum, where the gauge itself saws)."""
        grew = voiced_without_text_s - self._voiced_seen
        self._speech_since_caption += grew if grew >= 0 else voiced_without_text_s
        self._voiced_seen = voiced_without_text_s

    async def _enqueue_translation(self, seg: CaptionSegment) -> None:
        """One job per final sentence (all targets at once), with the stream's previous
        finals as context; the open segment only when the live-tail option asks."""
        if not self.opts.targets or not seg.text:
            return
        if not seg.is_final:
            every = self.opts.partials_every_s
            if every is None or seg.emit_time - self._last_tail_job < every:
                return
            self._last_tail_job = seg.emit_time
        job = TranslationJob(
            stream=seg.stream, segment_id=seg.segment_id, seq=seg.seq, text=seg.text,
            source_lang=self.opts.language, targets=self.opts.targets,
            context=tuple(self._context), audio_start_s=seg.audio_start_s,
            audio_end_s=seg.audio_end_s, audio_end_wall=seg.audio_end_wall,
            source_emit_time=seg.emit_time, is_final=seg.is_final,
        )
        try:  # held while Redis restarts: the translation of a final is not lost
            await retry_redis(lambda: self.bus.enqueue_job(job),
                              what=f"stream {self.opts.stream_id}", log=log)
        except Exception as exc:  # the caption is out; a lost job is counted, not fatal
            log.warning("stream %s: cannot enqueue translation job: %s", self.opts.stream_id,
                        type(exc).__name__)
            with contextlib.suppress(Exception):
                await self.bus.incr_status(self.opts.stream_id, "mt_enqueue_errors")
        if seg.is_final:
            self._context.append(seg.text)

    async def _consume(self) -> None:
        stream = self.opts.stream_id
        while True:
            try:
                assert self.session is not None
                async for delta in self.session:
                    await self._publish(delta)
                if self.ended:
                    session, self.session = self.session, None
                    await session.aclose()
                    with contextlib.suppress(*RETRYABLE):
                        await self.bus.set_status(stream, asr_state="ended", caption_lag_s=0.0)
                    self.caption_lag_s = None  # nothing is behind any more
                    if self.host.metrics is not None:
                        with contextlib.suppress(Exception):
                            self.host.metrics.stream_update(stream, {}, {"caption_lag_s": 0.0})
                return
            except asyncio.CancelledError:
                raise
            except Fenced:
                log.warning("stream %s: another actor owns it now; this one stops it",
                            stream)
                self.host.let_go(stream, self)
                return
            except Exception as exc:
                self.failures += 1
                log.warning("stream %s: session failed (%s); opening a new one", stream,
                            type(exc).__name__)
                with contextlib.suppress(Exception):
                    # Close what was on screen (the new session starts from fresh audio),
                    # then say so: publishing sets the state to "captioning".
                    await self._publish(TranscriptDelta(end_of_utterance=True))
                    await self.bus.incr_status(stream, "session_errors")
                    await self.bus.set_status(stream, asr_state="restarting",
                                              asr_error=type(exc).__name__)
                if self.session is not None:
                    await self.session.aclose()
                self.session = None
                await asyncio.sleep(self.host.options.restart_backoff_s)
                try:
                    self.session = self._open()
                except Exception as open_exc:
                    log.warning("stream %s: cannot open a session: %s", stream, open_exc)
                    continue

    async def export(self, sink: MetricsSink | None) -> None:
        """Session-manager counters and gauges → status fields (and metrics)."""
        if self.session is None:
            return
        counters = dict(self.session.counters)
        gauges = dict(self.session.gauges)
        delta = {k: v - self._exported.get(k, 0.0) for k, v in counters.items()
                 if v != self._exported.get(k, 0.0)}
        self._exported = counters
        if "voiced_without_text_s" in gauges:
            self._count_speech(gauges["voiced_without_text_s"])
        fields: dict[str, str | float | int] = {k: round(v, 3) for k, v in counters.items()}
        fields.update(gauges)
        fields["speech_without_caption_s"] = round(self._speech_since_caption, 1)
        lag = self.lag_s()
        if lag is not None:
            fields["caption_lag_s"] = round(lag, 1)
        await self.bus.set_status(self.opts.stream_id, **fields)
        if sink is not None:
            failures = self.failures - self._failures_exported
            self._failures_exported = self.failures
            extra = {"session_errors": float(failures), "asr_audio_s": self._audio_unexported}
            self._audio_unexported = 0.0
            metric_gauges = {**gauges, "speech_without_caption_s": self._speech_since_caption,
                             "active": 1.0, "caption_lag_s": lag or 0.0}
            if self._last_caption_at:
                metric_gauges["last_caption_at"] = self._last_caption_at
            sink.stream_update(self.opts.stream_id,
                               {**delta, **{k: v for k, v in extra.items() if v}},
                               metric_gauges)

    async def finish(self, timeout_s: float) -> None:
        """A graceful stop: the session is told its input ended, so it finishes what it
        heard (its last words become finals); within `timeout_s`. A caption still open
        then is made final as it was shown: a stop never leaves a sentence open, nor
        lost from the archive (issue 36: after SIGTERM it came back empty)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.session is not None and self.task is not None and not self.task.done():
            with contextlib.suppress(TimeoutError):
                await wait_for(self.session.end_input(), timeout_s)
                await wait_for(asyncio.shield(self.task), max(0.1, deadline - loop.time()))
        if self.task is not None and not self.task.done():
            await self.stop()  # nothing more comes from the session
        open_seg, self._open_seg = self._open_seg, None
        if open_seg is None or self.segmenter is None:
            return
        closed = self.segmenter.close(open_seg)
        try:
            if await wait_for(self.bus.publish_caption(closed, self.owner,
                                                       self._cursor_for(closed)),
                              max(0.5, deadline - loop.time())):
                await self._enqueue_translation(closed)
        except TimeoutError:
            log.warning("stream %s: open caption not closed at stop: Redis timed out",
                        self.opts.stream_id)
        except RETRYABLE as exc:
            log.warning("stream %s: open caption not closed at stop: %s",
                        self.opts.stream_id, type(exc).__name__)

    async def stop(self) -> None:
        if self.task is not None and not await cancel_and_wait(self.task, 5):
            await cancel_and_join(self.task)  # cancelled again; its end still awaited
        if self.session is not None:
            await self.session.aclose()


class AsrHost:
    def __init__(self, options: AsrHostOptions, engine: SpeechEngine,
                 metrics: MetricsSink | None = None) -> None:
        self.options = options
        self.engine = engine
        self.metrics = metrics
        self._redis: Redis | None = None
        self._bus: RedisBus | None = None
        self._runners: dict[str, _StreamRunner] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._cursors: dict[str, str] = {}
        self._reader: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._reporter: asyncio.Task[None] | None = None
        self._engine_seen: dict[str, float] = {}
        self._lease: Any = None  # workers.lease.LeaseKeeper, with lease_ttl_s
        self._backlog = BacklogGuard(options.max_backlog_s)
        self.vad_service = (VadService(options.vad_processes) if options.vad_process
                            else None)
        self.engine_ok = True
        self.audio_s = 0.0
        """Audio seconds handed to all sessions since start (engine busy / this = RTF)."""

    @property
    def bus(self) -> RedisBus:
        if self._bus is None:
            raise RuntimeError("AsrHost.start() was not called")
        return self._bus

    async def start(self) -> None:
        self._redis = connect_redis(self.options.redis_url)
        self._bus = RedisBus(self._redis)
        await self.engine.start()
        self._reader = asyncio.create_task(self._read_loop(), name="asr-reader")
        self._reporter = asyncio.create_task(self._report_loop(), name="asr-report")
        if self.options.lease_ttl_s:
            from workers.lease import LeaseKeeper

            self._lease = LeaseKeeper(self.options.redis_url, self.options.actor_id,
                                      lambda: self.engine_ok, ttl_s=self.options.lease_ttl_s,
                                      every_s=min(0.5, self.options.lease_ttl_s / 4))
            self._lease.start()

    async def add_stream(self, opts: StreamOptions) -> None:
        if opts.stream_id in self._runners:
            return
        if len(self._runners) >= self.options.max_streams:
            raise RuntimeError(
                f"actor {self.options.actor_id} is full ({self.options.max_streams} streams)"
            )
        sid = opts.stream_id
        live = await self.bus.last_audio_id(sid)
        start_id, floor_s, skipped_s = live, 0.0, 0.0
        cursor = await self.bus.load_cursor(sid)
        if cursor is not None and live != "0-0":
            # The stream had an owner: go on after its last final (a restart, a
            # failover), so what was said meanwhile is captioned, not skipped.
            after_id, floor_s = cursor
            behind_ms = entry_ms(live) - entry_ms(after_id)
            limit_ms = round(self.options.max_catchup_s * 1000)
            if 0 <= behind_ms <= limit_ms:
                start_id = after_id
            elif behind_ms > limit_ms:
                start_id = f"{entry_ms(live) - limit_ms}-0"
                skipped_s = (behind_ms - limit_ms) / 1000
            else:  # the cursor is newer than the audio: Redis came back empty
                floor_s = 0.0
        elif live != "0-0" and await self.bus.had_owner(sid):
            # An owner that made no final yet (the stream's first words, or a stream
            # behind real time): nothing of it is captioned for good, so the new owner
            # reads the audio again from its start, as far back as max_catchup_s
            # (bench.failover's baseline: half the streams lost their words here).
            first = await self.bus.first_audio_id(sid)
            limit_ms = round(self.options.max_catchup_s * 1000)
            oldest_ms = max(entry_ms(first), entry_ms(live) - limit_ms)
            start_id = f"{max(0, oldest_ms - 1)}-0"
            skipped_s = max(0.0, (oldest_ms - entry_ms(first)) / 1000)
        runner = _StreamRunner(self, opts)
        runner.floor_s = floor_s
        await runner.start(resumed=start_id != live)
        self._runners[sid] = runner
        self._cursors[sid] = start_id
        if start_id != live:
            log.info("stream %s resumes %.1f s behind the live edge", sid,
                     (entry_ms(live) - entry_ms(start_id)) / 1000)
            with contextlib.suppress(*RETRYABLE):
                await self.bus.incr_status(sid, "resumes")
        if skipped_s:
            log.warning("stream %s: %.1f s of audio older than max_catchup_s skipped", sid,
                        skipped_s)
            with contextlib.suppress(*RETRYABLE):
                await self.bus.incr_status(sid, "resume_skipped_s", round(skipped_s, 3))
        self._wake.set()

    def let_go(self, stream_id: str, runner: _StreamRunner) -> None:
        """`runner` lost the stream to another actor (Fenced): stop reading for it. Its
        session is closed in the background (the runner's own task is the caller)."""
        if self._runners.get(stream_id) is not runner:
            return
        self._runners.pop(stream_id, None)
        self._cursors.pop(stream_id, None)
        if runner.session is not None:
            session, runner.session = runner.session, None
            self._background.add(task := asyncio.create_task(session.aclose()))
            task.add_done_callback(self._background.discard)

    async def remove_stream(self, stream_id: str) -> None:
        self._cursors.pop(stream_id, None)
        runner = self._runners.pop(stream_id, None)
        if runner is not None:
            await runner.stop()

    async def update_stream(self, opts: StreamOptions) -> bool:
        """Take a running stream's new targets (and display name) without touching its
        session: the next final is translated into the new targets. False when the
        stream is not here."""
        runner = self._runners.get(opts.stream_id)
        if runner is None:
            return False
        runner.opts = replace(runner.opts, name=opts.name, targets=opts.targets,
                              partials_every_s=opts.partials_every_s)
        return True

    async def drain_stream(self, stream_id: str, lang: str) -> int:
        """Remove a stream for good (it left the event): its session stops, and a caption
        left open is published as a final as it was shown, once (a second drain finds
        it final). Its cursor goes too, so the stream added again later starts at the
        live edge. Returns the seq of the stream's last publication in `lang` (0: none)."""
        # The runner's options go with it: the closed final gets its translation job.
        runner = self._runners.get(stream_id)
        await self.remove_stream(stream_id)
        last = await self.bus.last_caption(stream_id, lang)
        last_seq = max(await self.bus.last_seq(stream_id, lang), last.seq if last else 0)
        if last is not None and not last.is_final and last.text:
            closing = Segmenter(stream_id, lang, next_seq=last_seq + 1)
            closed = closing.close(last)
            await retry_redis(functools.partial(self.bus.publish_caption, closed),
                              what=f"stream {stream_id}", log=log)
            last_seq = closed.seq
            if runner is not None:  # translated like every final
                await runner._enqueue_translation(closed)
        await self.bus.redis.delete(cursor_key(stream_id))
        with contextlib.suppress(*RETRYABLE):
            await self.bus.set_status(stream_id, asr_state="removed", asr_actor="")
        return last_seq

    def streams(self) -> list[str]:
        return list(self._runners)

    async def health(self) -> dict[str, Any]:
        self.engine_ok = await self.engine.check_health()
        return {
            "actor_id": self.options.actor_id,
            "streams": {sid: self._stream_health(r) for sid, r in self._runners.items()},
            "engine_ok": self.engine_ok,
            **self.lag_summary(),
            **self.engine.describe(),
        }

    @staticmethod
    def _stream_health(runner: _StreamRunner) -> dict[str, float | int]:
        """`caption_lag_s`: how far behind real time the stream's captions are
        (`_StreamRunner.lag_s`), and `caption_lag_age_s` how old that figure is: 0 for
        the live one, else the age of the caption it was measured on (absent before
        the first)."""
        out: dict[str, float | int] = {"failures": runner.failures}
        live = None if runner.session is None else runner.session.gauges.get("caption_lag_s")
        if live is not None:
            out["caption_lag_s"] = round(live, 3)
            out["caption_lag_age_s"] = 0.0
        elif runner.caption_lag_s is not None:
            out["caption_lag_s"] = round(runner.caption_lag_s, 3)
            out["caption_lag_age_s"] = round(max(0.0, time.time() - runner.caption_lag_at), 3)
        return out

    def lag_summary(self, behind_s: float = LAG_BEHIND_S) -> dict[str, float | int]:
        """The actor's health as its streams see it: the worst stream's lag and how
        many streams are more than `behind_s` behind real time. An engine can decode
        fast (a low RTF) while its streams fall behind (more streams than it carries,
        a stuck queue); issue 36: `rtf 0.32` read healthy for a room 30 s behind."""
        lags = [lag for r in self._runners.values() if (lag := r.lag_s()) is not None]
        return {"max_caption_lag_s": round(max(lags, default=0.0), 1),
                "streams_behind": sum(1 for lag in lags if lag > behind_s)}

    async def _read_loop(self) -> None:
        while True:
            if not self._cursors:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                items = await self.bus.read_audio(
                    dict(self._cursors), block_ms=self.options.read_block_ms
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup: keep the cursors, try again
                log.warning("audio read failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for stream, entry_id, item in items:
                runner = self._runners.get(stream)
                if runner is None or stream not in self._cursors:
                    continue
                self._cursors[stream] = entry_id
                if isinstance(item, AudioChunk) and not self._backlog.admit(stream, item):
                    # Past its backlog bound: skipped; the session sees the hole as a gap.
                    continue
                if item is not None:
                    try:
                        await runner.push(item, entry_id)
                    except Exception as exc:
                        log.warning("stream %s: push failed: %s", stream, type(exc).__name__)

    async def _report_loop(self, every_s: float = 1.0) -> None:
        """Engine counters to `actor:{id}`, session counters to each stream's status."""
        while True:
            for runner in list(self._runners.values()):
                try:
                    await runner.export(self.metrics)
                except Exception as exc:
                    log.warning("stream %s: status export failed: %s", runner.opts.stream_id,
                                type(exc).__name__)
            stats: dict[str, float] | None = None
            with contextlib.suppress(Exception):
                self.engine_ok = await self.engine.check_health()
            with contextlib.suppress(Exception):
                stats = self.engine.stats()
                await self.bus.set_actor_status(
                    self.options.actor_id,
                    {**stats, **self.engine.describe(), **self.lag_summary(),
                     "streams": len(self._runners),
                     "max_streams": self.options.max_streams,
                     "audio_s": round(self.audio_s, 3), "engine_ok": int(self.engine_ok)},
                )
            try:
                if stats is not None:
                    self._export_engine(stats)
            except Exception as exc:
                log.warning("actor %s: metrics export failed: %s", self.options.actor_id,
                            type(exc).__name__)
            await asyncio.sleep(every_s)

    def _export_engine(self, stats: dict[str, float]) -> None:
        """Engine load as metrics, from the engines that measure it (embedded: busy
        seconds and decode calls)."""
        if self.metrics is None:
            return
        counters: dict[str, float] = {}
        for key, name in (("decode_busy_s", "engine_busy_s"), ("decode_calls", "engine_steps"),
                          ("reanchors", "engine_reanchors"),
                          ("reanchor_rotation_failures", "engine_reanchor_rotation_failures")):
            if key in stats:
                counters[name] = max(0.0, stats[key] - self._engine_seen.get(key, 0.0))
                self._engine_seen[key] = stats[key]
        gauges = {"engine_healthy": float(self.engine_ok)}
        if "reanchoring" in stats:
            gauges["engine_reanchoring"] = stats["reanchoring"]
        self.metrics.actor_update(self.options.actor_id, counters, gauges)

    async def stop(self, finish_s: float = FINISH_S) -> None:
        """Stop reading, let every stream finish what it heard (in parallel, within
        `finish_s`: its last words and open caption become finals), then close."""
        for task in (self._reader, self._reporter):
            if task is not None:
                await cancel_and_join(task)
        if finish_s > 0 and self._runners:
            await asyncio.gather(*(r.finish(finish_s) for r in self._runners.values()),
                                 return_exceptions=True)
        for stream_id in list(self._runners):
            await self.remove_stream(stream_id)
        if self._lease is not None:  # handed over: the supervisor need not wait it out
            await asyncio.to_thread(self._lease.stop)
        await self.engine.aclose()
        if self.vad_service is not None:
            self.vad_service.shutdown()
        if self._redis is not None:
            await self._redis.aclose()
