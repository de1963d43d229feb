"""How many streams an embedded ASR actor takes when the event file does not say.

The embedded engine decodes every stream of an actor on one thread with `cpu_threads`
CPU threads; past a number of streams it no longer keeps real time (every stream's
captions fall behind together). `bench.scale` finds that knee; the figures here are its
measurements on the 2-core development machine, as real-time streams per core the actor
can use (its `cpu_threads`, at most the host's cores shared among the actors):

| model | knee, 2 cores | per core |
|---|---|---|
| whisper-base | 3 streams | 1.5 |
| tiny.en | 6 streams | 3.0 |

These constants are the fallback. By default (`engine.calibrate: true`, issue 37) the
embedded figure is measured on the host itself (`workers.engines.calibrate`: a few
seconds, cached per host and options), because a second 2-core host carried less than the
development machine: `babelcast run` measures before it plans where nothing is cached
(`measure_before_planning`), and an event with more streams than the host carries still
runs, on a budget raised to fit them, with a warning (`over_capacity`) and the figure in
status. An operator who measures a machine sets `engine.streams_per_actor` in the event
file; that figure is a hard budget.

The `vllm` engine (Voxtral Realtime on vLLM 0.26.0) takes, per engine, what aged sessions
kept in real time on an H200 (16-core Xeon host): three fp8 engines by the strict keep-up
rule of `bench.capacity.strict`, the others by `bench.voxtral_capacity`'s knee (see below):

- bf16 KV cache (`kv_cache_dtype: auto`, the default): `VLLM_STREAMS_PER_ACTOR`, 18. Two
  engines on the GPU (`engines_per_gpu: 2`, each 0.425 of its memory, `max_model_len`
  16384, re-anchoring every 4096) held 36 aged sessions in real time (2026-12-01, fed to the
  engine directly, before the engine-core levers below). The scheduler trace put an aged
  session at 78 KV blocks of 2,636, so KV would allow ~33 per such engine; that is not
  measured in real time with the levers on.
- fp8 KV cache, one or two engines per GPU: `VLLM_FP8_STREAMS_PER_ACTOR`, 36. With the
  sync-free spectrogram and incremental token writes (both on by default), two engines held
  72 aged sessions fed through session managers and VAD in real time (2026-12-01, GPU 99 %
  busy; 80 stalled in the bench's own ageing, fixed since, not measured again). An engine
  with the whole GPU has twice the cache; it is given the same budget until its own aged
  knee is measured. By the strict rule, one engine with a whole H100 kept 48 aged sessions
  of 48 up on the 80 ms tick (2026-12-07, bench/results/capacity_h100), its engine core at
  1.0-1.1 ms of CPU per chunk; the H200 host of 2026-12-05 spent 2.0-2.1 ms, at which 48
  would ask one engine core for 1.26 CPU-seconds a second, so 36 stays.
- fp8 KV cache, three engines per GPU, under CUDA MPS, chunks fed on the engine's shared
  80 ms tick (`aligned_feed_ms`, 80 by default): `VLLM_FP8_X3_MPS_ALIGNED_STREAMS_PER_ACTOR`,
  22, the first levels to pass the strict keep-up rule as a whole (2026-12-05, arrivals
  spread evenly over the 80 ms cycle as independent encoders send them, sessions aged
  12 min, ages staggered): 60 (20 per engine) kept 60 of 60 up, p99 <= 0.24 s, and 75
  (25 per engine) 75 of 75, p99 <= 0.56 s, growth <= 0.06 s, 74 re-anchors in the phase,
  the 97 % control caught in both. 22 is 25 less 10 %; 90 is not measured at these
  arrivals, so the knee may lie higher.
- The same with `aligned_feed_ms: 0` (each chunk handed on as it arrives):
  `VLLM_FP8_X3_MPS_STREAMS_PER_ACTOR`, 18, from the strict keep-up rule (bench/capacity/
  rule.py: backlog growth < 0.5 s and p99 <= 1.0 s over a 300 s phase; H200, sessions aged
  12 minutes with ages staggered over the re-anchor cycle, the engine-core levers and
  window-trimmed "keys" attention on, bench/results/capacity_h200). 60 sessions (20 per
  engine, 2026-12-04) kept 60 of 60 up (p99 <= 0.40 s, growth <= 0.03 s; over 299.6 s,
  0.4 s short of the rule's phase, so not counted as a pass). 90 (30 per engine, the same
  session) kept 0 of 90 up: every engine fell behind in the phase's last 12-90 s (12.29-
  12.41 frames/s, up to 7 s behind). At 100 (an earlier session) two engines with 33 each
  kept every session up and the one with 34 did not; at 110, 0 of 110. The knee lies
  between 20 and 30 per engine and moves between runs by more than that gap, so 18 is the
  level that held (20) less a 10 % margin, provisional until a level passes as a whole.
  (36 came from 110 held at 12.0 frames/s, 96 % of real time, over a 43 s window; 30 from
  the 100-session run, until the 90-session run failed.) Those runs fed every session's
  chunk at one instant, the best case for feeding chunks as they arrive; with arrivals
  spread over the cycle and no tick, no level is measured.
- fp8 KV cache, three engines per GPU, without MPS: `VLLM_FP8_X3_STREAMS_PER_ACTOR`, 18.
  Without MPS the engines' kernels take turns and an engine is slower than with it (112
  aged sessions made 9.58 frames/s without MPS and 12.15 with it, 2026-12-03), so its
  budget is never above the MPS one. Not measured by the strict rule; the lenient run
  (2026-12-02) held 104 at 12.0 frames/s.
- Four or more engines per GPU: each has less KV cache than was measured, so the bf16
  figure stays, and an operator sets `engine.streams_per_actor` from their own run.

New sessions reach ≥ 128 per GPU (64 per engine), so the aged knee is the budget.

Under review (issue 34): the bf16 and two-engine fp8 figures were judged by 12.0 frames/s
(96 % of real time) over 7-43 s windows and are not yet re-measured by the strict rule (one
fp8 engine is, on an H100 only, above); vLLM's stock path on the same three engines kept
44 of 66 new sessions up (2026-12-04): at the levels measured, an engine that kept every
session up carried 20-33 aged project sessions or 22 new stock ones, and in both 100/66
runs one engine of the three did not. No knee is measured for either yet, so no ratio is
claimed.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import EventConfig
    from workers.engines.calibrate import Calibration
    from workers.engines.embedded import EmbeddedEngineOptions

log = logging.getLogger(__name__)

REALTIME_STREAMS_PER_CORE = {"whisper-base": 1.5, "tiny.en": 3.0}
VLLM_STREAMS_PER_ACTOR = 18
VLLM_FP8_STREAMS_PER_ACTOR = 36
VLLM_FP8_X3_STREAMS_PER_ACTOR = 18
VLLM_FP8_X3_MPS_STREAMS_PER_ACTOR = 18
VLLM_FP8_X3_MPS_ALIGNED_STREAMS_PER_ACTOR = 22
ALIGNED_FEED_MS = 80
"""`engine.vllm.aligned_feed_ms` where the event leaves it out (the tick the budget above
was measured with)."""
SENTENCE_ENGINES = ("bergamot", "apertium")
SENTENCE_PAIRS_PER_TRANSLATOR = 100
"""Stream-target pairs to plan per translator actor where the embedded sentence engines
translate them (each actor translates on one core). The first whole-product run with vLLM
(bench/results/product, 2026-12-05, an H100's 16-core host) left its one translator
(Bergamot en→pt) a minute behind at 45 pairs of random text written at 4.2 times the
reference talk's 11.6 characters a second: ~2,200 characters a second, the text of ~190
talks. On the 2-core box (a one-off check, 2026-12-05: the reference talk's sentences
translated 8 times over, one at a time and in batches of 32) Bergamot took 3,800-4,700
characters a CPU second and Apertium 7,600 in batches. 100 is about half the lowest."""


def vllm_streams_per_actor(vllm: object) -> int:
    """The measured aged knee per engine for an event file's `engine.vllm` section (a
    mapping, or None for the defaults), read before validation."""
    section = vllm if isinstance(vllm, dict) else {}
    engines = section.get("engines_per_gpu", 1)
    if section.get("kv_cache_dtype") == "fp8" and isinstance(engines, int):
        if engines <= 2:
            return VLLM_FP8_STREAMS_PER_ACTOR
        if engines == 3:
            if section.get("cuda_mps") is not True:
                return VLLM_FP8_X3_STREAMS_PER_ACTOR
            aligned = section.get("aligned_feed_ms", ALIGNED_FEED_MS)
            return (VLLM_FP8_X3_MPS_ALIGNED_STREAMS_PER_ACTOR
                    if isinstance(aligned, int) and aligned > 0
                    else VLLM_FP8_X3_MPS_STREAMS_PER_ACTOR)
    return VLLM_STREAMS_PER_ACTOR


def default_streams_per_actor(model: str, cpu_threads: int, actors: int,
                              cores: int | None = None) -> int:
    """Streams per actor that the host's cores keep in real time for `model` (at least 1)."""
    host = cores if cores is not None else (os.cpu_count() or 1)
    usable = max(1, min(cpu_threads, host // max(1, actors)))
    per_core = REALTIME_STREAMS_PER_CORE.get(model, REALTIME_STREAMS_PER_CORE["whisper-base"])
    return max(1, math.floor(per_core * usable))


def calibrated_streams_per_actor(options: EmbeddedEngineOptions, actors: int,
                                 cores: int | None = None) -> int:
    """Streams per actor for an embedded engine with `calibrate` on (`engine.calibrate:
    true`, `streams_per_actor` unset): the figure this host measured for these engine
    options, else `default_streams_per_actor`'s per-core constant.

    The figure is `workers.engines.calibrate`'s: each actor measures at start how many
    streams its engine keeps in real time here and caches it (`calibrate.cache_path()`:
    `$XDG_CACHE_HOME/babelcast/calibration.json`, else `~/.cache/...`) under a key of the
    CPU, the runtime and the options that set one stream's decode work. Here it is only
    read (`calibrate.cached`, no model load), and it is already per actor (one engine's
    decode thread). It is the cache of the host that loads the event file: an event whose
    actors run there takes, from its second start, what its first measured; until then
    (or once the figure is older than `calibrate.MAX_AGE_S`, or for options never measured
    here) the constant stands. The figure was measured with the engine alone on the host;
    actors sharing its cores each keep fewer."""
    from workers.engines.calibrate import cache_path, cached

    hit = cached(options)
    if hit is not None:
        log.info("streams_per_actor %d: calibrated on this host (%s)", hit.streams,
                 cache_path())
        return hit.streams
    return default_streams_per_actor(options.model, options.cpu_threads, actors, cores)


def over_capacity(cfg: EventConfig) -> str | None:
    """A warning where the event's streams are more than the embedded default says this
    host carries (EventConfig raised the budget to fit them), else None."""
    e = cfg.engine
    carries = e._host_carries
    if carries is None:
        return None
    how = "measured on this host" if e.calibrate else "estimated from its cores"
    return (f"{len(cfg.streams)} streams on {e.actors} ASR actor(s) is more than this host "
            f"keeps in real time ({carries} per actor, {how}): captions may fall behind. "
            "Run actors on more hosts (ray.address, engine.actors), or set "
            "engine.streams_per_actor to take the load on purpose")


def translation_over_capacity(cfg: EventConfig) -> str | None:
    """A warning where the event has more stream-target pairs on the embedded sentence
    engines than its translator actors are planned for (`SENTENCE_PAIRS_PER_TRANSLATOR`
    each), else None. Pairs routed to an LLM backend are not counted: their capacity is the
    server's."""
    routes = cfg.translation.routing
    pairs = sum(1 for s in cfg.streams for t in s.targets
                if routes.concrete_for(s.language, t) in SENTENCE_ENGINES)
    need = math.ceil(pairs / SENTENCE_PAIRS_PER_TRANSLATOR)
    if need <= cfg.translation.actors:
        return None
    return (f"{pairs} stream-target pairs on the embedded translators with "
            f"translation.actors {cfg.translation.actors}: plan about "
            f"{SENTENCE_PAIRS_PER_TRANSLATOR} per actor (each translates on one core; one "
            "fell a minute behind at the text of ~190 talks, docs/gpu.md): set "
            f"translation.actors to {need} or more, or route pairs to an LLM backend")


def needs_measuring(cfg: EventConfig) -> EmbeddedEngineOptions | None:
    """The engine options to measure before planning: an embedded event with `calibrate`
    on, no `streams_per_actor` of its own, actors on this host (no `ray.address`: another
    cluster's hosts measure themselves) and no figure cached for these options here."""
    from workers.engines.calibrate import cached

    e = cfg.engine
    if (e.kind != "embedded" or not e.calibrate or "streams_per_actor" in e.model_fields_set
            or cfg.ray.address is not None):
        return None
    options = e.embedded_options()
    return options if cached(options) is None else None


async def measure_before_planning(options: EmbeddedEngineOptions) -> Calibration:
    """Start an engine with `options` here, measure this host and cache the figure (the
    actors then read it instead of measuring at their own start), and close it."""
    from workers.engines.calibrate import calibration
    from workers.engines.embedded import EmbeddedWhisperEngine

    engine = EmbeddedWhisperEngine(options)
    await engine.start()  # with options.calibrate (needs_measuring's), start() measures
    try:
        return engine.calibration or await calibration(engine)
    finally:
        await engine.aclose()
