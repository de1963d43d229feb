"""The ladder and its knee: every configuration at each level, rounds in a rotated order,
climbing until its first miss; then the project's configurations on aged sessions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.capacity.ageing import AGE_BULK
from bench.capacity.configs import engines_of, front_end_streams
from bench.capacity.frontend import FrontEnd
from bench.capacity.host import host_fingerprint
from bench.capacity.orchestrate import run_config
from bench.capacity.report import (
    _median_row,
    kv_summary,
    summarize_profiles,
    torch_trace_dir,
)
from workers.engines.vllm.engine import VllmEngineOptions

REALTIME_SHARE = 0.95


def knees(levels: dict[int, dict[str, list[dict[str, Any]]]], configs: list[str]
          ) -> dict[str, int | None]:
    """Per configuration, the largest level whose median real-time share over rounds is
    ≥ 95 % with every lower level also passing."""
    out: dict[str, int | None] = {}
    for c in configs:
        knee = None
        for n in sorted(levels):
            rounds = levels[n].get(c)
            if not rounds or statistics.median(r["realtime_share"] for r in rounds) \
                    < REALTIME_SHARE:
                break
            knee = n
        out[c] = knee
    return out


def knee_ratios_at_least(found: dict[str, int | None], ladder: list[int]
                         ) -> dict[str, float | None]:
    """Per project configuration, a floor under its knee's ratio to stock's. A knee at the
    ladder's top only says "at least", and a stock path that missed the ladder's first
    level held fewer sessions than that level: then the ratio is more than knee / first
    level, where `knee_ratio_vs_stock` can say nothing."""
    base = found.get("stock")
    floor = base if base else (min(ladder) if "stock" in found and ladder else None)
    return {c: (round(v / floor, 3) if v and floor else None)
            for c, v in found.items() if c != "stock"}


def rotated(configs: list[str], k: int) -> list[str]:
    k %= len(configs)
    return configs[k:] + configs[:k]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    configs = list(args.configs)
    ladder = sorted(args.ladder) if args.find_knee else [args.streams]
    multi = max((engines_of(c) for c in configs if engines_of(c) > 1), default=0)
    shared = bool(args.share_front_end and multi)
    need_main = any(engines_of(c) == 1 for c in configs) and not shared
    engines = (1 if need_main else 0) + multi
    top = max([*ladder, *(args.aged_ladder or [])])
    age_frames = (int(args.age_min[0] * 60 / 0.08) // AGE_BULK * AGE_BULK
                  if args.age_min else 0)
    partial_path = Path(args.partial) if args.partial else None
    FrontEnd.age_concurrency = args.age_concurrency
    progress: list[dict[str, Any]] = []

    async def run(fronts: dict[int, FrontEnd], config: str, n: int, seconds: float,
                  **kw: Any) -> dict[str, Any]:
        """run_config, with a line on stderr and the rows so far in --partial."""
        t_wall = time.time()
        try:
            row = await run_config(fronts, config, n, seconds, shared=shared,
                                   production=args.production, **kw)
        except Exception as exc:
            if args.kv_trace:  # where the KV cache was when it failed (ageing stuck)
                exc.add_note(json.dumps({"kv": kv_summary(args.kv_trace, t_wall,
                                                          time.time())}))
            raise
        if args.kv_trace:  # ageing feeds 768-frame prompts: its peak is not the steady one
            t_aged = t_wall + (row.get("aged_in_s") or 0.0)
            row["kv"] = kv_summary(args.kv_trace, t_aged, time.time())
            if row.get("aged_in_s"):
                row["kv_ageing"] = kv_summary(args.kv_trace, t_wall, t_aged)
        progress.append(row)
        print(json.dumps({k: row.get(k) for k in ("config", "streams", "feed",
                          "realtime_share", "frames_per_s_p50", "front_end_us_per_chunk",
                          "engine_core_us_per_chunk", "helpers_us_per_chunk",
                          "gpu_util_p50", "aged_in_s")}), file=sys.stderr, flush=True)
        if partial_path is not None:
            partial_path.write_text(json.dumps(progress))
        return row

    def opts(streams: int, f: int) -> VllmEngineOptions:
        torch_dir = torch_trace_dir(args.profile_dir, args.gpu_profile, f)
        if torch_dir:
            Path(torch_dir).mkdir(parents=True, exist_ok=True)
        return VllmEngineOptions(
            model=args.model, max_streams=streams, max_model_len=args.max_model_len,
            load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
            gpu_memory_utilization=round(args.gpu_memory_utilization / engines, 3),
            torch_profiler_dir=torch_dir, kv_bound_slots=False)


    wanted = ([0] if need_main else []) + list(range(1, multi + 1))
    fronts: dict[int, FrontEnd] = {}
    started: dict[int, Any] = {}
    try:
        for f in wanted:  # one at a time: vLLM profiles free memory while it starts
            fronts[f] = FrontEnd(f, opts(front_end_streams(f, configs, top, shared), f))
            started[f] = await fronts[f].ready()
        direct_ok = all(started[f].get("direct_check", {}).get("equal") for f in started)
        if not direct_ok:
            dropped = [c for c in configs if "direct" in c]
            configs = [c for c in configs if "direct" not in c]
        else:
            dropped = []
        for c in configs:  # warm every configuration at the first level
            await run(fronts, c, ladder[0], min(8.0, args.seconds))
        levels: dict[int, dict[str, list[dict[str, Any]]]] = {}
        alive = list(configs)
        k = 0
        for n in ladder:
            levels[n] = {c: [] for c in alive}
            for _ in range(args.rounds):
                for c in rotated(alive, k):
                    profile = args.profile_dir if n == args.profile_level else None
                    levels[n][c].append(await run(fronts, c, n, args.seconds,
                                                  profile_dir=profile))
                k += 1
            alive = [c for c in alive if statistics.median(
                r["realtime_share"] for r in levels[n][c]) >= REALTIME_SHARE]
            if not alive:
                break
        # Sessions aged `--age-min` (bulk-fed, re-anchoring as in production), once per
        # level, for the project's configurations, climbing until the first miss.
        aged: dict[int, dict[str, dict[str, Any]]] = {}
        aged_alive = [c for c in configs if c != "stock"] if age_frames else []
        for n in sorted(args.aged_ladder or []):
            aged[n] = {}
            if args.aged_ab and aged_alive:  # one phase, the levers switched in it
                try:
                    row = await run(fronts, aged_alive[0], n, args.seconds,
                                    age_frames=age_frames, ab=aged_alive,
                                    windows=args.ab_windows)
                    for c, r in row["ab"].items():
                        aged[n][c] = {**r, "aged_in_s": row["aged_in_s"], "feed": row["feed"],
                                      **({"kv": row["kv"]} if "kv" in row else {})}
                except Exception as exc:
                    for c in aged_alive:
                        aged[n][c] = {"realtime_share": 0.0, "error": f"{exc}"[:300]}
                    print(json.dumps({"aged": n, "ab": aged_alive, "error": f"{exc}"[:300]}),
                          file=sys.stderr, flush=True)
            for c in ([] if args.aged_ab else aged_alive):
                try:
                    aged[n][c] = await run(fronts, c, n, args.seconds, age_frames=age_frames,
                                           profile_dir=args.profile_dir
                                           if n == args.profile_level else None)
                except Exception as exc:  # e.g. ageing stuck: no KV cache for the sessions
                    notes = [json.loads(x) for x in getattr(exc, "__notes__", [])]
                    aged[n][c] = {"realtime_share": 0.0, "error": f"{exc}"[:300],
                                  **({"kv": notes[0]["kv"]} if notes else {})}
                    print(json.dumps({"aged": n, "config": c, "error": f"{exc}"[:300],
                                      **({"kv": notes[0]["kv"]} if notes else {})}),
                          file=sys.stderr, flush=True)
            aged_alive = [c for c in aged_alive
                          if aged[n][c]["realtime_share"] >= REALTIME_SHARE]
            if not aged_alive:
                break
    finally:
        for fe in fronts.values():
            await fe.stop()
    found = knees(levels, configs)
    summary = {n: {c: _median_row(rows) for c, rows in by.items()} for n, by in levels.items()}
    base = found.get("stock")
    return {
        "host": host_fingerprint(),
        "vllm_version": next(iter(started.values())).get("vllm_version"),
        "front_ends": {f: {k2: v for k2, v in s.items() if k2 != "ready"}
                       for f, s in started.items()},
        "configs": configs, "dropped_configs": dropped, "ladder": ladder,
        "seconds": args.seconds, "rounds": args.rounds,
        "gpu_memory_utilization_per_engine": round(args.gpu_memory_utilization / engines, 3),
        "kv_cache_dtype": args.kv_cache_dtype,
        "feed": "production" if args.production else "plain",
        "max_model_len": args.max_model_len,
        "shared_front_end": shared,
        "knee": found,
        "knee_ratio_vs_stock": {c: (round(v / base, 3) if v and base else None)
                                for c, v in found.items() if c != "stock"},
        "knee_ratio_vs_stock_at_least": knee_ratios_at_least(found, ladder),
        "by_level": summary,
        "rounds_raw": levels,
        "age_min": args.age_min[0] if age_frames else None,
        "aged_knee": knees({n: {c: [r] for c, r in by.items()} for n, by in aged.items()},
                           [c for c in configs if c != "stock"]) if aged else None,
        "aged_by_level": aged,
        "profiles": summarize_profiles(args.profile_dir) if args.profile_dir else None,
    }
