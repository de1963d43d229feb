"""The `vllm` engine: Voxtral Realtime on an in-process vLLM `AsyncLLM`, one per GPU.

One `generate()` per session, fed by the model's realtime audio buffer
(`buffer_realtime_audio`) through `StreamingInput`s, with each output's tokens
fed back and empty deltas dropped — what vLLM's own realtime server does in
`OpenAIServingRealtime.transcribe_realtime` (see VLLM.md), without the socket.
A closed session is aborted (`abort(request_id)`), so no orphaned request
holds a slot.

`vllm` is imported lazily, inside `_AsyncLLMBackend` only: everything else
(options → engine args, capability detection, session bookkeeping) is plain
code, tested with a fake backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from workers.engines.base import (
    END,
    DelayedTextStamps,
    EngineCapabilities,
    EngineError,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
)
from workers.events import AudioChunk, TranscriptDelta

log = logging.getLogger(__name__)

FRAME_S = 0.08  # one decoder token per 80 ms of audio
TOKENS_PER_STREAM = 400  # one encoder chunk is ~350-400 tokens; never split it


@dataclass(frozen=True, slots=True)
class VllmEngineOptions:
    model: str
    """Model folder (params.json + tekken.json [+ consolidated weights])."""
    max_streams: int = 16
    max_model_len: int = 131072
    gpu_memory_utilization: float = 0.90
    load_format: str = "mistral"
    """"mistral" for real weights, "dummy" for random weights (benchmarks)."""
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    cudagraph_mode: str = "PIECEWISE"
    max_num_batched_tokens: int | None = None
    attention_backend: str | None = "FLASH_ATTN"
    delay_s: float = 0.48
    """The model's transcription delay (tekken.json); one engine per delay value."""
    blank_run_k: int = 200


def engine_kwargs(o: VllmEngineOptions, available: set[str]) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for these options, given the field names
    the installed vLLM has (capability detection: newer flags only where present)."""
    kwargs: dict[str, Any] = {
        "model": o.model,
        "tokenizer_mode": "mistral",
        "config_format": "mistral",
        "load_format": o.load_format,
        "dtype": o.dtype,
        "max_model_len": o.max_model_len,
        "max_num_seqs": o.max_streams,
        "max_num_batched_tokens": max(o.max_num_batched_tokens or 0,
                                      TOKENS_PER_STREAM * o.max_streams, 2048),
        "gpu_memory_utilization": o.gpu_memory_utilization,
        "enforce_eager": o.enforce_eager,
        "enable_prefix_caching": False,  # realtime sessions share no prefix worth caching
        "limit_mm_per_prompt": {"audio": 1},
    }
    if not o.enforce_eager:
        kwargs["compilation_config"] = {"cudagraph_mode": o.cudagraph_mode}
    if o.attention_backend and "attention_backend" in available:
        kwargs["attention_backend"] = o.attention_backend
    if "enable_realtime_unbounded" in available:
        kwargs["enable_realtime_unbounded"] = True
    if "realtime_blank_run_k" in available:
        kwargs["realtime_blank_run_k"] = o.blank_run_k
    return {k: v for k, v in kwargs.items() if k in available}


def capabilities_for(o: VllmEngineOptions, available: set[str]) -> EngineCapabilities:
    if "enable_realtime_unbounded" in available:
        return EngineCapabilities(max_session_s=None, reanchors_natively=True, multilingual=True)
    # Stock vLLM: positions are capped by max_model_len; the session manager rolls over.
    return EngineCapabilities(max_session_s=o.max_model_len * FRAME_S, reanchors_natively=False,
                              multilingual=True)


class VllmBackend(Protocol):
    """What a session needs from vLLM (the real one wraps AsyncLLM; tests use a fake)."""

    def prompts(self, audio: AsyncIterator[np.ndarray],
                tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]: ...

    def generate(self, prompts: AsyncIterator[Any], request_id: str) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...


class _AsyncLLMBackend:
    """The real thing: one AsyncLLM in this process (the actor's GPU)."""

    def __init__(self, options: VllmEngineOptions) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.model_executor.model_loader import get_model_cls
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM

        available = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        self.available = available
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(options, available)))
        self.model_cls: Any = get_model_cls(self.llm.model_config)
        self.sampling = SamplingParams.from_optional(
            temperature=0.0, max_tokens=self.model_cls.realtime_max_tokens,
            output_kind=RequestOutputKind.DELTA, skip_clone=True,
        )

    async def prompts(self, audio: AsyncIterator[np.ndarray],
                      tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        from vllm.engine.protocol import StreamingInput
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        model_config = self.llm.model_config
        async for prompt in self.model_cls.buffer_realtime_audio(audio, tokens, model_config):
            (engine_input,) = await self.llm.renderer.render_cmpl_async(
                [parse_model_prompt(model_config, prompt)])
            yield StreamingInput(prompt=engine_input)

    def generate(self, prompts: AsyncIterator[Any], request_id: str) -> AsyncIterator[Any]:
        result: AsyncIterator[Any] = self.llm.generate(
            prompt=prompts, sampling_params=self.sampling, request_id=request_id)
        return result

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        self.llm.shutdown()


class VllmVoxtralEngine(SpeechEngine):
    def __init__(self, options: VllmEngineOptions, backend: VllmBackend | None = None,
                 available: set[str] | None = None) -> None:
        """`backend`/`available`: injected by tests (a fake); otherwise built in start()."""
        self.options = options
        self._backend = backend
        self._available = available
        self.sessions_open = 0
        self.aborts = 0

    @property
    def capabilities(self) -> EngineCapabilities:
        return capabilities_for(self.options, self._available or set())

    @property
    def backend(self) -> VllmBackend:
        if self._backend is None:
            raise EngineError("vllm engine not started", retryable=False)
        return self._backend

    async def start(self) -> None:
        if self._backend is None:
            real = await asyncio.to_thread(_AsyncLLMBackend, self.options)
            self._available = real.available
            self._backend = real

    async def aclose(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()
            self._backend = None

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = VllmVoxtralSession(self, options)
        session.start()
        return session

    def stats(self) -> dict[str, float]:
        return {"sessions_open": self.sessions_open, "aborts": self.aborts}


class VllmVoxtralSession(RecognizeSession):
    def __init__(self, engine: VllmVoxtralEngine, options: SessionOptions) -> None:
        super().__init__(options)
        self.engine = engine
        self.request_id = f"bc-{options.stream_id}-{uuid.uuid4().hex[:12]}"
        self.outputs = 0  # engine steps seen (≈ frames decoded)
        self._stamps = DelayedTextStamps(engine.options.delay_s, first_piece_s=FRAME_S)

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        backend = self.engine.backend
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        ended = False

        async def audio() -> AsyncIterator[np.ndarray]:
            # Straight from the session's input queue into the model's audio buffer:
            # no extra hop per 80 ms frame (per-step CPU work bounds capacity).
            nonlocal ended
            while True:
                item = await inputs.get()
                if item is END:
                    ended = True
                    return  # the buffer adds right padding, then the request ends
                if isinstance(item, AudioChunk):
                    self._stamps.fed(item)
                    yield np.frombuffer(item.pcm, dtype="<i2").astype(np.float32) / 32768.0

        self.engine.sessions_open += 1
        finished = False
        try:
            async for out in backend.generate(backend.prompts(audio(), tokens), self.request_id):
                if not out.outputs:
                    continue
                o = out.outputs[0]
                self.outputs += 1
                tokens.put_nowait(list(o.token_ids))  # fed back: the next step's context
                if o.text:
                    self._out.put_nowait(TranscriptDelta(committed=(self._stamps.word(o.text),)))
            # Either our END flushed it, or the engine ended the session on its own
            # (max_model_len on vLLM >= 0.33); the session manager takes it from here.
            finished = True
            if not ended:
                log.info("stream %s: engine ended the session", self.options.stream_id)
        finally:
            self.engine.sessions_open -= 1
            if not finished:
                # Cancelled or failed: cancelling alone would leave the request holding
                # a slot in the engine.
                self.engine.aborts += 1
                with contextlib.suppress(Exception):
                    await backend.abort(self.request_id)
