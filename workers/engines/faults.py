"""FAULT INJECTION — test and benchmark tooling only, never configured by an event file.

Wrappers around a real engine whose sessions misbehave on cue, so the session
manager's recovery can be exercised with real speech through a real model:
- `MuteAfterEngine`: each session works normally for its first `after_s` seconds of
  audio, then goes mute (emits nothing, or only empty "blank" deltas) while it keeps
  consuming audio — what a realtime model in a "blank rut" looks like from outside.
- `RaisingEngine`: each session raises after `after_s` seconds of audio.
A fresh session starts healthy again, as a real engine's new session would; with
`sessions=N` only the first N sessions misbehave.
- `SlowEngine`: while `slow` is set, every session takes `slowdown` times real time
  to get through its audio (each chunk is held back that long before the real session
  sees it), so its captions fall further behind the live edge the longer it runs —
  what an engine on a saturated GPU looks like from outside, which a CPU-only test
  cannot produce for real. A new session is as slow (the GPU is still saturated):
  only moving the stream to another actor helps.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from workers.engines.base import (
    END,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
    WrappedEngine,
)
from workers.events import SAMPLE_RATE, AudioChunk, AudioGap, TranscriptDelta


class InjectedFault(RuntimeError):
    """Raised by RaisingEngine's sessions on purpose."""


class _PassThroughSession(RecognizeSession):
    """Feeds an inner session and re-emits its deltas; subclasses act on each input item
    (`_on_item`) and each delta (`_on_delta`)."""

    def __init__(self, inner: RecognizeSession, options: SessionOptions) -> None:
        super().__init__(options)
        self.inner = inner

    @property
    def heard_until(self) -> int | None:
        return self.inner.heard_until

    async def _on_item(self, item: AudioChunk | AudioGap) -> None:
        """Before `item` reaches the inner session."""

    async def _on_delta(self, delta: TranscriptDelta) -> None:
        await self._emit(delta)

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        forward = asyncio.create_task(self._forward())
        try:
            while True:
                item = await inputs.get()
                if item is END:
                    await self.inner.end_input()
                    await forward
                    return
                assert isinstance(item, (AudioChunk, AudioGap))
                await self._on_item(item)
                await self.inner.push(item)
        finally:
            forward.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await forward
            await self.inner.aclose()

    async def _forward(self) -> None:
        async for delta in self.inner:
            await self._on_delta(delta)


class _FaultySession(_PassThroughSession):
    def __init__(self, inner: RecognizeSession, options: SessionOptions, after_s: float,
                 kind: Literal["mute", "blank", "raise"]) -> None:
        super().__init__(inner, options)
        self.after = int(after_s * SAMPLE_RATE)
        self.kind = kind
        self.fed = 0

    @property
    def faulty(self) -> bool:
        return self.fed >= self.after

    async def _on_item(self, item: AudioChunk | AudioGap) -> None:
        if isinstance(item, AudioChunk):
            self.fed += item.samples
            if self.kind == "raise" and self.faulty:
                raise InjectedFault(f"injected failure after {self.after} samples")

    async def _on_delta(self, delta: TranscriptDelta) -> None:
        if not self.faulty:
            await self._emit(delta)
        elif self.kind == "blank":
            await self._emit(TranscriptDelta(language=delta.language))


class _FaultyEngine(WrappedEngine):
    kind: Literal["mute", "blank", "raise"] = "mute"

    def __init__(self, inner: SpeechEngine, after_s: float, sessions: int | None = None) -> None:
        super().__init__(inner)
        self.after_s = after_s
        self.faulty_sessions = sessions
        self.sessions_opened = 0

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        self.sessions_opened += 1
        if self.faulty_sessions is not None and self.sessions_opened > self.faulty_sessions:
            return self.inner.open_session(options)  # the fault has passed
        session = _FaultySession(self.inner.open_session(options), options, self.after_s,
                                 self.kind)
        session.start()
        return session


class MuteAfterEngine(_FaultyEngine):
    def __init__(self, inner: SpeechEngine, after_s: float, *, blanks: bool = False,
                 sessions: int | None = None) -> None:
        super().__init__(inner, after_s, sessions)
        self.kind = "blank" if blanks else "mute"


class RaisingEngine(_FaultyEngine):
    kind = "raise"


class _SlowSession(_PassThroughSession):
    def __init__(self, inner: RecognizeSession, options: SessionOptions,
                 engine: SlowEngine) -> None:
        super().__init__(inner, options)
        self.engine = engine

    async def _on_item(self, item: AudioChunk | AudioGap) -> None:
        if isinstance(item, AudioChunk) and self.engine.slow:
            await asyncio.sleep(self.engine.slowdown * item.samples / SAMPLE_RATE)


class SlowEngine(WrappedEngine):
    def __init__(self, inner: SpeechEngine, slowdown: float, *, slow: bool = True) -> None:
        if slowdown <= 1.0:
            raise ValueError(f"slowdown must be above 1 (times real time), got {slowdown}")
        super().__init__(inner)
        self.slowdown = slowdown
        self.slow = slow

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = _SlowSession(self.inner.open_session(options), options, self)
        session.start()
        return session
