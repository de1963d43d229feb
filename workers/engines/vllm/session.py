"""One Voxtral session on the `vllm` engine: audio to the model's realtime buffer at the
model's pace, each output's tokens fed back, text stamped by output index (see
`engine` for why)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np

from workers.engines.base import END, EngineError, RecognizeSession, SessionInput, SessionOptions
from workers.engines.vllm.options import AHEAD_FRAMES, FRAME, FRAME_S, SLACK_POSITIONS
from workers.engines.vllm.seams import SessionHost
from workers.events import SAMPLE_RATE, AudioChunk, TranscriptDelta, Word

log = logging.getLogger(__name__)

ENGINE_ENDED_IN_ERROR = "error"
"""`CompletionOutput.finish_reason` of a request the engine core finished with
`RequestStatus.FINISHED_ERROR` (vLLM's `str(FinishReason.ERROR)`). The re-anchoring
scheduler ends a request so when rotating its cached keys raised (part of its layers may
be rotated and part not, and decoding on would caption from keys at wrong positions), or
when vLLM preempted it after re-anchors (its recompute would lack the dropped positions'
context). vLLM's front end keeps a streaming request's generator open after it, so the
session leaves, aborts the request and fails for a fresh one."""


class FrameMap:
    """Model audio offsets (samples fed to this session) → stream sample positions.
    Contiguous input maps linearly; a chunk dropped by the bounded input queue leaves a
    jump, kept as a breakpoint so later stamps stay right."""

    def __init__(self) -> None:
        self._model: list[int] = []
        self._stream: list[int] = []
        self._next_stream: int | None = None

    def fed(self, chunk: AudioChunk, model_offset: int) -> None:
        if chunk.pos != self._next_stream:
            self._model.append(model_offset)
            self._stream.append(chunk.pos)
        self._next_stream = chunk.pos + chunk.samples

    def stream_pos(self, model_offset: int) -> int:
        if not self._model:
            return model_offset
        i = max(0, bisect.bisect_right(self._model, model_offset) - 1)
        if i > 64:  # forget breakpoints that no later output can fall before
            del self._model[: i - 1], self._stream[: i - 1]
            i = 1
        return self._stream[i] + model_offset - self._model[i]


class FeedGrid:
    """One engine's shared tick (`aligned_feed_ms`): sessions that wait for it are handed
    to the model in the same turn of the event loop, so the engine core can take them in
    one step instead of one step per place in the cycle their streams arrive at."""

    def __init__(self, tick_s: float) -> None:
        if tick_s <= 0:
            raise ValueError("a feed grid needs a tick > 0")
        self.tick_s = tick_s
        self._origin = time.monotonic()
        self.waits = 0  # chunks held for the tick
        self.waited_s = 0.0  # total time they were held

    def until_next(self) -> float:
        """Seconds to the next tick (0 on one)."""
        return -(time.monotonic() - self._origin) % self.tick_s

    async def next(self) -> None:
        wait = self.until_next()
        self.waits += 1
        self.waited_s += wait
        await asyncio.sleep(wait)


class VllmVoxtralSession(RecognizeSession):
    def __init__(self, engine: SessionHost, options: SessionOptions) -> None:
        super().__init__(options)
        self.engine = engine
        self.request_id = f"bc-{options.stream_id}-{uuid.uuid4().hex[:12]}"
        self.outputs = 0  # engine steps seen (≈ frames decoded)
        self.fed_samples = 0  # audio handed to the model's buffer
        self._frames = FrameMap()
        self._last_end = 0.0
        # each chunk's engine input built directly instead of by vLLM's renderer
        self.direct_input = engine.direct_input

    def _allowance(self) -> int:
        """Samples the model's buffer may hold: its next prompt plus a few frames."""
        g = self.engine.geometry
        return (g.first_frames + self.outputs + AHEAD_FRAMES) * FRAME

    def _positions(self) -> int:
        """Positions this request holds in vLLM (before any re-anchor)."""
        g = self.engine.geometry
        return g.left_pad + g.first_frames + self.outputs

    def _must_stop(self) -> bool:
        """True when the next frames would pass max_model_len: re-anchoring fell behind
        (or is off and the manager's budget did not end the session in time)."""
        e = self.engine
        used = self._positions() - e.shifted(self.request_id) + AHEAD_FRAMES
        return used + e.geometry.right_pad + SLACK_POSITIONS >= e.options.max_model_len

    def _word(self, text: str, k: int) -> Word:
        end = self._frames.stream_pos((k + 1) * FRAME) / SAMPLE_RATE
        end = max(end, self._last_end)
        start = self._last_end if self._last_end else max(0.0, end - FRAME_S)
        self._last_end = end
        return Word(text, start, end)

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        engine = self.engine
        backend = engine.backend
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        wanted = asyncio.Event()
        wanted.set()
        ended = False
        grid: FeedGrid | None = engine.feed_grid

        async def audio() -> AsyncIterator[np.ndarray]:
            # At the model's pace: a backlog waits in `inputs` (bounded, oldest dropped
            # and counted), not in the model buffer's unbounded queue.
            nonlocal ended
            while True:
                while self.fed_samples >= self._allowance():
                    wanted.clear()
                    await wanted.wait()
                if self._must_stop():
                    engine.overruns += 1
                    log.warning("stream %s: session ends before max_model_len",
                                self.options.stream_id)
                    return  # right padding, then the request ends; the manager goes on
                item = await inputs.get()
                if item is END:
                    ended = True
                    return  # the buffer adds right padding, then the request ends
                if isinstance(item, AudioChunk) and grid is not None and inputs.empty():
                    await grid.next()  # caught up: with the engine's other sessions
                if isinstance(item, AudioChunk):
                    self._frames.fed(item, self.fed_samples)
                    self.fed_samples += item.samples
                    yield np.frombuffer(item.pcm, dtype="<i2").astype(np.float32) / 32768.0

        finished = in_error = False
        every = engine.options.reanchor_every if engine.reanchoring else None
        try:
            prompts = backend.direct_prompts if self.direct_input else backend.prompts
            async for out in backend.generate(prompts(audio(), tokens),
                                              self.request_id, every):
                if not out.outputs:
                    continue
                o = out.outputs[0]
                if getattr(o, "finish_reason", None) == ENGINE_ENDED_IN_ERROR:
                    # A streaming request's front end never counts it finished (vLLM
                    # 0.26 output_processor: streaming input keeps it open), so its
                    # generator would wait on: leave now, and abort it below.
                    in_error = True
                    break
                k = self.outputs
                self.outputs += 1
                self._heard(self._frames.stream_pos(self.outputs * FRAME))
                wanted.set()
                tokens.put_nowait(list(o.token_ids))  # fed back: the next step's context
                if o.text:
                    self._out.put_nowait(TranscriptDelta(committed=(self._word(o.text, k),)))
            if in_error:
                engine.request_errors += 1
                log.warning("stream %s: the vllm engine ended its request with an error (a "
                            "failed rotation, or a preemption after re-anchors); the "
                            "session is replaced", self.options.stream_id)
                raise EngineError(
                    f"stream {self.options.stream_id}: the vllm engine ended the request "
                    f"because its re-anchored state could not be kept (its cached keys "
                    f"could not be rotated, or vLLM preempted it after re-anchors); a new "
                    f"session takes over")
            # Either our END flushed it, or the engine ended the session on its own
            # (max_model_len on vLLM >= 0.33); the session manager takes it from here.
            finished = True
            if not ended:
                log.info("stream %s: engine ended the session", self.options.stream_id)
        except Exception as exc:
            if backend.errored:
                raise EngineError("vllm engine core is dead", retryable=False) from exc
            raise
        finally:
            if not finished:
                # Cancelled or failed: cancelling alone would leave the request holding
                # a slot in the engine.
                engine.aborts += 1
                with contextlib.suppress(Exception):
                    await backend.abort(self.request_id)
