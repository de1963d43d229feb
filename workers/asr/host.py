"""The ASR host: the streams pinned to one actor, one engine and one audio reader for all.

Streams are added (resuming from the cursor of a previous owner), moved away, updated
and drained here; one task reads every stream's audio with a single blocking XREAD and
hands it to the stream's runner (workers.asr.stream); another reports the engine's and
the streams' figures every second. `health` and `lag_summary` tell the supervisor how
the actor and its streams keep up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import replace
from typing import Any

from redis.asyncio import Redis

from workers.aio import cancel_and_join
from workers.asr.options import AsrHostOptions
from workers.asr.stream import _StreamRunner
from workers.backlog import BacklogGuard
from workers.bus import RETRYABLE, RedisBus, connect_redis, cursor_key, entry_ms, retry_redis
from workers.captions.segmenter import Segmenter
from workers.engines.base import SpeechEngine
from workers.engines.vad import VadService
from workers.events import AudioChunk, StreamOptions
from workers.telemetry import MetricsSink

log = logging.getLogger(__name__)

LAG_BEHIND_S = 10.0
"""A stream whose captions are more than this behind real time counts as behind (the
actor's `streams_behind`, the live view, the CaptionsBehind alert)."""

FINISH_S = 5.0
"""How long a stop waits for the streams' sessions to finish what they heard (the
runtime gives an actor's stop 10 s)."""


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
        self.engine_started: tuple[float, float] | None = None
        """Wall times the engine's start began and ended (in the status as
        `engine_start_at` and `engine_start_s`)."""
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
        began = time.time()
        await self.engine.start()
        self.engine_started = (began, time.time())
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
            **self._start_fields(),
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
        every_s = self.options.read_every_ms / 1000
        last = -every_s
        while True:
            if not self._cursors:
                self._wake.clear()
                await self._wake.wait()
                continue
            if (wait := last + every_s - time.monotonic()) > 0:
                await asyncio.sleep(wait)  # gather more streams' chunks into this read
            last = time.monotonic()
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

    def _start_fields(self) -> dict[str, float]:
        if self.engine_started is None:
            return {}
        began, ended = self.engine_started
        return {"engine_start_at": round(began, 3), "engine_start_s": round(ended - began, 3)}

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
                     "audio_s": round(self.audio_s, 3), "engine_ok": int(self.engine_ok),
                     **self._start_fields()},
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
