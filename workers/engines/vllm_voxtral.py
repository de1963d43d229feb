"""The `vllm` engine: Voxtral Realtime on an in-process vLLM `AsyncLLM`, one per GPU.

One `generate()` per session, fed by the model's realtime audio buffer
(`buffer_realtime_audio`) through `StreamingInput`s, with each output's tokens
fed back and empty deltas dropped — what vLLM's own realtime server does in
`OpenAIServingRealtime.transcribe_realtime` (see VLLM.md), without the socket.
A closed session is aborted (`abort(request_id)`), so no orphaned request
holds a slot.

What this engine adds to that loop, for sessions that run a whole event:
- **Re-anchoring** (`workers/engines/vllm_reanchor/`): on vLLM versions where the
  plugin is known to work (0.26.x) and the engine's own probe agrees, sessions never
  reach `max_model_len`: their positions are lowered at chunk boundaries and their
  cached keys re-rotated. Elsewhere the session manager rolls sessions over before
  the cap, with a budget that counts the padding positions too.
- **Audio at the model's pace.** The model's buffer drains whatever it is given into
  an unbounded queue; here it is given audio only a few frames ahead of what it has
  decoded, so a backlog stays in the session's bounded input queue (oldest dropped,
  counted) and shows in the latency of captions.
- **Exact stamps.** Output k of a session is the text for the audio that ends
  (k+1)·1280 samples after the session's first sample (the model's delay is built in:
  the first prompt covers the delay's frames). Replayed audio gets its own times.
- **Slots.** At most `max_streams + rollover_headroom` sessions are open at once
  (vLLM's V2 runner dies when more requests are live than `max_num_seqs`);
  `max_num_seqs` has the same headroom, for warm rollovers.
- **Health.** A dead engine core makes `check_health()` false, and new sessions fail
  at once with a non-retryable error instead of hanging.

`vllm` is imported lazily, inside `_AsyncLLMBackend` only: everything else
(options → engine args, capability detection, session bookkeeping) is plain
code, tested with a fake backend.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from workers.engines.base import (
    END,
    EngineCapabilities,
    EngineError,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
)
from workers.events import SAMPLE_RATE, AudioChunk, TranscriptDelta, Word

log = logging.getLogger(__name__)

FRAME = 1280  # samples per decoder token (80 ms at 16 kHz)
FRAME_S = FRAME / SAMPLE_RATE
TOKENS_PER_STREAM = 400  # one encoder chunk is ~350-400 tokens; never split it
AHEAD_FRAMES = 2
"""Audio handed to the model's buffer beyond what its next prompt needs."""
SLACK_POSITIONS = 16
"""Positions kept free below max_model_len: a switch lands up to one chunk late."""
REANCHOR_TESTED = ("0.26.",)
"""vLLM versions the re-anchoring plugin was run on (the H200); "auto" uses it only there."""
SCHEDULER_CLS = "workers.engines.vllm_reanchor.scheduler.ReanchorAsyncScheduler"
WORKER_CLS = "workers.engines.vllm_reanchor.worker.ReanchorWorker"
REANCHOR_ARG = "babelcast_reanchor_every"
STATS_EVERY_S = 2.0


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
    reanchor: Literal["auto", "on", "off"] = "auto"
    """auto: on where tested (vLLM 0.26.x) and the engine's probe agrees; on: wherever
    the probe agrees; off: warm rollovers only."""
    reanchor_every: int = 4096
    """Positions between a session's re-anchors. Each one re-rotates every live key once
    (one bf16 rounding); between them the token history grows by this much."""
    rollover_headroom: int | None = None
    """Sessions beyond max_streams (warm rollovers, rut restarts); None: a quarter, ≥ 1."""


@dataclass(frozen=True, slots=True)
class StreamGeometry:
    """Positions a session uses besides its audio frames, from the model's tekken.json."""

    delay_s: float
    left_pad: int  # positions of silence before the audio
    right_pad: int  # positions after the audio (delay + BOS + a long word's buffer)

    @property
    def first_frames(self) -> int:
        """Real audio frames the first prompt needs (1 + the delay's frames)."""
        return 1 + round(self.delay_s / FRAME_S)

    @classmethod
    def from_tekken(cls, tekken: dict[str, Any]) -> StreamGeometry:
        audio = tekken.get("audio") or {}
        delay_ms = audio.get("transcription_delay_ms")
        if not isinstance(delay_ms, (int, float)) or delay_ms <= 0:
            raise EngineError("tekken.json has no audio.transcription_delay_ms: not a "
                              "Voxtral Realtime model folder", retryable=False)
        delay_tokens = math.ceil(delay_ms / (FRAME_S * 1000))
        left = int(audio.get("streaming_n_left_pad_tokens") or 0)
        # mistral_common: right pad = delay tokens + BOS + 10 tokens for a long word.
        return cls(delay_s=delay_ms / 1000, left_pad=left, right_pad=delay_tokens + 1 + 10)


DEFAULT_GEOMETRY = StreamGeometry(delay_s=0.48, left_pad=32, right_pad=17)


def read_geometry(model: str) -> StreamGeometry:
    """The delay and padding of the model in `model` (its tekken.json)."""
    path = Path(model) / "tekken.json"
    try:
        tekken = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: not found (a Voxtral model folder has params.json and "
                          "tekken.json)", retryable=False) from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: unreadable ({exc})", retryable=False) from exc
    return StreamGeometry.from_tekken(tekken)


def headroom(o: VllmEngineOptions) -> int:
    if o.rollover_headroom is not None:
        return max(0, o.rollover_headroom)
    return max(1, math.ceil(o.max_streams / 4))


def max_session_s(o: VllmEngineOptions, g: StreamGeometry) -> float:
    """Audio one session may take before its positions reach max_model_len: the
    padding positions and some slack count against the cap too."""
    return max(0, o.max_model_len - g.left_pad - g.right_pad - SLACK_POSITIONS) * FRAME_S


def wants_reanchor(o: VllmEngineOptions, version: str, available: set[str]) -> bool:
    if o.reanchor == "off" or not {"scheduler_cls", "worker_cls"} <= available:
        return False
    return o.reanchor == "on" or version.startswith(REANCHOR_TESTED)


def engine_kwargs(o: VllmEngineOptions, available: set[str], *,
                  reanchor: bool = False) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for these options, given the field names
    the installed vLLM has (capability detection: newer flags only where present)."""
    seqs = o.max_streams + headroom(o)
    kwargs: dict[str, Any] = {
        "model": o.model,
        "tokenizer_mode": "mistral",
        "config_format": "mistral",
        "load_format": o.load_format,
        "dtype": o.dtype,
        "max_model_len": o.max_model_len,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": max(o.max_num_batched_tokens or 0,
                                      TOKENS_PER_STREAM * seqs, 2048),
        "gpu_memory_utilization": o.gpu_memory_utilization,
        "enforce_eager": o.enforce_eager,
        "enable_prefix_caching": False,  # realtime sessions share no prefix worth caching
        "limit_mm_per_prompt": {"audio": 1},
    }
    if not o.enforce_eager:
        kwargs["compilation_config"] = {"cudagraph_mode": o.cudagraph_mode}
    if o.attention_backend and "attention_backend" in available:
        kwargs["attention_backend"] = o.attention_backend
    if reanchor:
        kwargs["scheduler_cls"] = SCHEDULER_CLS
        kwargs["worker_cls"] = WORKER_CLS
        # The plugin's scheduler is an AsyncScheduler: say so rather than let vLLM guess.
        kwargs["async_scheduling"] = True
    # Not used even where present: vLLM forks' `enable_realtime_unbounded` and
    # `realtime_blank_run_k` need per-request wiring (`unbounded=True` in the audio
    # buffer, the blank penalty in SamplingParams.extra_args) that no stock vLLM has
    # and that was never run here, so this engine does not claim them.
    return {k: v for k, v in kwargs.items() if k in available}


def capabilities_for(o: VllmEngineOptions, g: StreamGeometry, reanchoring: bool
                     ) -> EngineCapabilities:
    if reanchoring:
        return EngineCapabilities(max_session_s=None, reanchors_natively=True, multilingual=True)
    # Positions are capped by max_model_len; the session manager rolls over before it.
    return EngineCapabilities(max_session_s=max_session_s(o, g), reanchors_natively=False,
                              multilingual=True)


class VllmBackend(Protocol):
    """What a session needs from vLLM (the real one wraps AsyncLLM; tests use a fake)."""

    @property
    def errored(self) -> bool: ...

    def prompts(self, audio: AsyncIterator[np.ndarray],
                tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]: ...

    def generate(self, prompts: AsyncIterator[Any], request_id: str,
                 reanchor_every: int | None) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    async def reanchor_stats(self) -> dict[str, Any] | None: ...

    def shutdown(self) -> None: ...


class _AsyncLLMBackend:
    """The real thing: one AsyncLLM in this process (the actor's GPU)."""

    def __init__(self, options: VllmEngineOptions) -> None:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.model_executor.model_loader import get_model_cls
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM

        available = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        self.available = available
        self.version = str(vllm.__version__)
        self.reanchor_requested = wants_reanchor(options, self.version, available)
        if options.reanchor == "on" and not self.reanchor_requested:
            log.warning("vllm %s has no scheduler_cls/worker_cls: re-anchoring is off",
                        self.version)
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            **engine_kwargs(options, available, reanchor=self.reanchor_requested)))
        self.model_cls: Any = get_model_cls(self.llm.model_config)
        self._sampling = SamplingParams
        self._kind = RequestOutputKind.DELTA
        self.sampling = self._params(None)

    def _params(self, reanchor_every: int | None) -> Any:
        return self._sampling.from_optional(
            temperature=0.0, max_tokens=self.model_cls.realtime_max_tokens,
            output_kind=self._kind, skip_clone=True,
            extra_args={REANCHOR_ARG: reanchor_every} if reanchor_every else None,
        )

    async def probe(self) -> dict[str, Any]:
        """The worker's view of re-anchoring (only where the plugin worker is loaded)."""
        if not self.reanchor_requested:
            return {"supported": False, "why_not": "not requested"}
        (answer,) = await self.llm.collective_rpc("babelcast_reanchor_probe")
        return dict(answer)

    async def reanchor_stats(self) -> dict[str, Any] | None:
        if not self.reanchor_requested:
            return None
        (answer,) = await self.llm.collective_rpc("babelcast_reanchor_stats")
        return dict(answer)

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    async def prompts(self, audio: AsyncIterator[np.ndarray],
                      tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        from vllm.engine.protocol import StreamingInput
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        model_config = self.llm.model_config
        async for prompt in self.model_cls.buffer_realtime_audio(audio, tokens, model_config):
            (engine_input,) = await self.llm.renderer.render_cmpl_async(
                [parse_model_prompt(model_config, prompt)])
            yield StreamingInput(prompt=engine_input)

    def generate(self, prompts: AsyncIterator[Any], request_id: str,
                 reanchor_every: int | None) -> AsyncIterator[Any]:
        params = self._params(reanchor_every) if reanchor_every else self.sampling
        result: AsyncIterator[Any] = self.llm.generate(
            prompt=prompts, sampling_params=params, request_id=request_id)
        return result

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        self.llm.shutdown()


class VllmVoxtralEngine(SpeechEngine):
    def __init__(self, options: VllmEngineOptions, backend: VllmBackend | None = None,
                 *, reanchoring: bool = False,
                 geometry: StreamGeometry | None = None) -> None:
        """`backend` (with `reanchoring`, `geometry`): injected by tests (a fake);
        otherwise built in start() from the model folder and the installed vLLM."""
        self.options = options
        self._backend = backend
        self.reanchoring = reanchoring
        self.geometry = geometry or DEFAULT_GEOMETRY
        self.max_sessions = options.max_streams + headroom(options)
        self.sessions_open = 0
        self.aborts = 0
        self.slot_refusals = 0
        self.overruns = 0
        self.reanchor_probe: dict[str, Any] = {}
        self.reanchor_counts: dict[str, Any] = {}
        self._shifts: dict[str, int] = {}  # our request id → positions shifted so far
        self._stats_task: asyncio.Task[None] | None = None

    @property
    def capabilities(self) -> EngineCapabilities:
        return capabilities_for(self.options, self.geometry, self.reanchoring)

    @property
    def mode(self) -> str:
        return "reanchor" if self.reanchoring else "rollover"

    @property
    def backend(self) -> VllmBackend:
        if self._backend is None:
            raise EngineError("vllm engine not started", retryable=False)
        return self._backend

    async def start(self) -> None:
        if self._backend is not None:
            self._start_stats()
            return
        self.geometry = read_geometry(self.options.model)
        real = await asyncio.to_thread(_AsyncLLMBackend, self.options)
        self._backend = real
        if real.reanchor_requested:
            try:
                self.reanchor_probe = await real.probe()
            except Exception as exc:  # the plugin worker did not load: roll over instead
                self.reanchor_probe = {"supported": False,
                                       "why_not": f"{type(exc).__name__}: {exc}"}
            self.reanchoring = bool(self.reanchor_probe.get("supported")) and self._fits()
        log.info("vllm %s engine: %s (%s)", real.version, self.mode,
                 self.reanchor_probe.get("why_not") or "ok")
        self._start_stats()

    def _fits(self) -> bool:
        """Re-anchoring keeps a session under max_model_len only if the window, one
        interval and the padding fit below it."""
        p = self.reanchor_probe
        keep, unit = int(p.get("keep") or 0), int(p.get("unit") or 0)
        need = keep + max(self.options.reanchor_every, unit) + unit + self.geometry.right_pad
        if need + SLACK_POSITIONS >= self.options.max_model_len:
            self.reanchor_probe["why_not"] = (
                f"max_model_len {self.options.max_model_len} leaves no room to re-anchor "
                f"(window {keep} + interval + padding = {need})")
            return False
        return True

    def _start_stats(self) -> None:
        if self.reanchoring and self._stats_task is None:
            self._stats_task = asyncio.create_task(self._poll_stats(), name="vllm-stats")

    async def _poll_stats(self) -> None:
        while True:
            try:
                stats = await self.backend.reanchor_stats()
            except Exception as exc:  # the engine may be dead; health says so
                log.debug("re-anchor stats unavailable: %s", type(exc).__name__)
                stats = None
            if stats is not None:
                self.reanchor_counts = stats
                # vLLM appends "-<8 chars>" to request ids internally.
                self._shifts = {rid.rsplit("-", 1)[0]: int(v)
                                for rid, v in stats.get("shift_by_request", {}).items()}
            await asyncio.sleep(STATS_EVERY_S)

    def shifted(self, request_id: str) -> int:
        return self._shifts.get(request_id, 0)

    async def aclose(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stats_task
            self._stats_task = None
        if self._backend is not None:
            backend, self._backend = self._backend, None
            # AsyncLLM.shutdown() blocks while the engine core stops: not on the loop.
            await asyncio.to_thread(backend.shutdown)

    async def check_health(self) -> bool:
        return self._backend is not None and not self._backend.errored

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        backend = self.backend
        if backend.errored:
            raise EngineError("vllm engine core is dead", retryable=False)
        if self.sessions_open >= self.max_sessions:
            self.slot_refusals += 1
            raise EngineError(f"all {self.max_sessions} session slots are in use "
                              f"({self.options.max_streams} streams + headroom)")
        session = VllmVoxtralSession(self, options)
        self.sessions_open += 1
        session.start()
        # Released when the task ends, however it ends (even cancelled before it ran).
        session.on_done(self._release)
        return session

    def _release(self) -> None:
        self.sessions_open -= 1

    def describe(self) -> dict[str, str]:
        version = getattr(self._backend, "version", "")
        return {"engine_mode": self.mode, **({"vllm": version} if version else {})}

    def stats(self) -> dict[str, float]:
        counts = self.reanchor_counts
        return {"sessions_open": self.sessions_open, "aborts": self.aborts,
                "slot_refusals": self.slot_refusals, "reanchoring": float(self.reanchoring),
                "reanchors": float(counts.get("reanchors", 0)),
                "reanchor_failures": float(sum(counts.get("failures", {}).values())),
                "reanchor_overruns": self.overruns}


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


class VllmVoxtralSession(RecognizeSession):
    def __init__(self, engine: VllmVoxtralEngine, options: SessionOptions) -> None:
        super().__init__(options)
        self.engine = engine
        self.request_id = f"bc-{options.stream_id}-{uuid.uuid4().hex[:12]}"
        self.outputs = 0  # engine steps seen (≈ frames decoded)
        self.fed_samples = 0  # audio handed to the model's buffer
        self._frames = FrameMap()
        self._last_end = 0.0

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
                if isinstance(item, AudioChunk):
                    self._frames.fed(item, self.fed_samples)
                    self.fed_samples += item.samples
                    yield np.frombuffer(item.pcm, dtype="<i2").astype(np.float32) / 32768.0

        finished = False
        every = engine.options.reanchor_every if engine.reanchoring else None
        try:
            async for out in backend.generate(backend.prompts(audio(), tokens),
                                              self.request_id, every):
                if not out.outputs:
                    continue
                o = out.outputs[0]
                k = self.outputs
                self.outputs += 1
                wanted.set()
                tokens.put_nowait(list(o.token_ids))  # fed back: the next step's context
                if o.text:
                    self._out.put_nowait(TranscriptDelta(committed=(self._word(o.text, k),)))
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
