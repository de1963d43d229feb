"""What a run reports beyond its phases' rows: the median row over rounds, where the KV
cache was (the schedulers' traces), and the py-spy and torch profiler summaries.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path
from typing import Any


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("realtime_share", "frames_per_s_p50", "frames_per_s_min", "backlog_p99_s",
            "front_end_us_per_chunk", "engine_core_us_per_chunk", "helpers_us_per_chunk",
            "gpu_util_p50")
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    return out


def kv_summary(folder: str, t0: float, t1: float) -> list[dict[str, Any]]:
    """Per engine (trace file), from the scheduler's lines between t0 and t1 (wall clock):
    the most KV blocks in use (share), the most requests running and waiting, the blocks
    each session held per cache group when the most were in use, and the engine's steps
    with tokens per second and requests per such step (a line counts the steps since the
    line before it; traces without those counts leave them out)."""
    out = []
    for path in sorted(Path(folder).glob("kv-*.jsonl")):
        lines = []
        with contextlib.suppress(OSError):
            for raw in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    line = json.loads(raw)
                    if t0 <= line["t"] <= t1:
                        lines.append(line)
        if not lines:
            continue
        peak = max(lines, key=lambda x: x["blocks"] - x["free"])
        out.append({
            "engine": path.stem, "blocks": peak["blocks"],
            "used_max": round((peak["blocks"] - peak["free"]) / max(1, peak["blocks"]), 3),
            "running_max": max(x["running"] for x in lines),
            "waiting_max": max(x["waiting"] for x in lines),
            "blocks_per_request_at_peak": {
                f'{g["spec"]}(window {g["window"]}, block {g["block_size"]})':
                    round(g["held"] / max(1, g.get("requests", peak["running"])), 1)
                for g in peak["groups"]},
        })
        counted = [x for x in lines[1:] if "steps" in x]
        span = lines[-1]["t"] - lines[0]["t"]
        steps = sum(x["steps"] for x in counted)
        if counted and span > 0:
            out[-1]["steps_per_s"] = round(steps / span, 1)
            out[-1]["requests_per_step"] = (round(sum(x["batched"] for x in counted) / steps, 2)
                                            if steps else None)
    return out


_PLUMBING = ("threading.py", "multiprocessing/", "asyncio/", "concurrent/futures",
             "contextlib.py", "<string>", "runpy.py", "_contextlib.py")
"""Plumbing frames, left out of `top_inclusive` (so are frames in ≥ 80 % of a process's
samples: a forked engine core's stacks start with its parent's frames)."""


def summarize_profiles(folder: str, top: int = 12) -> dict[str, Any]:
    """Per profile: each process's share of the samples, the leaf frames (function
    (file:line)) with the largest share, and per process the frames with the largest
    inclusive share, from py-spy's raw (collapsed) output. With `--subprocesses` a child's
    stack starts with its parents' `process` frames: the last one is the sampled process."""
    out: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.txt")):
        procs: dict[str, int] = {}
        leaves: dict[str, int] = {}
        inclusive: dict[str, dict[str, int]] = {}
        total = 0
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            heads = [i for i, f in enumerate(frames) if f.startswith("process ")]
            head = frames[heads[-1]] if heads else "?"
            proc = head.split(":")[0] + (" " + head.split('"')[1][:60] if '"' in head else "")
            procs[proc] = procs.get(proc, 0) + n
            leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
            mine = inclusive.setdefault(proc, {})
            for f in set(frames[(heads[-1] + 1) if heads else 0:]):
                mine[f] = mine.get(f, 0) + n
        if total:
            ranked = sorted(procs.items(), key=lambda x: -x[1])[:6]
            out[path.stem] = {
                "samples": total,
                "processes": {p: round(c / total, 3) for p, c in ranked},
                "top_leaves": [[f, round(c / total, 3)] for f, c in
                               sorted(leaves.items(), key=lambda x: -x[1])[:top]],
                "top_inclusive": {p: [[f, round(c / total, 3)] for f, c in sorted(
                    ((f, c) for f, c in inclusive[p].items()
                     if c < 0.8 * pc and not any(b in f for b in _PLUMBING)),
                    key=lambda x: -x[1])[:top]] for p, pc in ranked[:3]},
            }
    for log in sorted(Path(folder).glob("*.log")):  # no samples: py-spy's own words say why
        if log.stem not in out:
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            out[log.stem] = {"samples": 0, "py_spy": (lines[-1] if lines else "")[:300]}
    return out


def torch_trace_dir(profile_dir: str | None, gpu_profile: bool, f: int) -> str | None:
    """Where front end f's engine core writes vLLM's torch profiler traces (`--gpu-profile`
    with `--profile-dir`); None: no torch profiler."""
    if not (gpu_profile and profile_dir):
        return None
    return str((Path(profile_dir) / f"torch-fe{f}").resolve())


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace categories of work on the GPU (torch profiler, CUDA activity)."""
STEP_PREFIX = "execute_context_"
"""vLLM's annotation of each engine step in a torch profiler trace (gpu_worker.py
`annotate_profile`): `execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)`."""


KERNEL_NAME_CHARS = 260
"""A kernel's name in the summary is cut here: FlashAttention's names say their KV type
(`float_e4m3_t` or `bfloat16_t`) and tile only after ~200 characters."""


def summarize_gpu_trace(path: str, top: int = 12) -> dict[str, Any]:
    """One engine core's torch profiler trace (Chrome trace JSON, gzipped or not): its
    window, the engine steps in it (vLLM's annotations) and the requests they carried,
    the GPU's busy share of the window (the union of its kernels and copies: two at once
    count once), GPU time per step, and the kernels with the most GPU time."""
    import gzip

    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    if not spans:
        return {"error": "no timed events in the trace"}
    gpu = [e for e in spans if str(e.get("cat", "")).lower() in GPU_CATEGORIES]
    steps = [e for e in spans if str(e.get("name", "")).startswith(STEP_PREFIX)]
    t0 = min(float(e["ts"]) for e in spans)
    window = max(float(e["ts"]) + float(e["dur"]) for e in spans) - t0  # µs
    busy = 0.0
    end = -math.inf
    for a, b in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu):
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, list[float]] = {}
    by_category: dict[str, float] = {}
    for e in gpu:
        name = str(e.get("name", "?"))
        row = by_name.setdefault(name, [0.0, 0])
        row[0] += float(e["dur"])
        row[1] += 1
        cat = str(e.get("cat", "")).lower()
        by_category[cat] = by_category.get(cat, 0.0) + float(e["dur"])
    gpu_total = sum(v[0] for v in by_name.values())
    requests = [_step_requests(str(e["name"])) for e in steps]
    n = len(steps)
    return {
        "window_s": round(window / 1e6, 3),
        "steps": n,
        "requests_per_step": (round(sum(requests) / n, 2) if n else None),
        "step_cpu_ms_p50": (round(statistics.median(float(e["dur"]) for e in steps) / 1e3, 3)
                            if n else None),
        "gpu_busy_share": round(busy / window, 3) if window > 0 else None,
        "gpu_busy_ms_per_step": round(busy / n / 1e3, 3) if n else None,
        "gpu_ops_per_step": round(len(gpu) / n, 1) if n else None,
        "gpu_ms_by_category": {c: round(v / 1e3, 2) for c, v in sorted(by_category.items())},
        "top_gpu": [[name[:KERNEL_NAME_CHARS], round(v[0] / 1e3, 2),
                     round(v[0] / gpu_total, 3) if gpu_total else None, v[1]]
                    for name, v in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]],
    }


def _step_requests(annotation: str) -> int:
    """Requests in one step from vLLM's annotation (context + generation)."""
    import re

    return sum(int(x) for x in re.findall(r"_(\d+)\(", "_" + annotation[len("execute"):]))


def gpu_profiles(traces: dict[str, str | None]) -> dict[str, Any]:
    """`summarize_gpu_trace` per engine (front end); a missing or unreadable trace says so."""
    out: dict[str, Any] = {}
    for name, path in traces.items():
        if not path:
            out[name] = {"error": "no trace (the front end's stderr says why)"}
            continue
        try:
            out[name] = summarize_gpu_trace(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out
