"""One phase of one configuration: its sessions split over the front ends that run it,
the GPU sampled, and the front ends' answers added up into the configuration's row
(and with an in-phase A/B, one row per configuration of its windows).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench.capacity.configs import ab_windows, feed_of, levers_of, plan
from bench.capacity.frontend import FrontEnd
from bench.capacity.host import _gpu_util
from bench.capacity.phase import WARM_S
from bench.capacity.report import gpu_profiles

REALTIME_FPS = 12.0


def ab_rows(configs: list[str], answers: list[dict[str, Any]], share: list[int],
            util: list[float], stamps: list[float]) -> dict[str, dict[str, Any]]:
    """Per configuration of an in-phase A/B, its windows' figures: each session's frames
    per second is the mean over the configuration's windows (the same sessions in every
    window), CPU per chunk the mean over them, GPU use the samples inside them."""
    rows: dict[str, dict[str, Any]] = {}
    n = sum(share)
    for idx, config in enumerate(configs):
        mine = [j for j in range(len(answers[0]["segments"])) if j % len(configs) == idx]
        fps = [statistics.fmean(a["segments"][j]["fps"][i] for j in mine)
               for a in answers for i in range(len(a["segments"][0]["fps"]))]
        spans = [(min(a["segments"][j]["t0"] for a in answers),
                  max(a["segments"][j]["t1"] for a in answers)) for j in mine]
        busy = [u for u, t in zip(util, stamps, strict=True)
                if any(t0 <= t <= t1 for t0, t1 in spans)]
        realtime = sum(1 for x in fps if x >= REALTIME_FPS)

        def per_chunk(key: str, mine: list[int] = mine) -> float:
            return round(sum(statistics.fmean(a["segments"][j][key] for j in mine) * k
                             for a, k in zip(answers, share, strict=True)) / n, 1)

        rows[config] = {
            "config": config, "streams": n, "realtime_streams": realtime,
            "realtime_share": round(realtime / n, 3),
            "frames_per_s_p50": round(statistics.median(fps), 2),
            "frames_per_s_min": round(min(fps), 2),
            "front_end_us_per_chunk": per_chunk("front_end_us_per_chunk"),
            "engine_core_us_per_chunk": per_chunk("engine_core_us_per_chunk"),
            "helpers_us_per_chunk": per_chunk("helpers_us_per_chunk"),
            "gpu_util_p50": round(statistics.median(busy), 1) if busy else None,
            "windows": [j + 1 for j in mine], "levers": answers[0]["segments"][mine[0]]["said"],
            "frames_per_s_p50_by_window": [round(statistics.median(
                [x for a in answers for x in a["segments"][j]["fps"]]), 2) for j in mine],
            # per front end (engine), in `answers` order: its sessions real time, and its p50
            "realtime_by_front_end": [
                sum(1 for i in range(len(a["segments"][0]["fps"]))
                    if statistics.fmean(a["segments"][j]["fps"][i] for j in mine)
                    >= REALTIME_FPS) for a in answers],
            "frames_per_s_p50_by_front_end": [
                round(statistics.median(statistics.fmean(a["segments"][j]["fps"][i]
                                                         for j in mine)
                                        for i in range(len(a["segments"][0]["fps"]))), 2)
                for a in answers],
            "engine_core_us_per_chunk_by_front_end": [
                round(statistics.fmean(a["segments"][j]["engine_core_us_per_chunk"]
                                       for j in mine), 1) for a in answers],
            **window_steps(answers, mine)}
    return rows


def window_steps(answers: list[dict[str, Any]], mine: list[int]) -> dict[str, Any]:
    """How a configuration's windows batched: its engines' steps per second of window
    (the mean engine), requests per step and their quantiles, and the engines' counts
    summed (`counted_in_windows`: steps, histograms, the tick gather's). Nothing where the
    engines count no steps (stock, or a worker from before the counts)."""
    from bench.capacity.strict import add_counts, step_rate

    counted = add_counts([a["segments"][j].get("counted") or {} for a in answers for j in mine])
    if not counted.get("steps"):
        return {}
    seconds = sum(statistics.fmean(a["segments"][j]["t1"] - a["segments"][j]["t0"]
                                   for a in answers) for j in mine)
    return {**step_rate(counted, seconds * len(answers)), "counted_in_windows": counted}


async def run_config(fronts: dict[int, FrontEnd], config: str, n: int, seconds: float,
                     *, shared: bool = False, production: bool = False,
                     age_frames: int = 0, profile_dir: str | None = None,
                     ab: list[str] | None = None, windows: int = 4) -> dict[str, Any]:
    """One phase of a configuration. With `ab` (configurations that differ only in their
    engine-core levers, `config` among them), the phase's sessions are measured in
    `windows` windows of `seconds`, the configurations' levers in turn, and the row
    carries each one's figures in `ab`."""
    parts = plan(config, shared)
    segments = ab_windows(ab, windows) if ab else None
    barrier = asyncio.Barrier(len(parts)) if ab else None
    levers = segments[0] if segments else levers_of(config)
    feed = feed_of(config, production, age_frames)
    tag = f"{config}-{n}{'-aged' if age_frames else ''}"
    stop = asyncio.Event()
    util: list[float] = []
    stamps: list[float] = []
    t_start = time.monotonic()
    util_task = asyncio.create_task(_gpu_util(stop, util, stamps))
    share = [n // len(parts) + (1 if i < n % len(parts) else 0) for i in range(len(parts))]
    firsts = [sum(share[:i]) for i in range(len(parts))]
    # Every front end's answer is read before anything fails: a phase left unread on a
    # pipe was read by the next phase's recv too, in a second thread, and the next
    # configuration failed with "Ran out of input" (H200, 2026-12-01), hiding its result.
    answers = await asyncio.gather(*(
        fronts[f].phase(p, k, seconds, first, feed, age_frames,
                        str(Path(profile_dir) / f"{tag.replace('+', '_')}-fe{f}.txt")
                        if profile_dir else None,
                        melspec=levers["melspec"], tokens=levers["tokens"],
                        trim=levers["trim"], gather=levers["gather"],
                        segments=segments, barrier=barrier,
                        pin=levers["pin"], pin_at=(slot, len(parts)))
        for slot, ((f, p), k, first) in enumerate(zip(parts, share, firsts, strict=True))),
        return_exceptions=True)
    stop.set()
    await util_task
    failed = [a for a in answers if isinstance(a, BaseException)]
    if failed:
        raise failed[0] if len(failed) == 1 else RuntimeError("; ".join(f"{e}" for e in failed))
    results: list[dict[str, Any]] = [a for a in answers if isinstance(a, dict)]
    # GPU use of the measured window only (not ageing, not warm-up)
    measured_from = t_start + max(r.get("aged_in_s", 0.0) for r in results) + WARM_S
    # the samples and their stamps stay pairs: the A/B's rows pick theirs by stamp (the
    # samples alone filtered here failed the first aged A/B on the H200, 2026-12-03)
    kept = [(u, t) for u, t in zip(util, stamps, strict=True) if t >= measured_from]
    if kept:
        util, stamps = [u for u, _ in kept], [t for _, t in kept]
    fps = [x for r in results for x in r["fps"]]
    backlog = sorted(x for r in results for x in r["backlog_s"])
    realtime = sum(1 for x in fps if x >= REALTIME_FPS)
    return {
        "config": config, "streams": n, "realtime_streams": realtime,
        "realtime_share": round(realtime / n, 3),
        "frames_per_s_p50": round(statistics.median(fps), 2),
        "frames_per_s_min": round(min(fps), 2),
        "backlog_p99_s": round(backlog[min(len(backlog) - 1, int(0.99 * len(backlog)))], 2),
        "front_end_us_per_chunk": round(sum(r["front_end_us_per_chunk"] * k for r, k in
                                            zip(results, share, strict=True)) / n, 1),
        "engine_core_us_per_chunk": round(sum(r["engine_core_us_per_chunk"] * k for r, k in
                                              zip(results, share, strict=True)) / n, 1),
        "helpers_us_per_chunk": round(sum(r["helpers_us_per_chunk"] * k for r, k in
                                          zip(results, share, strict=True)) / n, 1),
        "aged_in_s": max(r.get("aged_in_s", 0.0) for r in results),
        "fed_past_plan_s": max(r.get("fed_past_plan_s", 0.0) for r in results),
        "feed": feed,
        "melspec_sync_free": all(r.get("melspec") for r in results),
        "token_writes_incremental": all(r.get("token_writes") for r in results),
        "window_trim": (results[0].get("window_trim") or False
                        if len({r.get("window_trim") for r in results}) == 1 else "mixed"),
        "pinned": {f"fe{f}": r.get("pin") for (f, _), r in zip(parts, results, strict=True)},
        "gpu_util_p50": round(statistics.median(util), 1) if util else None,
        "by_front_end": by_front_end(parts, share, results),
        **({"gpu_profile": await asyncio.to_thread(gpu_profiles, {
            f"fe{f}": r.get("gpu_trace") for (f, _), r in zip(parts, results, strict=True)})}
           if profile_dir and any("gpu_trace" in r for r in results) else {}),
        **({"ab": ab_rows(ab, results, share, util, stamps)} if ab else {}),
    }


def by_front_end(parts: list[tuple[int, str]], share: list[int],
                 results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each engine's own sessions: with several engines a phase's real-time share can hide
    that one engine lags while the others keep up (112 aged under MPS: 75 of 112, two
    engines' worth, 2026-12-03), and only this says which and why."""
    rows = []
    for (f, _), k, r in zip(parts, share, results, strict=True):
        fps = r["fps"]
        rows.append({
            "front_end": f, "streams": k,
            "realtime_streams": sum(1 for x in fps if x >= REALTIME_FPS),
            "frames_per_s_p50": round(statistics.median(fps), 2) if fps else None,
            "frames_per_s_min": round(min(fps), 2) if fps else None,
            "front_end_us_per_chunk": round(r["front_end_us_per_chunk"], 1),
            "engine_core_us_per_chunk": round(r["engine_core_us_per_chunk"], 1),
            "helpers_us_per_chunk": round(r["helpers_us_per_chunk"], 1),
            "aged_in_s": r.get("aged_in_s")})
    return rows
