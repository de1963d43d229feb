"""The engine seam: `SpeechEngine` holds a model, `RecognizeSession` holds one stream.

A session is fed with `push()` (audio chunks, in order) and `gap()`; its output
is an async iterator of `TranscriptDelta`s. `end_input()` asks for the last
words; `aclose()` drops everything. The base class owns the queues, the task
and its cancellation; an implementation writes `_run()` only.

Callers branch on `EngineCapabilities`, never on the concrete class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from workers.aio import cancel_and_join, cancel_and_wait
from workers.events import SAMPLE_RATE, AudioChunk, AudioGap, TranscriptDelta, Word

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What the session manager needs to know about an engine.

    `max_session_s`: audio seconds one session can take before the engine ends it
    (None: unbounded). `reanchors_natively`: the engine keeps long sessions going
    by itself, no rollover needed. `multilingual`: whether `language="auto"` works.
    `text_lag_s`: how much speech the engine may hear before it sends any text (0: it
    sends text as it decodes); the rut watchdog waits that much longer.
    """

    max_session_s: float | None
    reanchors_natively: bool
    multilingual: bool
    streaming: bool = True
    text_lag_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SessionOptions:
    stream_id: str
    language: str = "auto"


class EngineError(RuntimeError):
    """An engine or session failed. `retryable`: a new session may succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class _End:
    """Marks the end of a session's input."""


END = _End()
SessionInput = AudioChunk | AudioGap | _End

INPUT_QUEUE_MAX = 600
"""≈ 60 s of 100 ms chunks. When full, the oldest chunk is dropped and a gap is recorded."""


class RecognizeSession(ABC):
    """One stream's recognition state inside an engine."""

    def __init__(self, options: SessionOptions) -> None:
        self.options = options
        self._in: asyncio.Queue[SessionInput] = asyncio.Queue(maxsize=INPUT_QUEUE_MAX)
        self._out: asyncio.Queue[TranscriptDelta | BaseException | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.dropped_chunks = 0
        self.dropped_samples = 0  # audio dropped from a full input queue (never heard)
        self._heard_until: int | None = None

    @property
    def heard_until(self) -> int | None:
        """Stream sample position up to which this session has run recognition over its
        audio; None: the session does not say. The rut watchdog judges only speech the
        session has heard, so a session that lags behind a busy engine is not mistaken
        for one that hears speech and writes nothing."""
        return self._heard_until

    def _heard(self, pos: int) -> None:
        self._heard_until = pos if self._heard_until is None else max(self._heard_until, pos)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._main(), name=f"session:{self.options.stream_id}")

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the session's task has ended, however it ended."""
        assert self._task is not None, "start() first"
        self._task.add_done_callback(lambda _task: callback())

    async def push(self, item: AudioChunk | AudioGap) -> None:
        self.push_nowait(item)

    def push_nowait(self, item: AudioChunk | AudioGap) -> None:
        if self._in.full():
            # Drop the oldest audio, never block the reader: the pos jump that the
            # drop leaves is seen by the session as a gap.
            with contextlib.suppress(asyncio.QueueEmpty):
                dropped = self._in.get_nowait()
                self.dropped_chunks += 1
                if isinstance(dropped, AudioChunk):
                    self.dropped_samples += dropped.samples
        self._in.put_nowait(item)

    async def end_input(self) -> None:
        await self._in.put(END)

    async def _main(self) -> None:
        try:
            await self._run(self._in)
            await self._out.put(None)
        except asyncio.CancelledError:
            await self._out.put(None)
            raise
        except BaseException as exc:  # surfaced to the consumer, who decides
            log.warning("session %s failed: %s", self.options.stream_id, type(exc).__name__)
            await self._out.put(exc)

    @abstractmethod
    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        """Consume inputs until END; call `self._emit()` for each delta."""

    async def _emit(self, delta: TranscriptDelta) -> None:
        await self._out.put(delta)

    async def __aiter__(self) -> AsyncIterator[TranscriptDelta]:
        while True:
            item = await self._out.get()
            if item is None:
                return
            if isinstance(item, EngineError):
                raise item  # keeps `retryable`
            if isinstance(item, BaseException):
                raise EngineError(f"session {self.options.stream_id}: {item!r}") from item
            yield item

    async def aclose(self, grace_s: float = 5.0) -> None:
        if self._task is None:
            return
        # Past grace_s the task is cancelled again and its end still awaited: a session
        # must not count as closed before its task has ended. Its engine frees the slot
        # only then, and a successor opened earlier is refused (test_session_budget's cold
        # rollovers, CI 2026-12-02). A cancel of the caller meanwhile reaches the caller
        # (under suppress(CancelledError) it was lost, and a session manager closing this
        # session went on running: workers.aio.cancel_and_join).
        if not await cancel_and_wait(self._task, grace_s):
            await cancel_and_join(self._task)
        self._task = None


class SpeechEngine(ABC):
    """Holds a model; opens sessions on it. No I/O in the constructor."""

    @property
    @abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    def open_session(self, options: SessionOptions) -> RecognizeSession: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    async def check_health(self) -> bool:
        """False once the engine cannot serve sessions any more (its actor is replaced)."""
        return True

    def stats(self) -> dict[str, float]:
        """Cumulative engine counters (e.g. busy seconds), for status and benchmarks."""
        return {}

    def describe(self) -> dict[str, str]:
        """How the engine runs (e.g. the vllm engine's mode), for status."""
        return {}


class WrappedEngine(SpeechEngine):
    """An engine that adds behaviour around another one (fault injection, recording);
    everything but `open_session` is the inner engine's."""

    def __init__(self, inner: SpeechEngine) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def check_health(self) -> bool:
        return await self.inner.check_health()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def describe(self) -> dict[str, str]:
        return self.inner.describe()


class DelayedTextStamps:
    """Audio times for text from engines whose protocol carries no timestamps (vLLM's
    realtime outputs, /v1/realtime deltas): a piece belongs to the audio that was fed
    `delay_s` before it arrived. Pieces never go back in time."""

    def __init__(self, delay_s: float, first_piece_s: float) -> None:
        self.delay_s = delay_s
        self.first_piece_s = first_piece_s
        self.fed_end = 0  # stream sample position after the last audio fed
        self._last_end = 0.0

    def fed(self, chunk: AudioChunk) -> None:
        self.fed_end = chunk.pos + chunk.samples

    def word(self, text: str) -> Word:
        end = max(self._last_end, self.fed_end / SAMPLE_RATE - self.delay_s)
        start = self._last_end or max(0.0, end - self.first_piece_s)
        self._last_end = end
        return Word(text, start, end)
