"""One phase on one front end: its sessions fed 80 ms of speech every 80 ms, sampled and
judged over the measured window (warm-up, in-phase A/B windows, negative controls,
py-spy over the window).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.capacity.feed import FRAME, Handle
from bench.capacity.host import _children_cpu_s

WARM_S = 3.0
GPU_PROFILE_S = 2.0
"""Seconds of vLLM's torch profiler per profiled phase (`--gpu-profile`): ~25-40 engine
steps per engine, and a trace the engine core writes in seconds when it stops."""
ARRIVALS = ("lockstep", "spread")
"""When each session's 80 ms chunks arrive within the 80 ms cycle. "lockstep": all at the
same instant (every run kept before 2026-12-04's last ones): the engine can take every
session in one step per chunk, a best case no event gives it. "spread": session i's
chunks come `arrival_offset_s(i)` into the cycle, spread evenly as independent encoders'
are. On the H200 (2026-12-04, 75 aged on three engines, 60 stock on three), the one engine
that also ran the control session, whose chunks drift through the cycle at 97 %, spent
17-21 % more engine-core CPU per chunk than its two peers and was the only one whose
sessions fell behind."""
GOLDEN = 0.6180339887498949


def arrival_offset_s(session: int, arrivals: str) -> float:
    """Seconds into the 80 ms cycle at which a session's chunks arrive."""
    if arrivals == "lockstep":
        return 0.0
    if arrivals == "spread":  # low-discrepancy: any run of sessions covers the cycle evenly
        return (session * GOLDEN) % 1.0 * 0.08
    raise ValueError(f"arrivals must be one of {ARRIVALS}, not {arrivals!r}")


SWITCH_SLACK_S = 1.0
"""Feed time per in-phase A/B window beyond the window itself: the levers switch (an
engine-core call between steps) before the window's clock starts, so the feed must last
past the last window."""


async def _phase(n: int, seconds: float, audio: np.ndarray,
                 start: Callable[[int], Awaitable[Handle]], first: int = 0,
                 before: Callable[[], Awaitable[None]] | None = None,
                 profile: str | None = None,
                 gpu_profile: Callable[[], Awaitable[str | None]] | None = None,
                 segments: list[Callable[[], Awaitable[Any]]] | None = None,
                 sync: Callable[[], Awaitable[None]] | None = None,
                 controls: int = 0, control_speed: float = 0.97,
                 counters: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 warm_s: float = WARM_S, deadline: float | None = None,
                 arrivals: str = "lockstep",
                 ) -> dict[str, Any]:
    """Run n sessions (numbered from `first`, so front ends feed different audio);
    `start(i)` returns (push a PCM16 frame, outputs so far, close); `before()` is awaited
    after every session started and before the clock starts (ageing). With `profile` (a
    file), py-spy records this process and its children over the measured window; with
    `gpu_profile` too, it runs over the window's last seconds (vLLM's torch profiler; it
    returns the trace's path, reported as `gpu_trace`), so that the engine core writes
    the trace after the measured window, not in it.

    With `segments` (the in-phase A/B, `--aged-ab`): after the warm-up the measured
    window is len(segments) windows of `seconds` each, the same sessions fed on; before
    each, its callable runs (it switches the engine-core levers and returns what they
    said), and each window reports its own frames per second, CPU and clock (`segments`
    in the result). `sync()` is awaited after `before()` and before the clock starts (the
    front ends of one GPU start their windows together).

    Strict figures (bench/capacity/rule.py): every `rule.SAMPLE_S` each session's backlog
    is sampled (audio a real-time sender had sent minus audio decoded, from the feed's
    start), and each session gets its keep-up verdict over the measured window
    (`sessions`). `controls` more sessions are negative controls: fed at `control_speed`
    of real time while their real-time sender's audio keeps arriving, so they decode that
    share of real time on purpose and the rule must fail them (`controls`). `counters()`,
    awaited at the window's start and end, gives the engine's re-anchoring counters; the
    result has their difference (`reanchors_in_phase`). `deadline` (wall clock,
    time.time()): the feed, planned after ageing, ends by then however long ageing took
    (a device call has a hard limit); the result says what was planned and what ran.
    `arrivals` (ARRIVALS): where in the 80 ms cycle each session's chunks arrive; a
    session's backlog counts from its own arrivals."""
    from bench.capacity import rule

    handles = [await start(first + i) for i in range(n + controls)]
    t_age = time.monotonic()
    if before is not None:
        try:
            await before()
        except BaseException:
            await asyncio.gather(*(h[2]() for h in handles), return_exceptions=True)
            raise
    aged_in_s = time.monotonic() - t_age
    planned_s = seconds
    if deadline is not None:
        seconds = max(warm_s + 5.0, min(seconds, deadline - time.time()))
    if sync is not None:
        await sync()
    at_t0 = [h[1]() for h in handles]
    t0 = time.monotonic()
    samples: list[tuple[float, list[int], list[int]]] = []
    window_s = seconds
    if segments:  # warm-up, the windows, and slack for the switches between them
        seconds = warm_s + len(segments) * (window_s + SWITCH_SLACK_S)
    frames = int(seconds / 0.08)
    marks: dict[str, Any] = {}
    windows: list[dict[str, Any]] = []

    async def measure_segments() -> None:
        assert segments is not None
        for switch in segments:
            said = await switch()
            before = await counters() if counters is not None else {}
            counts, cpu, kids = [h[1]() for h in handles], time.process_time(), _children_cpu_s()
            t = time.monotonic()
            await asyncio.sleep(window_s)
            elapsed = time.monotonic() - t
            chunks = max(1, round(n * elapsed / 0.08))
            kids_after = _children_cpu_s()
            windows.append({
                "said": said, "t0": t, "t1": t + elapsed,
                "fps": [(h[1]() - c) / elapsed for h, c in zip(handles, counts, strict=True)],
                "front_end_us_per_chunk": (time.process_time() - cpu) / chunks * 1e6,
                "engine_core_us_per_chunk": (kids_after[0] - kids[0]) / chunks * 1e6,
                "helpers_us_per_chunk": (kids_after[1] - kids[1]) / chunks * 1e6})
            # the engine's steps in the window (how it batched), read after its frames and
            # CPU so the call's own time counts in neither
            after = await counters() if counters is not None else {}
            if before and after:
                windows[-1]["counted"] = _counter_diff(before, after)

    fed = [0] * (n + controls)
    windows_done = asyncio.Event()
    feeding = asyncio.Event()

    def arrived() -> list[int]:
        """Frames a real-time sender had sent by now: a control's sender too, though the
        control hands them to its engine session more slowly."""
        on_clock = min(frames, int((time.monotonic() - t0) / 0.08))
        return fed[:n] + [on_clock] * controls

    async def sample() -> None:
        while not feeding.is_set():
            samples.append((time.monotonic(), arrived(), [h[1]() for h in handles]))
            await asyncio.sleep(rule.SAMPLE_S)

    async def pace(i: int) -> None:
        push = handles[i][0]
        offset = ((first + i) * 7919 * FRAME) % (audio.size - FRAME)
        # a control keeps the cycle's start: its real-time sender is read off t0
        t_i = t0 + (arrival_offset_s(first + i, arrivals) if i < n else 0.0)
        if i >= n:  # a negative control: decodes `control_speed` of real time at most
            for k in range(int(frames * control_speed)):
                await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 / control_speed
                                        - time.monotonic()))
                j = (offset + k * FRAME) % (audio.size - FRAME)
                push(audio[j : j + FRAME])
                fed[i] = k + 1
            return
        k = 0
        # With windows, the feed lasts until the last one ends, however long the switches
        # between them took: a window that outlived the feed would read sessions that ran
        # out of audio as slow (the first aged A/B's last window, 11.2 frames/s p50 where
        # the others read 12.2-14.1, H200 2026-12-03, may have been that).
        while k < frames or (segments and not windows_done.is_set()):
            await asyncio.sleep(max(0.0, t_i + (k + 1) * 0.08 - time.monotonic()))
            j = (offset + k * FRAME) % (audio.size - FRAME)
            push(audio[j : j + FRAME])  # PCM16, as a client sends it
            k += 1
            fed[i] = k

    async def mark() -> None:
        await asyncio.sleep(warm_s)
        if counters is not None:
            marks["counters"] = await counters()
        marks["counts"] = [h[1]() for h in handles]
        marks["cpu"] = time.process_time()
        marks["children"] = _children_cpu_s()
        marks["t"] = time.monotonic()
        if profile is not None:
            marks["spy"] = _py_spy(os.getpid(), Path(profile), seconds - warm_s - 0.5)
        if gpu_profile is not None:  # the window's last seconds: the trace is written after
            marks["gpu"] = asyncio.create_task(_after(
                max(0.0, seconds - warm_s - GPU_PROFILE_S - 0.5), gpu_profile))
        if segments:
            try:
                await measure_segments()
            finally:
                windows_done.set()

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(pace(i) for i in range(n + controls)), mark())
    samples.append((time.monotonic(), arrived(), [h[1]() for h in handles]))
    feeding.set()
    await sampler
    counted = (_counter_diff(marks["counters"], await counters())
               if counters is not None and "counters" in marks else None)
    elapsed = time.monotonic() - marks["t"]
    cpu = time.process_time() - marks["cpu"]
    children = [b - a for a, b in zip(marks["children"], _children_cpu_s(), strict=True)]
    final = [h[1]() for h in handles]
    gpu_trace = await marks["gpu"] if "gpu" in marks else None
    await asyncio.gather(*(h[2]() for h in handles))
    if marks.get("spy") is not None:
        await asyncio.to_thread(marks["spy"].wait, 60)
    chunks = max(1, round(n * elapsed / 0.08))
    fps = [(f - w) / elapsed for f, w in zip(final[:n], marks["counts"][:n], strict=True)]
    window = [x for x in samples if x[0] >= marks["t"]]
    verdicts = []
    for i in range(n + controls):
        backlog = [(a[i] - (o[i] - at_t0[i])) * 0.08 for _, a, o in window]
        verdicts.append({"session": first + i, **rule.session_verdict(
            [t - marks["t"] for t, _, _ in window], backlog,
            decoded_frames=window[-1][2][i] - window[0][2][i])})
    return {
        "fps": fps,
        "backlog_series": backlog_series(window, marks["t"], at_t0, n),
        "sessions": verdicts[:n],
        "controls": [{**v, "speed": control_speed} for v in verdicts[n:]],
        "window_s": round(elapsed, 2), "seconds_planned": planned_s, "arrivals": arrivals,
        "seconds_fed": round(seconds, 1),
        **({"reanchors_in_phase": counted} if counted is not None else {}),
        # audio fed in the phase minus audio decoded in it
        "backlog_s": [(k - (f - s0)) * 0.08
                      for k, f, s0 in zip(fed[:n], final[:n], at_t0[:n], strict=True)],
        "fed_past_plan_s": round((max(fed, default=0) - frames) * 0.08, 2),
        "front_end_us_per_chunk": cpu / chunks * 1e6,
        "engine_core_us_per_chunk": children[0] / chunks * 1e6,
        "helpers_us_per_chunk": children[1] / chunks * 1e6,
        "aged_in_s": round(aged_in_s, 1),
        **({"gpu_trace": gpu_trace} if gpu_trace else {}),
        **({"segments": windows} if segments else {}),
    }


SERIES_S = 5.0


def backlog_series(window: list[tuple[float, list[int], list[int]]], t0: float,
                   at_t0: list[int], n: int, every_s: float = SERIES_S) -> list[list[float]]:
    """The backlog of the `n` measured sessions through the window, every `every_s`:
    [seconds into the window, mean, max] (s). When a level fails, this says whether its
    sessions fell behind steadily, in one stall, or late (the 90-session run of 2026-12-04
    peaked at the window's end; the verdicts alone could not say when it began)."""
    out: list[list[float]] = []
    due = 0.0
    for t, arrived, decoded in window:
        if t - t0 + 1e-9 < due or not n:
            continue
        backlog = [(arrived[i] - (decoded[i] - at_t0[i])) * 0.08 for i in range(n)]
        out.append([round(t - t0, 1), round(sum(backlog) / n, 2), round(max(backlog), 2)])
        due += every_s
    return out


def _counter_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine's re-anchoring counters (worker.babelcast_reanchor_stats) did in a
    window: re-anchors, deferred ones (summed over reasons), failed rotations, ended
    requests, and how many requests re-anchored at least once (their shift moved)."""
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    for key in ("reanchors", "rotation_failed", "requests_ended", "preempted_ended",
                "steps", "step_requests"):
        out[key] = int(after.get(key, 0)) - int(before.get(key, 0))
    out["deferred"] = (sum(int(v) for v in (after.get("deferred") or {}).values())
                       - sum(int(v) for v in (before.get("deferred") or {}).values()))
    b, a = before.get("shift_by_request") or {}, after.get("shift_by_request") or {}
    out["requests_reanchored"] = sum(1 for rid, v in a.items() if b.get(rid) != v)
    for hist in ("step_sizes", "step_gaps_ms"):  # histograms (a worker from before: none)
        if hist in after:
            out[hist] = _hist_diff(before.get(hist) or {}, after[hist])
    if "tick_gather" in after:  # the gather's counts (its window as it ended the window)
        b, a = before.get("tick_gather") or {}, after["tick_gather"]
        out["tick_gather"] = {"window_ms": a.get("window_ms"), **{
            k: int(a.get(k, 0)) - int(b.get(k, 0))
            for k in ("ticks", "held_ticks", "holds", "timed_out")}}
    if "tick_arrivals" in after:  # when the scheduler saw each tick's chunks (gather.py)
        b, a = before.get("tick_arrivals") or {}, after["tick_arrivals"]
        out["tick_arrivals"] = {k: int(a.get(k, 0)) - int(b.get(k, 0))
                                for k in ("ticks", "chunks")}
        for hist in ("offset_ms", "spread_ms"):
            out["tick_arrivals"][hist] = _hist_diff(b.get(hist) or {}, a.get(hist) or {})
    return out


def _hist_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """A histogram's counts in the window (keys are numbers as strings, kept in numeric
    order; empty bins dropped)."""
    diff = {k: int(v) - int(before.get(k, 0)) for k, v in after.items()}
    return {k: v for k, v in sorted(diff.items(), key=lambda kv: int(kv[0])) if v}


async def _after(delay_s: float, then: Callable[[], Awaitable[str | None]]) -> str | None:
    await asyncio.sleep(delay_s)
    return await then()


def _py_spy(pid: int, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy on a front end and its children (engine core, VAD helpers), raw format;
    its messages go next to the profile (`.log`): a missing ptrace permission shows there."""
    import shutil

    exe = shutil.which("py-spy") or next(
        (str(p) for p in (Path(sys.prefix) / "bin" / "py-spy", Path("/tmp/site/bin/py-spy"),
                          *Path("/tmp/site").glob("py_spy*/**/py-spy")) if p.exists()), None)
    if exe is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--subprocesses", "--rate", "67",
             "--nonblocking", "--duration", str(max(1, int(seconds))), "--format", "raw",
             "--output", str(out)], stdout=log, stderr=subprocess.STDOUT)
