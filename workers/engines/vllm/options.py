"""The `vllm` engine's options and arithmetic, without vLLM: options → `AsyncEngineArgs`,
the positions a session uses besides its audio (from the model's tekken.json), session
budgets and slots, and which vLLM versions get the re-anchoring plugin."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from workers.engines.base import EngineCapabilities, EngineError
from workers.events import SAMPLE_RATE

FRAME = 1280  # samples per decoder token (80 ms at 16 kHz)
FRAME_S = FRAME / SAMPLE_RATE
TOKENS_PER_STREAM = 400  # one encoder chunk is ~350-400 tokens; never split it
AHEAD_FRAMES = 2
"""Audio handed to the model's buffer beyond what its next prompt needs."""
SLACK_POSITIONS = 16
"""Positions kept free below max_model_len: a switch lands up to one chunk late."""
DIRECT_TESTED = ("0.26.0",)  # direct.check_equal + compare_generate on the H200
REANCHOR_TESTED = ("0.26.0",)
"""Exact vLLM versions the re-anchoring plugin was run on (the H200); "auto" uses it only
there. Exact, not a prefix: the plugin and the direct builder mirror private code of one
release (a patch release may move it), so an unproven version rolls over and renders."""
SCHEDULER_CLS = "workers.engines.vllm.reanchor.scheduler.ReanchorAsyncScheduler"
WORKER_CLS = "workers.engines.vllm.reanchor.worker.ReanchorWorker"
REANCHOR_ARG = "babelcast_reanchor_every"
STATS_EVERY_S = 2.0
KV_TRACE_ENV = "BABELCAST_KV_TRACE"
"""A folder: if set, the re-anchoring scheduler (engine core) appends a JSON line a second
to kv-<pid>.jsonl there (KV blocks held per cache group, requests running and waiting);
bench.voxtral_capacity reads it. Unset in production: nothing is written."""



@dataclass(frozen=True, slots=True)
class VllmEngineOptions:
    model: str
    """Model folder (params.json + tekken.json [+ consolidated weights])."""
    max_streams: int = 16
    max_model_len: int = 16384  # orchestrator.config VllmConfig says why
    gpu_memory_utilization: float = 0.90
    load_format: str = "mistral"
    """"mistral" for real weights; for random weights (GPU tier, benchmarks) "dummy"
    (vLLM's: every weight uniform in ±1e-3, so attention scores spread by ~1e-9 and ignore
    the keys) or "babelcast_scaled" (workers/engines/vllm/reanchor/scaled_weights.py: each
    layer at a trained checkpoint's scale, so attention, and a wrong key, matter)."""
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    cudagraph_mode: str = "PIECEWISE"
    max_num_batched_tokens: int | None = None
    attention_backend: str | None = "FLASH_ATTN"
    kv_cache_dtype: str = "auto"
    """vLLM's KV cache element type: "auto" (the model's, bf16) or "fp8" (half the memory
    per position: what bounds sessions aged long, see README)."""
    reanchor: Literal["auto", "on", "off"] = "auto"
    """auto: on where tested (vLLM 0.26.0 exactly) and the engine's probe agrees; on:
    wherever the probe agrees; off: warm rollovers only."""
    reanchor_every: int = 4096
    """Positions between a session's re-anchors. Each one re-rotates every live key once
    (one rounding in the cache's dtype, bf16 or fp8); between them the token history grows
    by this much."""
    rollover_headroom: int | None = None
    """Sessions beyond max_streams (warm rollovers, rut restarts); None: a quarter, ≥ 1."""
    direct_input: Literal["auto", "on", "off"] = "auto"
    """Build each 80 ms chunk's engine input directly (workers/engines/vllm/direct.py)
    instead of through vLLM's renderer and HF processor. auto: on the vLLM versions
    where the two were checked equal byte for byte (0.26.0 exactly). Wherever it is on, the
    engine checks the two equal again at every start (checks.py) and renders if not."""
    sync_free_melspec: bool = True
    """The encoder's spectrogram without a wait on the GPU per 80 ms chunk (engine core,
    reanchor/melspec.py; needs the re-anchoring plugin worker; switched on only where
    a check on the GPU matches vLLM's method bit for bit). On the H200, two engines,
    production feed, one run: 128 new sessions 50 % real time without it, 100 % with it;
    48 sessions aged 30 min 0 % without, 100 % with (bench.voxtral_capacity `+melspec`,
    README)."""
    incremental_token_writes: bool = True
    """Stage a streaming session's token history on the GPU once instead of again at every
    chunk (engine core, reanchor/token_writes.py; needs the plugin worker; switched on
    only where a check on the GPU leaves vLLM's rows as vLLM's writes would). On the H200,
    two engines, fp8 KV, sync-free spectrogram, production feed, one run: 56 sessions aged
    30 min 0 % real time without it, 100 % with it, and 72 aged 100 % with it; vLLM's
    writes fell from 26-31 % of the engine cores' samples to 5-6 % (bench.voxtral_capacity
    `+tokens`, README)."""
    window_trim: bool = True
    """Hand FlashAttention only the KV blocks each session's sliding window can see
    (engine core, reanchor/window_trim.py; needs the plugin worker; switched on only
    where a check on the GPU finds the trimmed call as accurate as vLLM's). vLLM 0.26 hands
    it an aged session's whole position range. On the H200, fp8 KV: an aged decoder layer
    1.13-1.24 × faster, the encoder's 1.12-1.14 × (bench.fa_kernels --trim); two engines,
    production feed, 88 sessions aged 30 min: 0 % → 96.6 % real time in one run (11.72 →
    12.08 frames/s), 8.65 → 11.22 frames/s in the next (bench.voxtral_capacity +trim,
    README). True takes the "keys" mode where its check passes (FA3's leftpad_k: an aged
    decode step reads exactly its window with FA3's plain causal kernel, 1.38-1.81 × vLLM's
    call on an aged fp8 decoder layer; 11-15 points less GPU busy at 96 aged, no capacity
    gain shown: the engine core's CPU bounds it there), else "blocks"."""
    aligned_feed_ms: int = 0
    """Hand a caught-up session's chunk to the model on a tick every this many ms, shared
    by every session of the engine (session.FeedGrid), instead of the moment it arrives;
    0: as it arrives. Streams arrive at their own places in the 80 ms cycle, and each
    place costs the engine core a step of its own; on one tick, one step carries them all.
    Costs up to one tick of caption latency (half on average); a session that is behind
    is never held. On the H200 (2026-12-04) the engine whose sessions' chunks did not all
    arrive together spent 17-21 % more engine-core CPU per chunk than its peers whose did
    (bench/results/capacity_h200/README.md). With 80, and arrivals spread evenly over the
    cycle, three engines under MPS kept 60 and 75 aged sessions up by the strict rule
    (2026-12-05, engine core 2.0-2.3 ms per chunk against 2.6-3.0 ms in the lock-step
    75 runs). An event's default is 80 (`engine.vllm.aligned_feed_ms`); an engine made
    in code (the benches) feeds as chunks arrive unless told."""
    tick_gather_ms: float = 0.0
    """On the tick (`aligned_feed_ms`), hold an idle engine's first step of a tick up to
    this many ms until the tick's other chunks are in (engine core, reanchor/gather.py;
    needs the plugin worker); 0: off. vLLM's async scheduling otherwise takes a tick in
    two steps: the first chunks to arrive, then the rest. One engine on an H100, 25 new
    sessions, 5 ms: 12.6 steps a second against 25.0, 1.94 × less engine-core CPU per
    chunk (bench/results/gather_h100, 2026-12-05). Off by default until a strict level
    says what it is worth at the knee (`engine.vllm.tick_gather_ms`)."""
    cuda_mps: bool = False
    """The operator says the GPU node runs CUDA MPS (`engine.vllm.cuda_mps`): the engine
    refuses to start where MPS does not serve it (its budget assumed MPS): no daemon
    answers, or its engine core is not a client of the daemon's server (checks.py)."""
    engines_per_gpu: int = 1
    """Engines sharing this engine's GPU (`engine.vllm.engines_per_gpu`): with more than
    one and no CUDA MPS the engine says what that costs (workers/engines/vllm/mps.py)."""
    kv_bound_slots: bool = True
    """The engine refuses to start when its KV cache holds fewer aged sessions than its
    streams, and caps its session slots there (checks.py). False for benchmarks only,
    which measure levels past that bound on purpose: they are then warned, not refused."""
    logprobs_mode: str | None = None
    """GPU tier and benchmarks only: vLLM's `logprobs_mode` ("raw_logits": a request's
    logprobs are its raw logits), for exactness checks on logits. None: vLLM's default."""
    torch_profiler_dir: str | None = None
    """Benchmarks only: vLLM's torch profiler (CPU and CUDA activity of the engine core)
    writes its traces here between `AsyncLLM.start_profile()` and `stop_profile()`
    (bench.voxtral_capacity `--gpu-profile`). None in production: no profiler exists."""
    kv_cache_memory_bytes: int | None = None
    """vLLM's KV cache, this many bytes, instead of what its memory profile at start leaves
    under `gpu_memory_utilization`. Engines that share a GPU then need not start one at a
    time (`gpu_start_lock`: a profile taken while another engine loads is wrong), so a
    node's three engines start side by side: one after another took 287 s of a 10-minute
    H200 call (bench.capacity.strict, 2026-12-03; ~30.4 GiB each at 0.3 of the GPU). Side by
    side at 30 GiB each, three started in 143 s (2026-12-04) and every strict level since ran
    so; an event sets it with `engine.vllm.kv_cache_gib`."""


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
    return o.reanchor == "on" or version in REANCHOR_TESTED


def wants_direct(o: VllmEngineOptions, version: str) -> bool:
    """The builder mirrors one vLLM version's renderer output; elsewhere `auto` keeps
    vLLM's renderer (a chunk the builder does not recognise uses the renderer anyway)."""
    if o.direct_input == "off":
        return False
    return o.direct_input == "on" or version in DIRECT_TESTED


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
        # vLLM's own stats (a timestamp per request event, scheduler stats every step, a
        # log line every 10 s) are read by nothing here: the ASR actor reports its own.
        "disable_log_stats": True,
    }
    if o.torch_profiler_dir and "profiler_config" in available:
        # A dict here (this module imports no vLLM); the backend makes it a ProfilerConfig.
        kwargs["profiler_config"] = {
            "profiler": "torch", "torch_profiler_dir": o.torch_profiler_dir,
            "torch_profiler_with_stack": False,  # kernels and ops, not Python stacks
            "torch_profiler_dump_cuda_time_total": False,  # the bench sums the trace
            "ignore_frontend": True}  # the engine core only
    if o.logprobs_mode:
        kwargs["logprobs_mode"] = o.logprobs_mode
    if o.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = int(o.kv_cache_memory_bytes)
    if o.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = o.kv_cache_dtype
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
