"""The session manager: keeps one stream captioned forever, whatever its engine does.

It sits between a stream's audio and its engine sessions and looks, from the
outside, like a single session that never ends:

- **Pacing.** Audio reaches the engine as one contiguous clock. When the source
  stalls for more than `stall_s`, or a chunk arrives after a hole, the hole is
  filled with faint dithered noise (never zeros) and counted as a gap; a hole
  longer than `max_fill_s` starts a fresh session at the new position instead.
- **Warm rollover** before the session budget runs out (engines that re-anchor need
  none; a configured budget is clamped to the engine's own, which counts the
  padding positions a session uses besides its audio): a new session is opened
  and fed the last `overlap_s` of audio from a ring buffer (it catches up faster
  than real time), then both run until voice activity shows a pause of at least
  `switch_pause_s`. The switch point T is in that pause: the old session's words
  before T are kept, it is told to end (so it flushes them), and the new
  session's words from T on follow. Words are told apart by their audio times,
  and an n-gram check at the seam drops a word seen twice. Each session's budget
  is shortened by a random part of `budget_jitter` (seeded by stream and session), so
  streams started together roll over at different times; when no session slot is
  free to warm a successor, the session is replaced cold once its budget is spent.
- **Rut watchdog**: a stuck session (it heard speech and wrote almost no text, or it
  stopped hearing) is replaced at once; a slow one never is (sessions/watchdog.py).
- **Engine errors / ended sessions**: a session that raises, or that the engine
  ends on its own (stock vLLM at max_model_len), is replaced the same way.
- **No replacement skips audio**: the new session re-reads the ring from the end of
  the old one's last committed word (as a warm rollover re-reads its overlap), however
  far behind the live edge that is; the ring holds what a session's input queue can
  (`BACKLOG_S`). What it skips is counted in `skipped_s_replacement` and logged:
  audio older than the ring; a replay longer than half the new session's budget; and,
  after a replacement with no word since the previous one (the same audio read again
  would only end the same way), what lies before `rut.window_s` (a rut) or `overlap_s`
  (otherwise) before the newest audio.

Voice activity comes from a `VadStream` (Silero in this thread by default; a GPU
actor passes one from a helper process so the VAD stays off its event loop). Its flags
travel with each chunk (`AudioChunk.speech`), so an engine session that needs voice
activity (the embedded one) does not run Silero a second time, with where the last of
them ends (`AudioChunk.speech_end`: Silero's frames run on across chunks).

Counters and gauges are kept in `self.counters` / `self.gauges` for the host to
export (status fields and metrics); the manager itself does no I/O.

**How far behind** (`gauges["caption_lag_s"]`, sessions/lag.py): the seconds from the
oldest speech the current session has been fed but not yet heard to the newest audio.

The policy is `SessionPolicy` (sessions/policy.py); each engine session is a
`Generation` (sessions/generation.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from workers.aio import cancel_and_join
from workers.engines.base import (
    END,
    EngineError,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
)
from workers.engines.vad import FRAME_SAMPLES, InlineVad, VadStream
from workers.events import SAMPLE_RATE, AudioChunk, AudioGap, TranscriptDelta
from workers.sessions.generation import Generation, Seam
from workers.sessions.lag import SpeechRuns
from workers.sessions.pacing import DitherNoise
from workers.sessions.policy import (
    ROLLOVER_REASONS,
    SHED_LEAD_S,
    SKIP_REASONS,
    SessionPolicy,
    jittered_budget,
    session_budget,
)
from workers.sessions.ring import AudioRing
from workers.sessions.stall import asr_threshold
from workers.sessions.watchdog import BACKLOG_S, RutWatchdog

log = logging.getLogger(__name__)

# The policy and the names of what the manager reports are imported from here too.
__all__ = ["ROLLOVER_REASONS", "SKIP_REASONS", "SessionManager", "SessionPolicy",
           "session_budget"]


class SessionManager(RecognizeSession):
    def __init__(
        self,
        engine: SpeechEngine,
        options: SessionOptions,
        policy: SessionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        vad: VadStream | None = None,
    ) -> None:
        super().__init__(options)
        self.engine = engine
        self.policy = policy or SessionPolicy()
        self.budget_s = session_budget(self.policy.budget_s, engine.capabilities)
        self._clock = clock
        p = self.policy
        self._ring = AudioRing(max(p.overlap_s, p.rut.window_s, BACKLOG_S) + 2.0)
        self._vad: VadStream = vad or InlineVad()
        self._vad_carry = 0  # samples the VAD holds toward its next frame
        # An engine that sends text only at a pause (text_lag_s) is mute for that long by
        # design: the watchdog allows it that much more speech, in a window as much longer.
        lag = engine.capabilities.text_lag_s
        self._watch = RutWatchdog(replace(p.rut, speech_s=p.rut.speech_s + lag,
                                          window_s=p.rut.window_s + lag) if lag else p.rut)
        self._noise = DitherNoise(p.dither_lsb)
        self._stall = asr_threshold(p.stall_s, p.stall_max_s)
        self._out_q: asyncio.Queue[tuple[Generation, TranscriptDelta | BaseException | None]] = (
            asyncio.Queue()
        )
        self._cur: Generation | None = None
        self._next: Generation | None = None
        self._switch_at: float | None = None  # T, stream seconds
        self._gens = 0
        self.pos: int | None = None  # next stream sample position to feed
        self._last_arrival = 0.0
        self._arrival_pos = 0
        self._pause_run = 0
        self._pause_start = 0
        self._best_pause = (0, 0)  # (length, start) of the longest pause since rollover began
        self._rut_pending = False
        self._stalled = False
        self._retry_at = 0.0
        self._open_failures = 0
        self._warm_retry_at = 0.0
        self._cut_s = 0.0
        self._resume_cut_s: float | None = None  # where the last replacement resumed
        self._dropped_seen = 0
        self._speech_runs = SpeechRuns()  # for the lag gauge
        self._seam = Seam()  # between two sessions: the old one's last words, for dedupe
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.gauges: dict[str, float] = {}
        self.rollover_log: list[tuple[str, float]] = []  # (reason, switch time in stream s)

    # ---- generations -------------------------------------------------------
    def _open(self, reason: str, start_pos: int) -> Generation:
        session = self.engine.open_session(self.options)
        self._gens += 1
        gen = Generation(self._gens, session, reason, start_pos, self._jittered_budget(self._gens))
        gen.task = asyncio.create_task(gen.pump(self._out_q),
                                       name=f"gen{gen.n}:{self.options.stream_id}")
        self.counters["sessions_opened"] += 1
        return gen

    def _jittered_budget(self, n: int) -> float | None:
        return jittered_budget(self.budget_s, self.policy, self.options.stream_id, n)

    def _open_failed(self, exc: Exception, what: str) -> None:
        """Count it; back off (doubling, capped) so a dead engine is no busy loop."""
        self.counters["session_open_failures"] += 1
        self._open_failures += 1
        if self._open_failures == 1 or self._open_failures % 30 == 0:
            log.warning("stream %s: cannot open %s: %s (retryable=%s)", self.options.stream_id,
                        what, type(exc).__name__,
                        getattr(exc, "retryable", True))
        if isinstance(exc, EngineError) and not exc.retryable:
            self.gauges["engine_dead"] = 1.0

    def _backoff_s(self) -> float:
        p = self.policy
        return float(min(p.max_backoff_s,
                         p.restart_backoff_s * 2.0 ** max(0, self._open_failures - 1)))

    @staticmethod
    async def _close(gen: Generation | None) -> None:
        if gen is not None:
            await gen.close()

    async def _feed(self, gen: Generation, chunk: AudioChunk) -> None:
        gen.fed += chunk.samples
        before = gen.session.dropped_samples
        await gen.session.push(chunk)
        if gen.session.dropped_samples > before:
            self._queue_dropped(gen.session.dropped_samples - before)

    def _queue_dropped(self, samples: int) -> None:
        """A session's input queue (or this manager's) was full and dropped its oldest
        audio: the backlog policy's bound (INPUT_QUEUE_MAX, ~60 s). Counted, and said."""
        if not self.counters["skipped_s_queue_full"]:
            log.warning("stream %s: more than ~%.0f s of audio waiting for recognition; "
                        "dropping the oldest (the actor carries more than it can)",
                        self.options.stream_id, BACKLOG_S - 5)
        self.counters["skipped_s_queue_full"] += samples / SAMPLE_RATE

    # ---- output ------------------------------------------------------------
    async def _emit_from(self, gen: Generation, delta: TranscriptDelta) -> None:
        committed = gen.accepted(delta.committed)
        tentative = gen.accepted(delta.tentative)
        committed, repeated = self._seam.cross(gen, committed)
        if repeated:
            self.counters["seam_words_deduped"] += repeated
        if committed:
            gen.took(committed)
        chars = sum(len(w.text.strip()) for w in committed + tentative)
        if chars and self.pos is not None:
            # Stamped with the audio the text is for: a session behind its audio writes
            # now for speech it heard a while ago.
            heard = gen.session.heard_until
            self._watch.text(self.pos if heard is None else min(heard, self.pos), chars)
            if self._rut_pending:
                self._rut_pending = False
                self.counters["rut_recoveries"] += 1
        if committed or tentative or delta.end_of_utterance:
            await self._emit(TranscriptDelta(committed, tentative, delta.end_of_utterance,
                                             delta.language))

    async def _on_output(self, gen: Generation,
                         item: TranscriptDelta | BaseException | None) -> None:
        if gen.ended:
            return
        if gen is self._next:
            if isinstance(item, TranscriptDelta):
                gen.held.append(item)
            else:
                # The warming session died before the switch: drop it, retry later.
                self.counters["rollover_failures"] += 1
                self._next = None
                self._switch_at = None
                await self._close(gen)
            return
        if gen is not self._cur:
            return
        if isinstance(item, TranscriptDelta):
            await self._emit_from(gen, item)
            return
        if item is None and self._next is not None and self._switch_at is not None:
            await self._promote()  # the old session flushed up to T and ended
            return
        reason = "engine_error" if isinstance(item, BaseException) else "budget"
        if isinstance(item, BaseException):
            log.warning("stream %s: session failed (%s); replacing it", self.options.stream_id,
                        type(item).__name__)
        await self._replace_now(reason)

    async def _promote(self) -> None:
        old, new = self._cur, self._next
        assert old is not None and new is not None and self._switch_at is not None
        await self._close(old)
        self._seam.start(old, new)
        # A forced switch may pick a pause the old session had already captioned past
        # (it published words starting after T before T was chosen): those stay, and
        # the new session takes over after them. Otherwise the seam is T itself.
        past = old.last_start_s >= self._switch_at
        new.accept_from_s = max(self._switch_at, old.last_end_s) if past else self._switch_at
        self._cur, self._next = new, None
        self.counters[f"rollovers_{new.reason}"] += 1
        self.rollover_log.append((new.reason, self._switch_at))
        self._switch_at = None
        self._watch.reset()
        held, new.held = new.held, []
        for delta in held:
            await self._emit_from(new, delta)

    async def _replace_now(self, reason: str) -> None:
        """Switch to a new session immediately (rut, error, ended, gap), resuming where
        the old one's committed words end."""
        old = self._cur
        await self._close(self._next)
        self._next = None
        self._switch_at = None
        if old is not None:
            await self._close(old)
            # Whatever the old session had tentatively on screen is not confirmed:
            # close the open caption on its committed words.
            await self._emit(TranscriptDelta(end_of_utterance=True))
        cut = max(old.last_end_s, old.accept_from_s) if old is not None else self._cut_s
        if reason == "shed" and self.pos is not None:
            # Skip to the live edge: what lies between is said to be skipped, in seconds.
            live_s = (self.pos - SHED_LEAD_S * SAMPLE_RATE) / SAMPLE_RATE
            if live_s > cut:
                self.counters["skipped_s_shed"] += live_s - cut
                log.warning("stream %s: %.1f s behind; skipped %.1f s to the live edge "
                            "(shed_after_s)", self.options.stream_id,
                            self.gauges.get("caption_lag_s", 0.0), live_s - cut)
                await self._emit(TranscriptDelta(skipped=(round(cut, 3), round(live_s, 3))))
                cut = live_s
        self._cut_s = cut
        if reason == "engine_error" and old is not None:
            # A session that fails at once must not become a busy loop.
            await asyncio.sleep(self.policy.restart_backoff_s)
        try:
            new = self._open(reason, self.pos or 0)
        except Exception as exc:
            self._open_failed(exc, "a session")
            self._cur = None
            self._retry_at = self._clock() + self._backoff_s()
            return
        self._open_failures = 0
        self.gauges.pop("engine_dead", None)
        if old is not None:
            self._seam.start(old, new)
        new.accept_from_s = cut
        self._cur = new
        self.counters[f"rollovers_{reason}"] += 1
        self.rollover_log.append((reason, cut))
        if reason == "rut":
            self._rut_pending = True
        start = None if self.pos is None else self._resume_pos(reason, cut)
        self._watch.reset()
        if start is not None:
            for chunk in self._ring.replay(start):
                await self._feed(new, chunk)

    def _resume_pos(self, reason: str, cut_s: float) -> int:
        """Where a replacement starts reading: a little before `cut_s` (a word cut there
        is heard whole; words before it are not accepted again), never later than a warm
        rollover's overlap before the newest audio."""
        assert self.pos is not None
        if reason == "shed":  # at the live edge, with as little re-read as a word needs
            return max(self._ring.start_pos or 0, int((cut_s - 0.5) * SAMPLE_RATE))
        live = self.pos - int(self.policy.overlap_s * SAMPLE_RATE)
        want = min(live, int((cut_s - 1.0) * SAMPLE_RATE))
        skip_to, why = want, ""
        if self._resume_cut_s is not None and cut_s <= self._resume_cut_s:
            # No word since the last replacement resumed there: reading the same audio
            # again would only end the same way (a rut that sticks, a budget the replay
            # alone fills); go on from the recent past.
            back = self.policy.rut.window_s if reason == "rut" else self.policy.overlap_s
            skip_to, why = max(want, self.pos - int(back * SAMPLE_RATE)), "no word since"
        budget = self._cur.budget_s if self._cur is not None else None
        if budget is not None and self.pos - skip_to > budget / 2 * SAMPLE_RATE:
            # The replay must leave the new session room to catch up within its budget.
            skip_to, why = self.pos - int(budget / 2 * SAMPLE_RATE), "past half a budget"
        self._resume_cut_s = cut_s
        oldest = self._ring.start_pos
        if oldest is not None and oldest > skip_to:
            skip_to, why = oldest, "older than the ring"
        # Only speech counts as lost: a room silent since its last word skips nothing.
        skipped = self._watch.speech_between(want, skip_to) if skip_to > want else 0.0
        if skipped > 0.05:
            self.counters["skipped_s_replacement"] += skipped
            log.warning("stream %s: %s replacement skipped %.1f s of audio (%s)",
                        self.options.stream_id, reason, skipped, why)
        return skip_to

    async def _begin_warm_rollover(self) -> None:
        assert self.pos is not None
        if self._clock() < self._warm_retry_at:
            return
        start = self.pos - int(self.policy.overlap_s * SAMPLE_RATE)
        try:
            new = self._open("budget", start)
        except Exception as exc:
            # No slot for a successor now (others are rolling over): try again shortly;
            # past the budget the session is replaced cold instead.
            self._open_failed(exc, "the next session")
            self._warm_retry_at = self._clock() + self._backoff_s()
            return
        self._open_failures = 0
        self._next = new
        self._best_pause = (0, 0)
        for chunk in self._ring.since(start):
            await self._feed(new, chunk)

    # ---- input -------------------------------------------------------------
    async def _take_audio(self, chunk: AudioChunk, *, real: bool) -> None:
        """Feed one contiguous chunk to the live session(s) and the detectors."""
        assert self.pos is not None
        flags = await self._vad.flags(chunk.pcm)
        # The VAD's frames run on across chunks: those that completed here end where the
        # samples it still holds begin (not at the chunk's end).
        carry = self._vad_carry + chunk.samples - len(flags) * FRAME_SAMPLES
        known = 0 <= carry < FRAME_SAMPLES
        self._vad_carry = carry if known else 0
        speech_end = chunk.pos + chunk.samples - self._vad_carry
        # The engine session gets these flags with the audio: Silero runs once per stream.
        chunk = replace(chunk, speech=tuple(flags), speech_end=speech_end if known else None)
        self._ring.add(chunk)
        self.pos = chunk.pos + chunk.samples
        if real:
            self._last_arrival = self._clock()
            self._arrival_pos = self.pos
        frame_pos = speech_end - len(flags) * FRAME_SAMPLES
        for speech in flags:
            if speech:
                self._watch.speech(frame_pos, FRAME_SAMPLES)
                self._speech_runs.add(frame_pos)
                self._pause_run = 0
            else:
                if self._pause_run == 0:
                    self._pause_start = frame_pos
                self._pause_run += FRAME_SAMPLES
                if self._next is not None and self._pause_run > self._best_pause[0]:
                    self._best_pause = (self._pause_run, self._pause_start)
            frame_pos += FRAME_SAMPLES
        self.gauges["voiced_without_text_s"] = round(self._watch.voiced_without_text_s, 2)
        self._speech_runs.forget(self.pos)
        # After T is chosen the old session only flushes; it gets no more audio.
        cur = self._cur if self._switch_at is None else None
        for gen in (cur, self._next):
            if gen is not None:
                await self._feed(gen, chunk)
        await self._after_audio()

    def _update_lag(self) -> None:
        cur = self._cur
        heard = None if cur is None else cur.session.heard_until
        if heard is None or self.pos is None:
            self.gauges.pop("caption_lag_s", None)
            return
        self.gauges["caption_lag_s"] = round(self._speech_runs.lag_s(heard, self.pos), 2)

    async def _after_audio(self) -> None:
        assert self.pos is not None
        self._update_lag()
        shed = self.policy.shed_after_s
        # A session gets `shed` seconds of audio before it may be shed again: one that
        # started at the live edge has had no time to write anything yet.
        if (shed is not None and self._cur is not None and self._next is None
                and self.gauges.get("caption_lag_s", 0.0) > shed
                and self._cur.fed >= shed * SAMPLE_RATE):
            await self._replace_now("shed")
            return
        cur = self._cur
        if cur is None:
            if self._clock() >= self._retry_at:
                await self._replace_now("engine_error")
            return
        heard = cur.session.heard_until
        if self._next is None and (self._watch.in_rut(heard) or self._watch.deaf(heard)):
            self.counters["ruts_detected"] += 1
            await self._replace_now("rut")
            return
        budget = cur.budget_s
        if budget is None:
            return
        age = cur.fed / SAMPLE_RATE
        if self._next is None and age >= budget - self.policy.margin_s:
            await self._begin_warm_rollover()
            if self._next is None and age >= budget:
                # No successor could be warmed in time: replace it cold, never pass
                # the engine's limit.
                self.counters["cold_rollovers"] += 1
                await self._replace_now("budget")
                return
        nxt = self._next
        if nxt is None or self._switch_at is not None:
            return
        in_pause = self._pause_run >= int(self.policy.switch_pause_s * SAMPLE_RATE)
        warmed = self._pause_start >= nxt.start_pos + int(self.policy.overlap_s * SAMPLE_RATE)
        if in_pause and warmed:
            t = (self._pause_start + self._pause_run // 2) / SAMPLE_RATE
        elif age >= budget:
            # No pause as long as wanted before the budget ran out: take the longest gap
            # between words since the rollover began (both sessions have passed it).
            length, start = self._best_pause
            if length:
                t = (start + length // 2) / SAMPLE_RATE
            else:
                t = self.pos / SAMPLE_RATE
            self.counters["forced_switches"] += 1
        else:
            return
        self._switch_at = t
        cur.accept_until_s = t
        await cur.session.end_input()  # it flushes its words up to T, then ends

    async def _fill(self, upto: int) -> None:
        """Dithered noise from self.pos up to `upto`, in ≤100 ms chunks."""
        assert self.pos is not None
        filled = 0
        while self.pos < upto:
            n = min(upto - self.pos, SAMPLE_RATE // 10)
            await self._take_audio(
                self._noise.chunk(self.options.stream_id, self.pos, n, time.time()), real=False
            )
            filled += n
        if filled:
            self.counters["gap_fill_s"] += filled / SAMPLE_RATE

    async def _on_chunk(self, chunk: AudioChunk) -> None:
        self._stall.arrival(self._clock())
        self.gauges["source_silent_s"] = 0.0
        if self.pos is None:
            self.pos = chunk.pos
            self._arrival_pos = chunk.pos
        if chunk.pos > self.pos:
            hole = chunk.pos - self.pos
            self.counters["gaps"] += 1
            if hole > self.policy.max_fill_s * SAMPLE_RATE:
                self.pos = chunk.pos
                self._ring.clear()
                await self._replace_now("gap")
            else:
                await self._fill(chunk.pos)
        elif chunk.pos < self.pos:
            # Late audio for time already filled with noise: keep only the new part.
            late = self.pos - chunk.pos
            self.counters["late_audio_dropped_s"] += min(late, chunk.samples) / SAMPLE_RATE
            if late >= chunk.samples:
                self._last_arrival = self._clock()
                return
            chunk = AudioChunk(chunk.stream, self.pos, chunk.pcm[late * 2 :], chunk.wall)
        await self._take_audio(chunk, real=True)

    async def _on_tick(self) -> None:
        if self.pos is None:
            return
        now = self._clock()
        stalled = now - self._last_arrival
        threshold = self._stall.threshold_s(now)
        self.gauges["stall_threshold_s"] = round(threshold, 2)
        # Seconds fed only filler so far: the room's status says "source lost" while > 0.
        self.gauges["source_silent_s"] = round(stalled, 1) if stalled > threshold else 0.0
        if stalled > threshold:
            # Keep the engine at wall-clock pace, `threshold` behind: a chunk that is
            # merely late by less than that is never overtaken by noise.
            target = self._arrival_pos + int((stalled - threshold) * SAMPLE_RATE)
            if target > self.pos:
                if not self._stalled:
                    self._stalled = True
                    self.counters["stalls"] += 1
                await self._fill(target)

    # ---- main loop ---------------------------------------------------------
    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        self._cur = self._open("start", 0)
        get_in: asyncio.Task[SessionInput] = asyncio.create_task(inputs.get())
        get_out = asyncio.create_task(self._out_q.get())
        try:
            while True:
                done, _ = await asyncio.wait(
                    {get_in, get_out}, timeout=self.policy.tick_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if get_out in done:
                    gen, item = get_out.result()
                    get_out = asyncio.create_task(self._out_q.get())
                    await self._on_output(gen, item)
                if get_in in done:
                    item_in = get_in.result()
                    if item_in is END:
                        # The pending output getter would take items _finish waits for.
                        if get_out.done():
                            gen, item = get_out.result()
                            await self._on_output(gen, item)
                        else:
                            await cancel_and_join(get_out)
                        await self._finish()
                        return
                    get_in = asyncio.create_task(inputs.get())
                    if self.dropped_samples > self._dropped_seen:  # this manager's queue
                        self._queue_dropped(self.dropped_samples - self._dropped_seen)
                        self._dropped_seen = self.dropped_samples
                    if isinstance(item_in, AudioChunk):
                        self._stalled = False
                        await self._on_chunk(item_in)
                    elif isinstance(item_in, AudioGap):
                        self.counters["source_gaps"] += 1
                else:
                    await self._on_tick()
        finally:
            for t in (get_in, get_out):
                t.cancel()
            await self._close(self._next)
            await self._close(self._cur)
            self._vad.close()

    async def _finish(self) -> None:
        """End of input: let the current session flush, forward its last words."""
        await self._close(self._next)
        self._next = None
        cur = self._cur
        if cur is None:
            return
        await cur.session.end_input()
        while True:
            gen, item = await self._out_q.get()
            if gen is not cur:
                continue
            if not isinstance(item, TranscriptDelta):
                return
            await self._emit_from(cur, item)
