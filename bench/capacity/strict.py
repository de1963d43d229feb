"""One level of one configuration on one GPU, judged by the keep-up rule (issue 34).

    python -m bench.capacity.strict --model DIR --config project-direct-x3+melspec+tokens+keys \\
        --streams 110 --seconds 300 --age-min 12 --production --kv-cache-dtype fp8 \\
        --gpu-memory-utilization 0.9 --load-format babelcast_scaled --out FILE
    python -m bench.capacity.strict --model DIR --config stock-x3 --streams 74 ...

A device call is at most 10 minutes, ageing and engine starts included, so one call
measures one level: the knee is read across calls (bench/capacity/rule.py `knee`, the
tables in bench/capacity/render.py).

What it does:
- starts the configuration's engines, one process each (bench/capacity/frontend.py's
  front ends), each with `--gpu-memory-utilization / engines` of the GPU: `project…-xN` runs
  the project's engine (re-anchoring plugin, the levers its name lists); `stock-xN` runs
  vLLM as its own realtime server path does (`transcribe_realtime`, no plugin, no
  direct input, no levers, rolled over by the client at max_model_len), N engines with
  the same memory share as the project configuration it is compared with;
- project sessions are aged `--age-min` minutes through bulk steps (bench/capacity/ageing.py),
  each with one more step of its share of a re-anchor cycle (`--stagger-every`, the
  engine's `reanchor_every`), so their ages spread evenly over the cycle and re-anchors
  happen throughout the measured phase (counted: `reanchors_in_phase`), and the model's
  own last token fed back at every step; stock sessions start new (its best case: the
  shortest KV and token history);
- adds `--controls` negative-control sessions fed at `--control-speed` of real time
  (on the first engine, beyond `--streams`): the rule must fail them, or the run says
  `instrument_ok: false`;
- feeds every session 80 ms of speech every 80 ms, at its own place in the 80 ms cycle
  (`--arrivals spread`; `lockstep` puts every session's chunk at the same instant, as
  runs before the last of 2026-12-04 did), for `--warm` + `--seconds`, the phase
  cut short only to end by `--deadline-s` after start (then `phase_long_enough` is false
  and the level does not pass);
- reads, per engine, the plugin worker's step counts over the window (stock has none):
  `steps_per_s`, `requests_per_step` and its p10/p50/p90 (from `step_sizes`, the steps by
  how many requests each carried), and `step_gaps_ms` (the time between steps, in 5 ms
  bins) inside `reanchors_in_phase`: how the engine core batched the sessions' chunks;
  and `tick_arrivals_within_ms`, the share of chunks the scheduler saw within 5-40 ms of
  their tick's first (what a gather window of that length would hold for);
- judges each session by the rule and writes the stamped JSON (results.py) to `--out`
  and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.capacity import results, rule  # noqa: E402
from bench.capacity.phase import ARRIVALS, SERIES_S  # noqa: E402

KIND = "capacity_strict"
MARK_SLACK_S = 2.0
"""Seconds fed past `--warm` + `--seconds`: the measured window opens after the warm-up
*and* a read of the engine's re-anchor counters, so without this slack it came out a
little under `--seconds` and the rule (>= 300 s) refused a level for 0.4 s."""


def age_frames_of(args: argparse.Namespace) -> int:
    """Frames each project session is aged before the phase, in whole bulk steps (768);
    stock sessions start new."""
    return 0 if is_stock(args.config) else int(args.age_min * 60 / 0.08) // 768 * 768


def is_stock(config: str) -> bool:
    from bench.capacity.configs import base_of

    return base_of(config).split("-x")[0] == "stock"


def shares(n: int, engines: int) -> list[int]:
    return [n // engines + (1 if i < n % engines else 0) for i in range(engines)]


def profile_path(args: argparse.Namespace, f: int) -> str | None:
    """Front end f's py-spy profile over the measured window (`--profile-dir`)."""
    if not args.profile_dir:
        return None
    return str(Path(args.profile_dir) / f"{args.config.replace('+', '_')}-{args.streams}-fe{f}.txt")


def engine_options(args: argparse.Namespace, engines: int, streams: int, f: int = 1) -> Any:
    from bench.capacity.report import torch_trace_dir
    from workers.engines.vllm.options import VllmEngineOptions

    stock = is_stock(args.config)
    extra: dict[str, Any] = ({"reanchor": "off", "direct_input": "off",
                              "sync_free_melspec": False, "incremental_token_writes": False,
                              "window_trim": False} if stock else {})
    return VllmEngineOptions(
        model=args.model, max_streams=streams, max_model_len=args.max_model_len,
        load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=round(args.gpu_memory_utilization / engines, 3),
        kv_bound_slots=False, reanchor_every=args.stagger_every,
        kv_cache_memory_bytes=(int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None),
        torch_profiler_dir=torch_trace_dir(args.profile_dir, args.gpu_profile, f),
        aligned_feed_ms=0 if stock else args.aligned_feed_ms, **extra)


def summarize(config: str, n: int, answers: list[dict[str, Any]], util: list[float],
              stagger_every: int) -> dict[str, Any]:
    sessions = [s for a in answers for s in a["sessions"]]
    controls = [c for a in answers for c in a.get("controls", [])]
    window = min(a["window_s"] for a in answers)
    verdict = rule.phase_verdict(sessions, window, controls)
    counted = add_counts([a.get("reanchors_in_phase") or {} for a in answers])
    by_fe = []
    for f, a in enumerate(answers, start=1):
        v = rule.phase_verdict(a["sessions"], a["window_s"], a.get("controls", []))
        by_fe.append({"front_end": f, **{k: v[k] for k in (
            "sessions", "keep_up", "keep_up_share", "frames_per_s_p50", "frames_per_s_min",
            "backlog_p99_s_max", "backlog_growth_s_max")},
            "engine_core_us_per_chunk": round(a["engine_core_us_per_chunk"], 1),
            "front_end_us_per_chunk": round(a["front_end_us_per_chunk"], 1),
            "helpers_us_per_chunk": round(a["helpers_us_per_chunk"], 1),
            "aged_in_s": a.get("aged_in_s"), "window_s": a["window_s"],
            "seconds_planned": a.get("seconds_planned"), "seconds_fed": a.get("seconds_fed"),
            "reanchors_in_phase": a.get("reanchors_in_phase"),
            **step_rate(a.get("reanchors_in_phase") or {}, a["window_s"]),
            "stock_rollovers": a.get("stock_rollovers"),
            "age_tails_frames": a.get("age_tails_frames"),
            "backlog_series": a.get("backlog_series")})
    tails = [t for a in answers for t in a.get("age_tails_frames") or []]
    return {
        "config": config, "streams": n, "verdict": verdict,
        "knee_at_this_level": rule.knee({n: verdict}),
        "reanchors_in_phase": counted or None,
        "stagger": ({"every": stagger_every, "tail_frames_min": min(tails),
                     "tail_frames_max": max(tails), "distinct_places": len(set(tails))}
                    if tails else None),
        "gpu_util_p50": round(statistics.median(util), 1) if util else None,
        "by_front_end": by_fe,
        "sessions": sessions,
        "controls": controls,
    }


def add_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The engines' counts in the phase, added: numbers summed, histograms (`step_sizes`,
    `step_gaps_ms`) and the gather's counts summed key by key; its window (`window_ms`) is
    a setting, not a count: the largest is kept."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, dict):
                out[k] = add_counts([out.get(k) or {}, v])
            elif k == "window_ms":
                out[k] = max(out.get(k) or 0, v or 0)
            else:
                out[k] = out.get(k, 0) + int(v)
    return out


def step_rate(counted: dict[str, Any], window_s: float) -> dict[str, Any]:
    """Engine steps per second in the window and requests per step (the plugin worker's
    counts; stock has no plugin: none): an engine whose sessions' chunks do not arrive
    together takes more, smaller steps for the same audio."""
    steps = int(counted.get("steps") or 0)
    if not steps or window_s <= 0:
        return {"steps_per_s": None, "requests_per_step": None}
    out: dict[str, Any] = {
        "steps_per_s": round(steps / window_s, 1),
        "requests_per_step": round(int(counted.get("step_requests") or 0) / steps, 2)}
    sizes = counted.get("step_sizes")
    if sizes:  # how the steps split the requests: the quantiles of steps by their size
        order = sorted((int(k), int(v)) for k, v in sizes.items())
        total = sum(v for _, v in order)
        for q in (0.1, 0.5, 0.9):
            seen = 0
            for size, n in order:
                seen += n
                if seen >= q * total:
                    out[f"requests_per_step_p{round(q * 100)}"] = size
                    break
    out.update(arrival_shares(counted.get("tick_arrivals") or {}))
    return out


ARRIVAL_WINDOWS_MS = (5, 10, 20, 40)


def arrival_shares(arrivals: dict[str, Any]) -> dict[str, Any]:
    """The share of chunks the scheduler saw within 5, 10, 20 and 40 ms of their tick's
    first (`tick_arrivals`, gather.py): what a gather window of that length would hold a
    tick's first step for. Read as arrivals only with the gather on (held steps leave the
    engine idle); without it, a chunk that came during a step is seen after the step."""
    hist = {int(k): int(v) for k, v in (arrivals.get("offset_ms") or {}).items()}
    total = sum(hist.values())
    if not total:
        return {}
    return {"tick_arrivals_within_ms": {
        str(w): round(sum(v for k, v in hist.items() if k < w) / total, 3)
        for w in ARRIVAL_WINDOWS_MS}}


STOP_S = 20.0
"""Each engine's stop is bounded by this, all side by side: the 2026-12-04 run's three
engines stopped one after another (up to 90 s each) past the call's limit, and the call
was killed before it wrote a result."""


async def stop_all(fronts: dict[int, Any]) -> None:
    async def one(fe: Any) -> None:
        try:
            await asyncio.wait_for(fe.stop(), STOP_S)
        except (TimeoutError, Exception):
            proc = getattr(fe, "proc", None)
            if proc is not None and proc.is_alive():
                proc.kill()

    await asyncio.gather(*(one(fe) for fe in fronts.values()))


async def main_async(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    """The stamped result; written to `--out` before the engines are stopped, so a call
    that runs out of time while they stop keeps its measurement."""
    from bench.capacity.configs import engines_of
    from bench.capacity.frontend import FrontEnd
    from bench.capacity.host import _gpu_util

    t_start = time.time()
    deadline = t_start + args.deadline_s if args.deadline_s else None
    config, n = args.config, args.streams
    engines = engines_of(config)
    stock = is_stock(config)
    share = shares(n, engines)
    fronts: dict[int, FrontEnd] = {}
    started: dict[int, Any] = {}
    age_frames = age_frames_of(args)
    FrontEnd.age_concurrency = args.age_concurrency
    levers = levers_for(args)
    try:
        # one at a time, as vLLM profiles free memory while it starts; side by side when
        # each engine's KV cache has a given size (--kv-cache-gib): nothing to profile
        for f in range(1, engines + 1):
            k = share[f - 1] + (args.controls if f == 1 else 0)
            fronts[f] = FrontEnd(f, engine_options(args, engines, k, f))
            if not args.kv_cache_gib:
                started[f] = await fronts[f].ready()
        if args.kv_cache_gib:
            ready = await asyncio.gather(*(fronts[f].ready() for f in sorted(fronts)))
            started = dict(zip(sorted(fronts), ready, strict=True))
        print(json.dumps({"engines_started_s": round(time.time() - t_start, 1)}),
              file=sys.stderr, flush=True)
        feed = ("plain" if stock else
                ("aged-production" if args.production else "aged") if age_frames else
                ("production" if args.production else "plain"))
        path = "stock" if stock else ("direct" if "direct" in config else "project")
        stop = asyncio.Event()
        util: list[float] = []
        stamps: list[float] = []
        util_task = asyncio.create_task(_gpu_util(stop, util, stamps))
        firsts = [sum(share[:i]) for i in range(engines)]
        # every engine's real-time feed starts together, once all have aged: an engine
        # that finished ageing first began its warm-up while the others' bulk ageing steps
        # held the GPU, and entered the window seconds behind (2026-12-04, 75 sessions:
        # engine 1 3.3 s behind at the window's start, the other two 0.08 s)
        together = asyncio.Barrier(engines) if age_frames else None
        answers = await asyncio.gather(*(
            # _phase feeds warm-up + window: the window is `--seconds` after the warm-up.
            # Its start waits for the engine's counters, so the feed runs MARK_SLACK_S
            # longer: the 60-session run of 2026-12-04 measured 299.6 s of its 300.
            fronts[f].phase(path, share[f - 1], args.seconds + args.warm + MARK_SLACK_S,
                            firsts[f - 1],
                            feed, age_frames, profile_path(args, f),
                            melspec=levers["melspec"] and not stock,
                            tokens=levers["tokens"] and not stock,
                            trim=(levers["trim"] if not stock else False),
                            gather=(levers["gather"] if not stock else 0.0),
                            strict=True, controls=args.controls if f == 1 else 0,
                            control_speed=args.control_speed,
                            stagger=({"total": n, "every": args.stagger_every}
                                     if age_frames and args.stagger_every else None),
                            own_tokens=True, warm_s=args.warm, deadline=deadline,
                            barrier=together, arrivals=args.arrivals)
            for f in range(1, engines + 1)), return_exceptions=True)
        stop.set()
        await util_task
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            raise RuntimeError("; ".join(f"{e}" for e in failed))
        result = results.stamp(summary(args, answers, util, stamps, started, t_start), command)
        if args.out:
            results.save(result, args.out)
        return result
    finally:
        await stop_all(fronts)


def util_series(util: list[float], stamps: list[float], t0: float,
                every_s: float = SERIES_S) -> list[list[float]]:
    """nvidia-smi's GPU busy share (sampled every second) from `t0` on, as [seconds after
    t0, mean %] every `every_s`: beside each engine's `backlog_series`, so a fall behind can
    be read against what the GPU did then."""
    buckets: dict[int, list[float]] = {}
    for u, t in zip(util, stamps, strict=True):
        if t >= t0:
            buckets.setdefault(int((t - t0) // every_s), []).append(u)
    return [[k * every_s, round(sum(v) / len(v), 1)] for k, v in sorted(buckets.items())]


def summary(args: argparse.Namespace, answers: list[Any], util: list[float],
            stamps: list[float], started: dict[int, Any], t_start: float) -> dict[str, Any]:
    from bench.capacity.configs import engines_of
    from bench.capacity.host import host_fingerprint

    config, n = args.config, args.streams
    levers = levers_for(args)
    engines = engines_of(config)
    stock = is_stock(config)
    ok = [a for a in answers if isinstance(a, dict)]
    age_frames = age_frames_of(args)
    aged_s = max((a.get("aged_in_s") or 0.0) for a in ok)
    t_measured = min(stamps) + aged_s + args.warm if stamps else 0.0
    series = util_series(util, stamps, t_measured)
    util = [u for u, t in zip(util, stamps, strict=True) if t >= t_measured] or util
    first = next(iter(started.values()))
    return {
        "kind": KIND,
        "host": host_fingerprint(),
        "vllm_version": first.get("vllm_version"),
        "realtime_rule": rule.RULE,
        **summarize(config, n, ok, util, args.stagger_every if age_frames else 0),
        "gpu_util_series": series,
        "engines": engines,
        "stock": stock,
        "feed": "plain (vLLM's transcribe_realtime)" if stock else (
            "aged-production" if age_frames and args.production else
            "aged" if age_frames else "production" if args.production else "plain"),
        "age_min": 0 if stock else args.age_min,
        "own_tokens_fed_back": True,
        "arrivals": args.arrivals,
        "aligned_feed_ms": 0 if stock else args.aligned_feed_ms,
        "warm_s": args.warm, "seconds_asked": args.seconds,
        "gpu_memory_utilization_per_engine": round(args.gpu_memory_utilization / engines, 3),
        "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
        "load_format": args.load_format, "kv_cache_gib": args.kv_cache_gib,
        "levers": {} if stock else levers,
        "front_ends": {f: {k: v for k, v in s.items() if k != "ready"}
                       for f, s in started.items()},
        **profiling(args, ok),
        "wall_s": round(time.time() - t_start, 1),
    }


def profiling(args: argparse.Namespace, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What profiled the window, and the summaries: py-spy's (nonblocking, every front end
    and its engine core, the whole window) and vLLM's torch profiler (its last
    GPU_PROFILE_S, which slows the engine while it runs: a level judged with `--gpu-profile`
    is marked so)."""
    if not args.profile_dir:
        return {"profiled": None}
    from bench.capacity.report import gpu_profiles, summarize_profiles

    out: dict[str, Any] = {"profiled": {"py_spy": True, "torch": bool(args.gpu_profile)},
                           "profiles": summarize_profiles(args.profile_dir)}
    if args.gpu_profile:
        out["gpu_profile"] = gpu_profiles({f"fe{f}": a.get("gpu_trace")
                                           for f, a in enumerate(answers, start=1)})
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.capacity.configs import CONFIGS

    stock_xn = [f"stock-x{k}" for k in (2, 3, 4)]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", required=True, choices=[*CONFIGS, *stock_xn])
    ap.add_argument("--streams", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=rule.MIN_PHASE_S,
                    help="measured phase after --warm (the rule wants >= 300)")
    ap.add_argument("--warm", type=float, default=30.0,
                    help="seconds fed before the measured window starts (the H200's first "
                         "run, 10 s: 110 aged sessions began the window 1.0-2.1 s behind)")
    ap.add_argument("--age-min", type=float, default=12.0,
                    help="project sessions' age before the phase (minutes of audio)")
    ap.add_argument("--stagger-every", type=int, default=4096,
                    help="the re-anchor cycle (positions) ages are spread over; 0: same age")
    ap.add_argument("--controls", type=int, default=1)
    ap.add_argument("--control-speed", type=float, default=0.97)
    ap.add_argument("--production", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--load-format", default="babelcast_scaled")
    ap.add_argument("--age-concurrency", type=int, default=8)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV cache, fixed (vLLM's kv_cache_memory_bytes): the "
                         "engines then start side by side (2026-12-03: ~30.4 GiB each at 0.3 "
                         "of the H200, profiled)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the feed ends by this many seconds after start (device calls)")
    ap.add_argument("--out", default=None, help="write the stamped JSON here too")
    ap.add_argument("--arrivals", default="spread", choices=ARRIVALS,
                    help="where in the 80 ms cycle sessions' chunks arrive: spread evenly, "
                         "as independent encoders' do, or all at once (runs before "
                         "2026-12-04's last: a best case)")
    ap.add_argument("--aligned-feed-ms", type=int, default=0,
                    help="project engines hand caught-up sessions' chunks to the model on "
                         "one shared tick (engine option aligned_feed_ms); 0: as they arrive")
    ap.add_argument("--profile-dir", default=None,
                    help="py-spy every front end and engine core over the window (raw "
                         "profiles here, summaries in the JSON's `profiles`)")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="with --profile-dir: vLLM's torch profiler over the window's last "
                         "seconds too (it slows the engine then; the JSON says `profiled`)")
    ap.add_argument("--gather-ms", type=float, default=None,
                    help="with a +gather configuration: the tick gather's window in ms "
                         "(0 < ms <= 40; default configs.GATHER_MS). At 48 aged sessions on "
                         "one H100 engine the 5 ms window ran out in 99.7 %% of ticks "
                         "(bench/results/capacity_h100)")
    args = ap.parse_args(argv)
    if args.gather_ms is not None:
        from bench.capacity.configs import GATHER
        from workers.engines.vllm.reanchor.gather import MAX_WINDOW_MS

        if GATHER not in args.config:
            ap.error(f"--gather-ms needs a {GATHER} configuration, not {args.config}")
        if not 0 < args.gather_ms <= MAX_WINDOW_MS:
            ap.error(f"--gather-ms must be in (0, {MAX_WINDOW_MS:g}], not {args.gather_ms}")
    return args


def levers_for(args: argparse.Namespace) -> dict[str, Any]:
    """The levers the configuration's phases run, with `--gather-ms` as the gather's
    window where it is given (a `+gather` configuration's default is configs.GATHER_MS)."""
    from bench.capacity.configs import levers_of

    levers = levers_of(args.config)
    if getattr(args, "gather_ms", None) is not None:
        levers["gather"] = args.gather_ms
    return levers


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bench.capacity.configs import engines_of
    from bench.capacity.report import torch_trace_dir

    for f in range(1, engines_of(args.config) + 1):  # the engine cores write there
        if where := torch_trace_dir(args.profile_dir, args.gpu_profile, f):
            Path(where).mkdir(parents=True, exist_ok=True)
    command = "python -m bench.capacity.strict " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    print(json.dumps(asyncio.run(main_async(args, command))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
