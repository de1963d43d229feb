"""The `vllm` engine: Voxtral Realtime on an in-process vLLM `AsyncLLM`, one per GPU.

One `generate()` per session, fed by the model's realtime audio buffer
(`buffer_realtime_audio`) through `StreamingInput`s, with each output's tokens
fed back and empty deltas dropped — what vLLM's own realtime server does in
`OpenAIServingRealtime.transcribe_realtime` (see VLLM.md), without the socket.
A closed session is aborted (`abort(request_id)`), so no orphaned request
holds a slot.

What this engine adds to that loop, for sessions that run a whole event:
- **Re-anchoring** (`workers/engines/vllm/reanchor/`): on vLLM versions where the
  plugin is known to work (0.26.0) and the engine's own probe agrees, sessions never
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
- **Checked at start** (`checks.py`): every lever the budget counts on (the plugin's
  probe, the KV cache against the slots, CUDA MPS serving the engine core, direct input
  equal to the renderer's) is checked on the engine that will serve; a lever that fails
  is off with its reason in `describe()`, a setting it cannot honour refuses the start.

`vllm` is imported lazily, inside `_AsyncLLMBackend` only: everything else
(options → engine args, capability detection, session bookkeeping) is plain
code, tested with a fake backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

import numpy as np

from workers.engines.base import (
    EngineCapabilities,
    EngineError,
    RecognizeSession,
    SessionOptions,
    SpeechEngine,
)
from workers.engines.vllm.checks import CheckedBackend, check_start
from workers.engines.vllm.mps import mps_missing, mps_servers
from workers.engines.vllm.options import (  # re-exported: the engine's public names
    AHEAD_FRAMES,
    DEFAULT_GEOMETRY,
    FRAME,
    FRAME_S,
    REANCHOR_ARG,
    SCHEDULER_CLS,
    STATS_EVERY_S,
    WORKER_CLS,
    StreamGeometry,
    VllmEngineOptions,
    capabilities_for,
    engine_kwargs,
    headroom,
    max_session_s,
    read_geometry,
    wants_direct,
    wants_reanchor,
)
from workers.engines.vllm.seams import VllmBackend
from workers.engines.vllm.session import FeedGrid, FrameMap, VllmVoxtralSession

log = logging.getLogger(__name__)

__all__ = ["AHEAD_FRAMES", "DEFAULT_GEOMETRY", "FRAME", "FRAME_S", "SCHEDULER_CLS",
           "WORKER_CLS", "FrameMap", "StreamGeometry", "VllmEngineOptions",
           "VllmVoxtralEngine", "VllmVoxtralSession", "capabilities_for", "engine_kwargs",
           "headroom", "max_session_s", "read_geometry", "wants_direct", "wants_reanchor"]


class StartingBackend(VllmBackend, CheckedBackend, Protocol):
    """A backend the engine starts itself and checks (checks.py) before any session."""


@contextlib.contextmanager
def gpu_start_lock(folder: str | None = None) -> Iterator[None]:
    """Engines that share a GPU (`engines_per_gpu` > 1) start one at a time: vLLM sizes
    its KV cache from the free memory it profiles while it starts, and another engine
    loading at the same moment makes that profile wrong (or fails it). A file lock per
    visible GPU set, on this host; released when the engine is up or has failed."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    path = os.path.join(folder or tempfile.gettempdir(), f"babelcast-vllm-start-{gpus}.lock")
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log_lever(name: str, answer: dict[str, Any]) -> None:
    log.info("vllm engine: %s %s", name,
             "on" if answer.get("on") else f"off ({answer.get('why_not')})")


async def switch_lever(backend: Any, setter: str, on: bool | str | float) -> dict[str, Any]:
    """Switch an engine-core lever through `backend.<setter>(on)` (`set_melspec`,
    `set_token_writes`, `set_window_trim`, `set_tick_gather`); a backend without it, or a
    switch that fails, leaves vLLM's own way on and says why."""
    try:
        return dict(await getattr(backend, setter)(on))
    except Exception as exc:
        return {"on": False, "why_not": f"{type(exc).__name__}: {exc}"}


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
        kwargs = engine_kwargs(options, available, reanchor=self.reanchor_requested)
        if isinstance(kwargs.get("profiler_config"), dict):  # benchmarks only
            from vllm.config import ProfilerConfig

            kwargs["profiler_config"] = ProfilerConfig(**kwargs["profiler_config"])
        from workers.engines.vllm.reanchor import scaled_weights

        if options.load_format == scaled_weights.LOAD_FORMAT:  # GPU tier, benchmarks
            scaled_weights.register()  # a forked engine core inherits it
        args = AsyncEngineArgs(**kwargs)
        # A KV cache of a given size needs no memory profile: no other engine can skew it
        sized = bool(options.kv_cache_memory_bytes and "kv_cache_memory_bytes" in available)
        with contextlib.nullcontext() if sized else gpu_start_lock():
            self.llm = AsyncLLM.from_engine_args(args)
        self.model_cls: Any = get_model_cls(self.llm.model_config)
        self._sampling = SamplingParams
        self._kind = RequestOutputKind.DELTA
        self.sampling = self._params(None)
        self._direct: Any = None  # direct.DirectChunkBuilder, made on first use

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

    async def set_melspec(self, on: bool) -> dict[str, Any]:
        """The encoder's spectrogram without a GPU wait per chunk, or vLLM's
        (reanchor/melspec.py)."""
        return await self._plugin_switch("babelcast_melspec", on)

    async def set_token_writes(self, on: bool) -> dict[str, Any]:
        """A streaming session's token history staged once instead of at every chunk, or
        vLLM's whole-history writes (reanchor/token_writes.py)."""
        return await self._plugin_switch("babelcast_token_writes", on)

    async def set_window_trim(self, on: bool | str) -> dict[str, Any]:
        """FlashAttention handed only the keys ("keys") or KV blocks ("blocks") each
        session's window sees (True: the best its check allows), or vLLM's whole position
        range (reanchor/window_trim.py)."""
        return await self._plugin_switch("babelcast_window_trim", on)

    async def set_tick_gather(self, window_ms: float) -> dict[str, Any]:
        """An idle engine's first step of a tick held up to `window_ms` for the tick's
        other chunks, or each step as vLLM starts it (0; reanchor/gather.py). An event's
        `engine.vllm.tick_gather_ms` (off by default), or a benchmark's `+gather`."""
        return await self._plugin_switch("babelcast_tick_gather", float(window_ms))

    async def _plugin_switch(self, method: str, on: bool | str | float) -> dict[str, Any]:
        """Only the plugin worker has the engine-core levers."""
        if not self.reanchor_requested:
            return {"on": False, "why_not": "the plugin worker is not loaded"}
        (answer,) = await self.llm.collective_rpc(method, args=(on,))
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

    def direct_prompts(self, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        """`prompts`, with each chunk's engine input built directly (direct.py)."""
        from workers.engines.vllm.direct import direct_prompts

        return direct_prompts(self.llm, self.model_cls, audio, tokens, self._builder())

    async def check_direct(self) -> dict[str, Any]:
        """The builder sessions use against vLLM's renderer, every field and the request
        bytes, on ~1 s of faint noise (direct.check_equal_async; "equal")."""
        from workers.engines.vllm.direct import _noise, check_equal_async

        return await check_equal_async(self.llm, self.model_cls, _noise(1.0), self._builder())

    def _builder(self) -> Any:
        from workers.engines.vllm.direct import DirectChunkBuilder

        if self._direct is None:
            self._direct = DirectChunkBuilder.for_llm(self.llm)
        return self._direct

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
                 *, reanchoring: bool = False, geometry: StreamGeometry | None = None,
                 backend_factory: Callable[[VllmEngineOptions], StartingBackend] | None = None
                 ) -> None:
        """`backend` (with `reanchoring`, `geometry`): injected by tests (a fake), taken as
        started and checked. Otherwise start() builds one with `backend_factory` (the real
        AsyncLLM backend; a fake in CPU tests of the start checks) from the model folder
        and the installed vLLM, and checks it (checks.py)."""
        self.options = options
        self._backend = backend
        self._factory = backend_factory or _AsyncLLMBackend
        self.reanchoring = reanchoring
        self.geometry = geometry or DEFAULT_GEOMETRY
        # injected backends (tests) follow "on"/"off"; a real one decides by version in start()
        # and by its check there (checks.py), which says why it renders (`direct_why`)
        self.direct_input = options.direct_input == "on"
        self.direct_why: str | None = None
        self.feed_grid = (FeedGrid(options.aligned_feed_ms / 1000)
                          if options.aligned_feed_ms else None)
        self.max_sessions = options.max_streams + headroom(options)
        self.sessions_open = 0
        self.aborts = 0
        self.mps: list[str] | None = None
        """CUDA MPS servers on this GPU node at start (mps.py); None: none."""
        self.mps_served = False
        """CUDA MPS serves this engine: its engine core is a client (checked at start)."""
        self.mps_why: str | None = None  # why not, where a daemon answered
        self.slot_refusals = 0
        self.overruns = 0
        self.request_errors = 0  # requests the engine core ended in error (session.py)
        self.reanchor_probe: dict[str, Any] = {}
        self.mode_why: str | None = None  # why sessions roll over though asked to re-anchor
        self.kv_sessions: int | None = None  # aged sessions the KV cache holds (probe)
        self.melspec: dict[str, Any] = {"on": False, "why_not": "not asked"}
        self.token_writes: dict[str, Any] = {"on": False, "why_not": "not asked"}
        self.window_trim: dict[str, Any] = {"on": False, "why_not": "not asked"}
        self.tick_gather: dict[str, Any] = {"on": False, "why_not": "not asked"}
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
        self.mps = await asyncio.to_thread(mps_servers)
        if self.options.cuda_mps and self.mps is None:
            raise EngineError(mps_missing())  # before minutes of loading a model for nothing
        if self._backend is not None:
            self._start_stats()
            return
        self.geometry = read_geometry(self.options.model)
        real = await asyncio.to_thread(self._factory, self.options)
        self._backend = real
        try:
            checked = await check_start(real, self.options, self.geometry,
                                        daemon=self.mps is not None)
        except BaseException:
            await self.aclose()  # refused (or cancelled): its GPU memory goes back now
            raise
        self.reanchor_probe, self.reanchoring = checked.probe, checked.reanchoring
        self.mode_why, self.kv_sessions = checked.mode_why, checked.kv_sessions
        self.max_sessions = checked.session_slots
        self.mps_served, self.mps_why = checked.mps_served, checked.mps_why
        self.direct_input, self.direct_why = checked.direct_input, checked.direct_why
        if self.options.sync_free_melspec:
            self.melspec = await switch_lever(real, "set_melspec", True)
            _log_lever("sync-free spectrogram", self.melspec)
        if self.options.incremental_token_writes:
            self.token_writes = await switch_lever(real, "set_token_writes", True)
            _log_lever("incremental token writes", self.token_writes)
        if self.options.window_trim:
            self.window_trim = await switch_lever(real, "set_window_trim", True)
            _log_lever(f"window-trimmed attention ({self.window_trim.get('mode')})",
                       self.window_trim)
        if self.options.tick_gather_ms and self.feed_grid is not None:
            self.tick_gather = await switch_lever(real, "set_tick_gather",
                                                  float(self.options.tick_gather_ms))
            _log_lever(f"tick gather ({self.options.tick_gather_ms:g} ms)", self.tick_gather)
        self._start_stats()

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
        """Health's and the actor status hash's view. The `*_why` keys are always there
        ("" when there is nothing to explain): the hash keeps a field a later report leaves
        out, and a restarted engine must not show its predecessor's reason."""
        version = getattr(self._backend, "version", "")
        return {"engine_mode": self.mode, "engine_mode_why": self.mode_why or "",
                "engine_input": "direct" if self.direct_input else "renderer",
                "engine_input_why": self.direct_why or "",
                "engine_melspec": "sync-free" if self.melspec.get("on") else "vllm",
                "engine_token_writes": "incremental" if self.token_writes.get("on") else "vllm",
                "engine_attention": (f"window-{self.window_trim.get('mode') or 'blocks'}"
                                     if self.window_trim.get("on") else "vllm"),
                "engine_feed": (f"aligned {self.options.aligned_feed_ms} ms"
                                if self.feed_grid else "as it arrives"),
                "engine_tick_gather": (f"{self.options.tick_gather_ms:g} ms"
                                       if self.tick_gather.get("on") else "off"),
                "engine_mps": "on" if self.mps_served else "off",
                "engine_mps_why": self.mps_why or "",
                "engine_session_slots": str(self.max_sessions),
                **({"engine_kv_sessions": str(self.kv_sessions)}
                   if self.kv_sessions is not None else {}),
                **({"vllm": version} if version else {})}

    def stats(self) -> dict[str, float]:
        """Counters since start. From the plugin worker (`reanchor_counts`): re-anchors
        applied, those `deferred` (a routine wait: a step of the request still in flight,
        tried again at its next chunk), rotations that raised (each ended its request) and
        re-anchored requests ended because vLLM preempted them."""
        counts = self.reanchor_counts
        return {"sessions_open": self.sessions_open, "aborts": self.aborts,
                "slot_refusals": self.slot_refusals, "reanchoring": float(self.reanchoring),
                "reanchors": float(counts.get("reanchors", 0)),
                "reanchor_deferred": float(sum(counts.get("deferred", {}).values())),
                "reanchor_rotation_failures": float(counts.get("rotation_failed", 0)),
                "reanchor_preempted_ended": float(counts.get("preempted_ended", 0)),
                "reanchor_overruns": self.overruns, "request_errors": self.request_errors,
                **({"feed_held": float(self.feed_grid.waits),
                    "feed_held_s": round(self.feed_grid.waited_s, 3)}
                   if self.feed_grid else {})}
