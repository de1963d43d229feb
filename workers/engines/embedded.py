"""The embedded CPU engine: faster-whisper on one decode thread, shared by its sessions.

`EmbeddedWhisperEngine` loads the model and decodes for every `EmbeddedWhisperSession`
it opens (`workers.engines.embedded_session`: the streaming policy) on one thread: on a
2-core machine two concurrent decodes only slow each other down. `DecodeGate` lets finals
go before interims, `BusyLog` says how much headroom the thread had (`final_beam()`), and
with `calibrate` the engine measures at start how many streams it keeps in real time
here (`workers.engines.calibrate`). The options are `workers.engines.embedded_options`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.engines.base import (
    EngineCapabilities,
    EngineError,
    RecognizeSession,
    SessionOptions,
    SpeechEngine,
)
from workers.engines.calibrate import Calibration, calibration
from workers.engines.embedded_options import FINAL_PASSES, EmbeddedEngineOptions, FinalPass
from workers.engines.embedded_session import EmbeddedWhisperSession
from workers.engines.models import load_whisper, model_info
from workers.events import SAMPLE_RATE, Word

# The options and the session are imported from here too (the engine's public face).
__all__ = ["BUSY_WINDOW_S", "FINAL_PASSES", "MIN_ENCODE_FRAMES", "BusyLog", "DecodeGate",
           "DecodeStats", "EmbeddedEngineOptions", "EmbeddedWhisperEngine",
           "EmbeddedWhisperSession", "FinalPass"]

MIN_ENCODE_FRAMES = 1000  # 10 s of mel frames; shorter windows cost accuracy
# `language: auto`: a detection counts only at this probability. Whisper base on 0.5–2 s of
# Italian said 'es' 0.45, 'el' 0.35–0.43, 'en' 0.32, while every confident answer (≥ 0.68)
# was right (tests/test_languages.py's prompts, 24 windows)
LANGUAGE_MIN_P = 0.5
MAX_TOKENS_PER_S = 8.0  # fast speech is ~4-5 tokens/s (timestamps included)
BUSY_WINDOW_S = 20.0
"""Headroom for beam search is judged over this much wall time: long enough to hold
several utterances of every stream (a lone final must not flip the choice), short
enough to follow a stream that joins."""


@dataclass(slots=True)
class DecodeStats:
    calls: int = 0
    audio_s: float = 0.0
    busy_s: float = 0.0
    final_beam_calls: int = 0
    """Final passes decoded with `final_beam_size` > 1."""
    final_greedy_calls: int = 0
    """Final passes decoded greedily (beam off, or no headroom for it)."""
    final_early_used: int = 0
    """Final passes started before their pause was whole (`final_early_s`), committed."""
    final_early_dropped: int = 0
    """... and dropped: speech came back before the pause was whole (a decode spent)."""


class BusyLog:
    """How busy the decode thread was over the last `window_s` of (monotonic) time."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()  # (start, end)

    def add(self, start: float, end: float) -> None:
        self._spans.append((start, end))

    def fraction(self, now: float) -> float:
        since = now - self.window_s
        while self._spans and self._spans[0][1] <= since:
            self._spans.popleft()
        busy = sum(end - max(start, since) for start, end in self._spans)
        return min(1.0, busy / self.window_s)


class DecodeGate:
    """One decode at a time on the engine's thread, finals before interims.

    The sessions of an actor share one decode thread. In arrival order a final (the
    decode a reader waits for) could queue behind every other stream's interim; here it
    goes next. Equal priorities keep their arrival order, so no interim waits forever
    while finals keep coming from at most one pause per stream."""

    FINAL, INTERIM = 0, 1

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed the thread just as it was cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                return
        self._busy = False


class EmbeddedWhisperEngine(SpeechEngine):
    def __init__(self, options: EmbeddedEngineOptions) -> None:
        self.options = options
        self._info = model_info(options.model)
        self._model: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._stats = DecodeStats()
        self._gate = DecodeGate()
        self._busy = BusyLog()
        self.calibration: Calibration | None = None
        self.calibration_stats = DecodeStats()
        """What the measurement at start decoded (nothing where the figure was cached)."""

    @property
    def capabilities(self) -> EngineCapabilities:
        # Whisper re-reads a bounded window: a session has no length limit.
        return EngineCapabilities(
            max_session_s=None, reanchors_natively=True, multilingual=self._info.multilingual
        )

    async def start(self) -> None:
        if self._pool is not None:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whisper")
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(
            self._pool,
            lambda: load_whisper(self.options.model, cpu_threads=self.options.cpu_threads),
        )
        if self.options.calibrate:
            self.calibration = await calibration(self)
            # The measurement's decodes are not the streams' work: the stats and the
            # busy history (final_beam_max_busy's headroom) start from here.
            self.calibration_stats, self._stats = self._stats, DecodeStats()
            self._busy = BusyLog()

    def describe(self) -> dict[str, str]:
        return self.calibration.status() if self.calibration is not None else {}

    def stats(self) -> dict[str, float]:
        return {
            "decode_calls": self._stats.calls,
            "decode_audio_s": round(self._stats.audio_s, 3),
            "decode_busy_s": round(self._stats.busy_s, 3),
            "decode_busy_fraction": round(self._busy.fraction(time.monotonic()), 3),
            "final_beam_calls": self._stats.final_beam_calls,
            "final_greedy_calls": self._stats.final_greedy_calls,
            "final_early_used": self._stats.final_early_used,
            "final_early_dropped": self._stats.final_early_dropped,
        }

    def early_final(self, used: bool) -> None:
        if used:
            self._stats.final_early_used += 1
        else:
            self._stats.final_early_dropped += 1

    def final_beam(self) -> int:
        """The beam of the next final pass: `final_beam_size` while the decode thread has
        the headroom `final_beam_max_busy` asks for, else greedy."""
        o = self.options
        beam = o.final_beam_size
        if beam > 1 and o.final_beam_max_busy is not None and (
                self._busy.fraction(time.monotonic()) > o.final_beam_max_busy):
            beam = 1
        if beam > 1:
            self._stats.final_beam_calls += 1
        else:
            self._stats.final_greedy_calls += 1
        return beam

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._model = None

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        if self._model is None:
            raise EngineError("engine not started", retryable=False)
        if options.language not in ("auto", "en") and not self._info.multilingual:
            raise EngineError(
                f"model {self.options.model} is English-only; stream "
                f"{options.stream_id!r} declares language {options.language!r}",
                retryable=False,
            )
        session = EmbeddedWhisperSession(self, options)
        session.start()
        return session

    async def decode(
        self, audio: np.ndarray, offset_s: float, language: str | None, beam: int,
        final: bool = False, prompt: str | None = None,
    ) -> tuple[list[Word], list[float], str | None]:
        """Words (absolute times), each word's probability, and the detected language.
        `final`: a final pass (Whisper's `final_encode_s` input, ahead of interims).
        `prompt`: text said before the audio (Whisper's `initial_prompt`)."""
        if self._pool is None:
            raise EngineError("engine closed")
        loop = asyncio.get_running_loop()
        min_encode_frames = round(self.options.final_encode_s * 100) if final else (
            MIN_ENCODE_FRAMES)
        await self._gate.acquire(DecodeGate.FINAL if final else DecodeGate.INTERIM)
        try:
            pool = self._pool
            if pool is None:
                raise EngineError("engine closed")
            started = time.monotonic()
            try:
                return await loop.run_in_executor(
                    pool, self._decode_sync, audio, offset_s, language, beam, min_encode_frames,
                    prompt,
                )
            finally:
                # Kept on the loop's thread: `final_beam()` reads the log here too.
                self._busy.add(started, time.monotonic())
        finally:
            self._gate.release()

    def _decode_sync(
        self, audio: np.ndarray, offset_s: float, language: str | None, beam: int,
        min_encode_frames: int = MIN_ENCODE_FRAMES, prompt: str | None = None,
    ) -> tuple[list[Word], list[float], str | None]:
        t0 = time.perf_counter()
        # Interims pad to ≥ 10 s instead of Whisper's 30 s: 2.4x less CPU per call (see
        # models.ShortWindowWhisperModel); the final pass pads to `final_encode_s`.
        frames = max(min_encode_frames, audio.size // 160 + 100)
        self._model.encode_frames = None if frames >= 3000 else frames + frames % 2
        segments, info = self._model.transcribe(
            audio,
            language=language,
            beam_size=beam,
            word_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
            # Interims have no prompt: with windows this short Whisper base tends to
            # repeat it (WER 30 % vs 3 % without, measured); a final pass may have one
            # (`final_prompt_words`).
            initial_prompt=prompt or None,
            # No temperature fallback and a token cap: a window that sends the
            # decoder into a repetition loop must cost one bounded call, not six
            # long ones (seen: 26 s calls that stalled every stream of the engine).
            temperature=0.0,
            max_new_tokens=int(audio.size / SAMPLE_RATE * MAX_TOKENS_PER_S) + 8,
        )
        pieces = [w for seg in segments for w in (seg.words or []) if w.word.strip()]
        # Whisper's word pieces carry their leading space where the language has one, so
        # captions join them by plain concatenation.
        words = [Word(w.word, offset_s + float(w.start), offset_s + float(w.end))
                 for w in pieces]
        self._stats.calls += 1
        self._stats.audio_s += audio.size / SAMPLE_RATE
        self._stats.busy_s += time.perf_counter() - t0
        lang = getattr(info, "language", None)
        if language is None and getattr(info, "language_probability", 0.0) < LANGUAGE_MIN_P:
            lang = None  # a guess, not a detection
        return words, [float(w.probability) for w in pieces], lang

