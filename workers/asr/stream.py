"""One stream on an ASR host: its session, its captions, its cursor and translation jobs.

The runner claims the stream's captions (one owner at a time), feeds its audio to a
session manager, turns the deltas into caption segments and publishes them with the
cursor a new owner resumes from, queues a translation job per final, and exports the
session's counters. A session that fails is replaced after a backoff.
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
from dataclasses import replace
from typing import Protocol

from workers.aio import cancel_and_join, cancel_and_wait, wait_for
from workers.asr.options import AsrHostOptions
from workers.bus import RETRYABLE, RedisBus, retry_redis
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
from workers.sessions.manager import ROLLOVER_REASONS, SKIP_REASONS, SessionManager
from workers.telemetry import MetricsSink

log = logging.getLogger(__name__)

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


class Fenced(Exception):
    """Another runner claimed the stream: this one must not publish for it again."""


class Host(Protocol):
    """What a runner uses of its host (workers.asr.host.AsrHost)."""

    options: AsrHostOptions
    engine: SpeechEngine
    metrics: MetricsSink | None
    vad_service: VadService | None
    audio_s: float

    @property
    def bus(self) -> RedisBus: ...

    def let_go(self, stream_id: str, runner: _StreamRunner) -> None: ...


class _StreamRunner:
    def __init__(self, host: Host, opts: StreamOptions) -> None:
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

