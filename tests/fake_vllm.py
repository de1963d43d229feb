"""FAKE vLLM backend for the `vllm` engine's CPU tests (vLLM cannot run here).

It implements the same async API as the real AsyncLLM backend and behaves like Voxtral
Realtime's audio buffer where the engine's session logic depends on it: a background
task drains the session's audio generator as eagerly as the real buffer does (so a
session that hands over too much audio shows it in `max_ahead`), the first prompt needs
`first` frames of real audio, each later prompt one more frame and the previous
output's tokens fed back; one output per prompt; after the audio ends, `right_pad`
more outputs (the real buffer's right padding). Every `text_every`-th output carries
the text " w<k>" where k is the output's index, so tests can tell which output a word
came from.

Started by the engine through a backend factory (`VllmVoxtralEngine(...,
backend_factory=...)`), it answers the start checks (workers/engines/vllm/checks.py) with
what a test tells it: its `version`, whether the plugin was asked for, the plugin worker's
probe, the direct-input check's report. Those answers are scripted: they stand in for what
only the GPU can measure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FRAME = 1280


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class Output:
    outputs: list[Completion]


@dataclass
class FakeVllmBackend:
    first: int = 7
    right_pad: int = 3
    text_every: int = 5
    fail_after: int | None = None
    error_after: int | None = None
    """The next request gets, after this many outputs, what vLLM 0.26 gives a streaming
    request its engine core finished in error: an output with finish_reason "error" —
    and then nothing, its generator open (the output processor keeps a streaming-input
    request open until its input ends or it is aborted); once: later requests run
    normally."""
    shutdown_block_s: float = 0.0
    errored: bool = False
    aborted: list[str] = field(default_factory=list)
    requests: list[tuple[str, int | None]] = field(default_factory=list)
    fed_back: int = 0
    max_ahead: int = 0
    """Most samples the buffer held beyond what its next prompt needed."""
    handed_at: list[tuple[int, float]] = field(default_factory=list)
    """(session, time.monotonic()) of every audio array a session handed to the buffer;
    sessions numbered in the order their prompts began."""
    prompt_calls: int = 0
    shutdowns: int = 0
    stats: dict[str, Any] | None = None
    direct_sessions: int = 0
    version: str = ""
    """vllm.__version__ as the real backend reports it ("": none, an injected fake)."""
    reanchor_requested: bool = False
    probe_answer: dict[str, Any] | Exception = field(
        default_factory=lambda: {"supported": False, "why_not": "fake: no plugin worker"})
    """The plugin worker's probe (`babelcast_reanchor_probe`), or what asking it raises."""

    gather_asked: list[float] = field(default_factory=list)
    """Every window `set_tick_gather` was asked for, in ms."""
    gather_answer: dict[str, Any] | Exception | None = None
    """What `set_tick_gather` answers or raises; None: the worker's own answer."""
    direct_answer: dict[str, Any] | Exception = field(
        default_factory=lambda: {"prompts": 30, "equal": True, "mismatches": []})
    """direct.check_equal_async's report (its keys), or what running it raises."""
    direct_checks: int = 0
    direct_check_s: float = 0.0
    """How long the direct-input check takes to answer (a hung renderer: long)."""

    async def check_direct(self) -> dict[str, Any]:
        self.direct_checks += 1
        await asyncio.sleep(self.direct_check_s)
        if isinstance(self.direct_answer, Exception):
            raise self.direct_answer
        return dict(self.direct_answer)

    async def probe(self) -> dict[str, Any]:
        if isinstance(self.probe_answer, Exception):
            raise self.probe_answer
        return dict(self.probe_answer)

    def direct_prompts(self, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        """The real one builds the same inputs another way (checked on the GPU machine,
        workers/engines/vllm/direct.py); here: counted, then the same buffer."""
        self.direct_sessions += 1
        return self.prompts(audio, tokens)

    async def prompts(self, audio: AsyncIterator[np.ndarray],
                      tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        q: asyncio.Queue[int | None] = asyncio.Queue()
        me = self.prompt_calls
        self.prompt_calls += 1
        drained = consumed = 0
        need = self.first * FRAME

        async def drain() -> None:  # the real buffer's feed_audio task: as eager as it is
            nonlocal drained
            async for a in audio:
                self.handed_at.append((me, time.monotonic()))
                drained += int(a.size)
                self.max_ahead = max(self.max_ahead, drained - consumed - need)
                q.put_nowait(int(a.size))
            q.put_nowait(None)

        task = asyncio.create_task(drain())
        try:
            buffered, n = 0, 0
            ended = False
            while True:
                while not ended and buffered < need:
                    size = await q.get()
                    if size is None:
                        ended = True
                        break
                    buffered += size
                if ended and buffered < need:
                    break
                if n:
                    await asyncio.wait_for(tokens.get(), 5)
                    self.fed_back += 1
                buffered -= need
                consumed += need
                need = FRAME
                n += 1
                yield n
            for _ in range(self.right_pad):
                await asyncio.wait_for(tokens.get(), 5)
                self.fed_back += 1
                n += 1
                yield n
        finally:
            task.cancel()

    async def generate(self, prompts: AsyncIterator[Any], request_id: str,
                       reanchor_every: int | None) -> AsyncIterator[Any]:
        self.requests.append((request_id, reanchor_every))
        k = 0
        async for _ in prompts:
            if self.fail_after is not None and k >= self.fail_after:
                raise RuntimeError("fake engine failure")
            if self.error_after is not None and k >= self.error_after:
                self.error_after = None
                yield Output([Completion([], "", "error")])
                await asyncio.Event().wait()  # open, as vLLM's: until closed or cancelled
            text = f" w{k}" if (k + 1) % self.text_every == 0 else ""
            yield Output([Completion([32], text)])
            k += 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def reanchor_stats(self) -> dict[str, Any] | None:
        return self.stats

    async def set_tick_gather(self, window_ms: float) -> dict[str, Any]:
        """The plugin worker's answer (reanchor/gather.py `TickGather.switch`'s keys), or
        `gather_answer` where the test scripts a refusal; the FAKE has no engine core to
        hold steps in: what holding does is measured on a GPU (bench/results/gather_h100)."""
        self.gather_asked.append(window_ms)
        if isinstance(self.gather_answer, Exception):
            raise self.gather_answer
        return self.gather_answer or {"on": window_ms > 0, "window_ms": window_ms}

    def shutdown(self) -> None:
        self.shutdowns += 1
        time.sleep(self.shutdown_block_s)  # AsyncLLM.shutdown() blocks like this


async def started_health(engine: Any) -> dict[str, str]:
    """Start an engine (over a fake backend), say what its health would, close it."""
    await engine.start()
    try:
        return dict(engine.describe())
    finally:
        await engine.aclose()
