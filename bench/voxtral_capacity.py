"""Voxtral capacity on one GPU, in one run: how many real-time sessions vLLM's own serving
path holds, and how many the project's `vllm` engine holds with each lever.

    python -m bench.voxtral_capacity --model DIR --find-knee [--ladder 64 96 128 160] \\
        [--configs stock project project-x2] [--seconds 12] [--rounds 2] --json
    python -m bench.voxtral_capacity --model DIR --streams 64 --json   # one level

Every engine runs in a process of its own (a *front end*: AsyncLLM, its output loop and
the feeding loop, as an ASR actor is), started one after another; this process only
orchestrates, samples the GPU and adds up. Configurations:
- `stock`: vLLM's realtime serving path (`OpenAIServingRealtime.transcribe_realtime`)
  on front end 0 — what `vllm serve` does per WebSocket, without the socket;
- `project`: the project's engine sessions on the same front end 0 (same AsyncLLM);
- `project-direct`: the same, with each chunk's engine input built directly
  (`workers/engines/vllm/direct.py`) instead of the renderer and the HF processor;
- `project-x2`, `project-direct-x2`: two front ends on the one GPU (1 and 2), half of
  the sessions each — the production shape of `engine.vllm.engines_per_gpu: 2`;
  `-x3`, `-x4`: three or four front ends (1…4), a third or a quarter of the sessions each.
- `…+melspec` (any of the project's): the same engines with their engine cores'
  spectrogram made without a GPU wait per chunk (`engine.vllm.sync_free_melspec`,
  switched per phase, so with and without run on the same engines in one run).
- `…+tokens`, `…+melspec+tokens`: the same with the engine cores' incremental token
  history writes (`engine.vllm.incremental_token_writes`), switched the same way.
- `…+melspec+tokens+trim`: and FlashAttention handed only the KV blocks each session's
  window sees (`engine.vllm.window_trim`'s "blocks" mode), switched the same way;
  `…+melspec+tokens+keys`: only the keys it sees (its "keys" mode, FA3's `leftpad_k`,
  the plain causal kernel for one-token queries). A lever a configuration
  does not name is off in its phases (the stock path runs with none).
Front ends 1…N start only if an `-xN` configuration is asked for. Each gets
`--gpu-memory-utilization / engines` of the GPU (so measure one N per run: a `-x2` run
next to `-x4` engines would have half the GPU's memory).

Each session is fed 80 ms of real speech every 80 ms. A session is real time when it
decodes ≥ 12.0 frames/s (12.5 is exact) over the measured window (after 3 s of warm-up).
With `--find-knee`, every configuration runs at each ladder level, in an order rotated
every round, `--rounds` times; the level counts for a configuration when the median over
rounds of its real-time share is ≥ 95 %, and its knee is the largest such level (a
configuration stops climbing at its first miss). Every configuration is warmed up at the
first level before anything is measured. Also reported per phase: CPU per chunk (µs) of
the front-end processes and of their engine-core processes, and GPU utilisation (p50).
Random weights (`--load-format dummy`) give random text and a real cost per step.

Like production:
- `--production`: the project's sessions are fed as an ASR actor feeds them, through a
  session manager per stream with Silero voice activity in helper processes
  (`VadService`, one per 40 streams); their CPU is reported as `helpers_us_per_chunk`.
- `--age-min M --aged-ladder N…`: after the knee, the project's configurations run at
  those levels with sessions first aged M minutes (fed in bulk prompts of 768 frames with
  blanks fed back, re-anchoring as configured: bench.voxtral_age; at most
  `--age-concurrency` sessions per front end in their bulk steps at once, since each holds
  the KV cache of its whole step), climbing until the first miss (`aged_knee`). With
  `--production` too, the aged phases use the production feed (`aged-production`): each
  stream's session manager opens its engine session, which first takes its age in bulk
  steps and then the stream's live audio, with VAD; a session the manager opens later
  (a restart) is new, as in production. Ageing counts as stuck once no session got a
  step for 45 s. vLLM's
  stock path has no aged steady state (it cannot re-anchor; its sessions end at
  max_model_len), so it is measured on new sessions only.
- `--aged-ab --ab-windows W`: configurations that differ only in their engine-core
  levers (e.g. `…+trim` and `…+keys`) share one aged phase per level: the sessions age
  once and are measured in W windows of `--seconds`, the levers switched between windows
  in turn (A B A B …), all front ends starting their windows together; each
  configuration's figures come from its own windows (and its GPU use from the samples in
  them). Why: two runs on one host (2026-12-02) gave whichever aged phase ran second
  ~0.5-1.1 frames/s more, as much as the levers differed, and every CPU figure of the
  first phase (VAD helpers too, which no lever touches) up to 18 % higher. A lever
  switched mid-phase leaves the backlog of the window before it: a window above real
  time catches up, so its frames/s may read above 12.5; below real time it reads its
  capacity. First run on the H200 on 2026-12-03 (110 aged, `+pin` against none). `+pin`
  (each engine-core process on a physical core of its own, everything else off those
  cores) switches the same way. Each
  configuration's row also gives every front end's (engine's) real-time sessions, p50 and
  engine-core CPU; a plain phase's row has them in `by_front_end`.
- `--share-front-end`: the one-engine configurations run on front end 1 of the -xN
  group, so N engines share the GPU's memory as `engines_per_gpu: N` would.
- `--max-model-len 16384`: the engine's production default (re-anchoring keeps sessions
  below it; 131072 needs 141 GiB of KV cache on vLLM 0.26 and does not start).
- `--profile-dir D --profile-level N`: py-spy (67 Hz, raw) on every front end taking part
  and its children over the measured window of each phase at level N (new or aged
  sessions: after ageing and warm-up); `profiles` gives each process's share and the top
  leaf frames. py-spy's own messages go to `D/<phase>.log`.
- `--gpu-profile` (with `--profile-dir`): also vLLM's torch profiler in every engine core
  taking part, for `GPU_PROFILE_S` of the same window (CUDA activity: kernels, copies;
  CPU: vLLM's per-step annotations). `gpu_profiles` gives per engine the steps, the GPU's
  busy share of the window (the union of its kernels and copies), GPU time per step and
  the kernels with the most GPU time. The raw traces stay in `D/torch-fe<k>/`. The
  profiler runs over the window's last `GPU_PROFILE_S` (the engine core writes the trace
  when it stops, after the window); CUPTI slows those seconds, so read that phase's
  frames/s as perturbed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engines import vad  # noqa: E402
from workers.engines.base import SessionOptions  # noqa: E402
from workers.engines.vllm.engine import (  # noqa: E402
    VllmEngineOptions,
    VllmVoxtralEngine,
    switch_lever,
)
from workers.engines.vllm.mps import mps_servers  # noqa: E402
from workers.engines.vllm.options import KV_TRACE_ENV as TRACE_ENV  # noqa: E402
from workers.events import AudioChunk  # noqa: E402

FRAME = 1280
REALTIME_FPS = 12.0
REALTIME_SHARE = 0.95
WARM_S = 3.0
GPU_PROFILE_S = 2.0
"""Seconds of vLLM's torch profiler per profiled phase (`--gpu-profile`): ~25-40 engine
steps per engine, and a trace the engine core writes in seconds when it stops."""
AGE_BULK = 768  # frames per ageing prompt, a multiple of bench.voxtral_age.ALIGN
AGE_CONCURRENCY = 8
"""Sessions of one front end in their bulk ageing steps at once (`--age-concurrency`):
each holds ~60 blocks of KV cache while a 768-frame step is in flight, ~78 once aged."""
SWITCH_SLACK_S = 1.0
"""Feed time per in-phase A/B window beyond the window itself: the levers switch (an
engine-core call between steps) before the window's clock starts, so the feed must last
past the last window."""
AGE_STALL_S = 45.0
"""Ageing in which no session got a step for this long is stuck (e.g. waiting for KV
cache). Slow ageing that still moves goes on: four engines on one busy GPU aged 96
sessions for more than 150 s, which a fixed limit took for stuck."""
_PROJECT = ("project", "project-direct",
            *(f"{c}-x{k}" for k in (2, 3, 4) for c in ("project", "project-direct")))
MELSPEC = "+melspec"
"""A configuration with this suffix runs with the engine cores' sync-free spectrogram
(engine.vllm.sync_free_melspec), switched per phase on the same engines: the A/B is
same run, same engines."""
TOKENS = "+tokens"
"""…with the engine cores' incremental token-history writes
(engine.vllm.incremental_token_writes), switched per phase the same way."""
TRIM = "+trim"
"""…with FlashAttention handed only the blocks each window sees (engine.vllm.window_trim
"blocks"), switched per phase the same way."""
KEYS = "+keys"
"""…with FlashAttention handed only the keys each window sees (engine.vllm.window_trim
"keys"), switched per phase the same way."""
PIN = "+pin"
"""…with each engine-core process on a physical core of its own (both of its hardware
threads) and the front ends and VAD helpers off those cores, switched per phase (or per
window of an in-phase A/B) from the front-end processes. Not an engine-core lever: the
host's scheduler is. Under MPS three engine cores each used a whole CPU at 112 aged, and
75 of 112 sessions were real time, two engines' worth of three (2026-12-03)."""
LEVERS = (MELSPEC, TOKENS, TRIM, KEYS, PIN)
CONFIGS = ("stock", *_PROJECT,
           *(f"{c}{s}{p}" for c in _PROJECT
             for s in (MELSPEC, TOKENS, MELSPEC + TOKENS, MELSPEC + TOKENS + TRIM,
                       MELSPEC + TOKENS + KEYS) for p in ("", PIN)))


def trim_of(config: str) -> str | bool:
    """The window_trim mode a configuration's phases run: "keys", "blocks" or off."""
    return "keys" if KEYS in config else "blocks" if TRIM in config else False


def base_of(config: str) -> str:
    """The configuration without its levers (`+melspec`, `+tokens`, `+trim`, `+keys`,
    `+pin`)."""
    while True:
        lever = next((x for x in LEVERS if config.endswith(x)), None)
        if lever is None:
            return config
        config = config.removesuffix(lever)


def engines_of(config: str) -> int:
    """Front ends a configuration runs on: N for `-xN`, else 1."""
    head, _, k = base_of(config).rpartition("-x")
    return int(k) if head and k.isdigit() else 1


def front_end_streams(f: int, configs: list[str], top: int, shared: bool) -> int:
    """Sessions front end `f` is sized for (its engine's `max_streams`, which vLLM turns into
    `max_num_seqs`). Front end 0, or 1 under `--share-front-end`, takes a one-engine
    configuration's every session; an -xN front end takes its share of the fewest-engine
    group's. vLLM reserves memory per sequence slot before it sizes the KV cache, so a front
    end sized for every session when no one-engine configuration runs on it would have
    fewer blocks than its peers (2026-12-02, x3 at 104 aged: front end 1 had 3,109 blocks,
    the two others 3,871, and its ageing filled it first)."""
    one = any(engines_of(c) == 1 for c in configs)
    if f == 0 or (shared and f == 1 and one):
        return top
    fewest = min((engines_of(c) for c in configs if engines_of(c) > 1), default=1)
    return -(-top // fewest)


Handle = tuple[Callable[[np.ndarray], None], Callable[[], int], Callable[[], Awaitable[None]]]


def speech() -> np.ndarray:
    """examples/audio/room-a.flac as 16 kHz mono PCM16 (PyAV, a dependency)."""
    import av

    with av.open(str(ROOT / "examples" / "audio" / "room-a.flac")) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
        parts = [f.to_ndarray().ravel() for frame in container.decode(audio=0)
                 for f in resampler.resample(frame)]
    return np.concatenate(parts).astype(np.int16)


async def _gpu_util(stop: asyncio.Event, out: list[float],
                    stamps: list[float] | None = None) -> None:
    while not stop.is_set():
        try:
            res = await asyncio.to_thread(
                subprocess.run, ["nvidia-smi", "--query-gpu=utilization.gpu",
                                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5)
            out.append(float(res.stdout.split()[0]))
            if stamps is not None:
                stamps.append(time.monotonic())
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        await asyncio.sleep(1.0)


def _children_cpu_s() -> tuple[float, float]:
    """CPU seconds of this process's children: (vLLM's engine core, the rest: the VAD
    helper processes in production mode). Helpers that exit in a phase are not counted,
    so the VAD pool lives for the whole phase."""
    import psutil

    core = other = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            name = " ".join([child.name(), *child.cmdline()])
        except psutil.Error:
            continue
        if "EngineCore" in name:  # vLLM titles its engine-core process VLLM::EngineCore
            core += t.user + t.system
        else:
            other += t.user + t.system
    return core, other


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
    (a device call has a hard limit); the result says what was planned and what ran."""
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
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))
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
        "sessions": verdicts[:n],
        "controls": [{**v, "speed": control_speed} for v in verdicts[n:]],
        "window_s": round(elapsed, 2), "seconds_planned": planned_s,
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


def _counter_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine's re-anchoring counters (worker.babelcast_reanchor_stats) did in a
    window: re-anchors, deferred ones (summed over reasons), failed rotations, ended
    requests, and how many requests re-anchored at least once (their shift moved)."""
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    for key in ("reanchors", "rotation_failed", "requests_ended", "preempted_ended"):
        out[key] = int(after.get(key, 0)) - int(before.get(key, 0))
    out["deferred"] = (sum(int(v) for v in (after.get("deferred") or {}).values())
                       - sum(int(v) for v in (before.get("deferred") or {}).values()))
    b, a = before.get("shift_by_request") or {}, after.get("shift_by_request") or {}
    out["requests_reanchored"] = sum(1 for rid, v in a.items() if b.get(rid) != v)
    return out


async def _after(delay_s: float, then: Callable[[], Awaitable[str | None]]) -> str | None:
    await asyncio.sleep(delay_s)
    return await then()


# ---- the production feed ----------------------------------------------------------------
def track_sessions(engine: Any) -> dict[str, list[Any]]:
    """Bench-only: remember each stream's engine sessions (to count their outputs)."""
    opened: dict[str, list[Any]] = {}
    real_open = engine.open_session

    def tracking_open(options: SessionOptions) -> Any:
        session = real_open(options)
        opened.setdefault(options.stream_id, []).append(session)
        return session

    engine.open_session = tracking_open
    return opened


async def open_production(engine: Any, vad_service: Any, opened: dict[str, list[Any]],
                          i: int) -> Handle:
    """One stream fed as an ASR actor feeds it (workers/asr.py `_open`): a session manager
    over the engine, with voice activity from the VAD helper processes."""
    from workers.sessions.manager import SessionManager, SessionPolicy

    sid = f"prod{i}-{uuid.uuid4().hex[:6]}"
    manager = SessionManager(engine, SessionOptions(sid, "auto"), SessionPolicy(),
                             vad=vad_service.stream(sid))
    manager.start()
    pos = [0]

    async def drain() -> None:
        async for _ in manager:
            pass

    d = asyncio.create_task(drain())

    def push(frame: np.ndarray) -> None:
        manager.push_nowait(AudioChunk(sid, pos[0], frame.tobytes(), time.time()))
        pos[0] += FRAME

    async def close() -> None:
        await manager.aclose()
        d.cancel()
        opened.pop(sid, None)

    return push, (lambda: sum(x.outputs for x in opened.get(sid, ()))), close


class AgeingBackend:
    """Bench-only: the engine's backend, except that while `open` every new session's
    prompts start with `ageing(audio, tokens, direct)`, which puts that session's age in
    front of its own audio (bench.voxtral_age's bulk steps on the GPU). So the sessions a
    session manager opens are aged as production's would be after that long; a session
    opened after `open` is cleared (a restart, a rollover) is new, as in production."""

    def __init__(self, real: Any,
                 ageing: Callable[[AsyncIterator[np.ndarray], asyncio.Queue[list[int]], bool],
                                  AsyncIterator[Any]]) -> None:
        self._real = real
        self._ageing = ageing
        self.open = True
        self.aged_sessions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def prompts(self, audio: AsyncIterator[np.ndarray],
                tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        return self._maybe_aged(audio, tokens, direct=False)

    def direct_prompts(self, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        return self._maybe_aged(audio, tokens, direct=True)

    def _maybe_aged(self, audio: AsyncIterator[np.ndarray], tokens: asyncio.Queue[list[int]],
                    direct: bool) -> AsyncIterator[Any]:
        if not self.open:
            real = self._real.direct_prompts if direct else self._real.prompts
            return real(audio, tokens)  # type: ignore[no-any-return]
        self.aged_sessions += 1
        return self._ageing(audio, tokens, direct)


async def prefixed(first: list[np.ndarray], rest: AsyncIterator[np.ndarray]
                   ) -> AsyncIterator[np.ndarray]:
    """The ageing audio, then the session's own."""
    for frame in first:
        yield frame
    async for frame in rest:
        yield frame


def speech_frame(audio: np.ndarray, offset: int, k: int) -> np.ndarray:
    """The `k`-th 80 ms frame from `offset` of the bench's speech (wrapping), as the model's
    buffer takes it: float32 in [-1, 1)."""
    j = (offset + k * FRAME) % (audio.size - FRAME)
    return audio[j : j + FRAME].astype(np.float32) / 32768.0


def ageing_audio(audio: np.ndarray, offset: int, frames: int) -> list[np.ndarray]:
    """`frames` 80 ms frames of the bench's speech as the model's buffer takes them."""
    return [speech_frame(audio, offset, k) for k in range(frames)]


async def until_first_sessions_aged(opened: dict[str, list[Any]], streams: int,
                                    outputs: int) -> None:
    """Every stream's first engine session has its ageing outputs (stalls: until_aged)."""
    def aged() -> bool:
        return len(opened) >= streams and all(
            sessions and sessions[0].outputs >= outputs for sessions in opened.values())

    async def all_there() -> None:
        # the sessions' counters move in the engine's tasks: there is no event to wait on
        while not aged():  # noqa: ASYNC110
            await asyncio.sleep(0.2)

    await until_aged(all_there(), lambda: sum(x[0].outputs for x in opened.values() if x))


# ---- one front end (a process of its own) -------------------------------------------
def stdout_to_stderr() -> None:
    """Send this process's stdout, and its children's, to stderr. A front end's vLLM (and
    its engine-core process) logs to stdout, and the front ends share the bench's, so its
    `--json` output began with a hundred log lines and was no JSON (H200, 2026-12-02)."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def _front_end(conn: Connection, options: VllmEngineOptions) -> None:
    stdout_to_stderr()
    asyncio.run(_front_end_async(conn, options))


async def _front_end_async(conn: Connection, options: VllmEngineOptions) -> None:
    engine = VllmVoxtralEngine(options)
    t = time.monotonic()
    try:
        await engine.start()
    except Exception as exc:  # the orchestrator reports it and stops
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    backend: Any = engine.backend
    llm = backend.llm
    audio = speech()
    import vllm
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.speech_to_text.realtime.serving import OpenAIServingRealtime

    serving = OpenAIServingRealtime(
        llm, OpenAIServingModels(llm, [BaseModelPath(name="voxtral", model_path=options.model)]),
        request_logger=None)
    direct_check: dict[str, Any] | None = None
    try:
        from workers.engines.vllm import direct as vllm_direct

        chunks = [audio[i * FRAME:(i + 1) * FRAME].astype(np.float32) / 32768.0
                  for i in range(60)]
        inputs = await _maybe_await(vllm_direct.check_equal(llm, backend.model_cls, chunks))
        generated = await vllm_direct.compare_generate(llm, backend.model_cls, chunks)
        direct_check = {"equal": bool(inputs.get("equal") and generated.get("tokens_equal")),
                        "inputs": inputs, "generate": generated}
    except Exception as exc:
        direct_check = {"equal": False, "error": f"{type(exc).__name__}: {exc}"}
    conn.send({"ready": True, "engine_start_s": round(time.monotonic() - t, 1),
               "vllm_version": vllm.__version__, "pid": os.getpid(),
               "direct_check": direct_check})

    async def gpu_profile() -> str | None:
        """vLLM's torch profiler in this engine core for GPU_PROFILE_S: the new trace."""
        folder = Path(options.torch_profiler_dir or ".")

        def traces() -> set[Path]:
            return set(folder.glob("*.pt.trace.json*"))

        before = await asyncio.to_thread(traces)
        try:
            await llm.start_profile()
            try:
                await asyncio.sleep(GPU_PROFILE_S)
            finally:
                await llm.stop_profile()
        except Exception as exc:  # the phase goes on; the report says no trace
            print(f"gpu profile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
        new = await asyncio.to_thread(
            lambda: sorted(traces() - before, key=lambda p: p.stat().st_mtime))
        return str(new[-1]) if new else None

    async def ours(i: int, direct: bool) -> Handle:
        session = engine.open_session(SessionOptions(f"ours{i}", "auto"))
        session.direct_input = direct  # type: ignore[attr-defined]  # whatever auto chose
        pos = [0]

        async def drain() -> None:
            async for _ in session:
                pass

        d = asyncio.create_task(drain())

        def push(frame: np.ndarray) -> None:
            session.push_nowait(AudioChunk(f"ours{i}", pos[0], frame.tobytes(), time.time()))
            pos[0] += FRAME

        async def close() -> None:
            await session.aclose()
            d.cancel()

        return push, (lambda: session.outputs), close  # type: ignore[attr-defined]

    async def theirs(i: int) -> Handle:
        audio_q: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        count = [0]
        rid = [""]
        closing = [False]

        async def audio_gen() -> AsyncIterator[np.ndarray]:
            while (a := await audio_q.get()) is not None:
                yield a

        async def run() -> None:
            # A stock session ends at max_model_len; its client must open a new one on
            # the same audio (vLLM's server has no rollover of its own): so does this one.
            while not closing[0]:
                rid[0] = f"base-{i}-{uuid.uuid4().hex[:8]}"
                tokens: asyncio.Queue[list[int]] = asyncio.Queue()
                gen = llm.generate(prompt=serving.transcribe_realtime(audio_gen(), tokens),
                                   sampling_params=backend.sampling, request_id=rid[0])
                async for out in gen:
                    if out.outputs:
                        count[0] += 1
                        tokens.put_nowait(list(out.outputs[0].token_ids))
                stock_rollovers[0] += 1

        task = asyncio.create_task(run())

        async def close() -> None:
            closing[0] = True
            await llm.abort(rid[0])
            task.cancel()

        def push(frame: np.ndarray) -> None:
            # vLLM's realtime connection converts each PCM16 frame the same way.
            audio_q.put_nowait(frame.astype(np.float32) / 32768.0)

        return push, (lambda: count[0]), close

    stock_rollovers = [0]
    opened = track_sessions(engine)
    vad_box: list[Any] = []

    async def reanchor_counters() -> dict[str, Any]:
        return dict(await backend.reanchor_stats() or {})

    async def production(i: int) -> Handle:
        return await open_production(engine, vad_box[0], opened, i)

    aged_sessions: list[Any] = []
    age_gate: list[asyncio.Semaphore] = []

    async def aged(i: int, direct: bool, age_frames: int) -> Handle:
        from bench.voxtral_age import Session as AgedSession

        every = engine.options.reanchor_every if engine.reanchoring else None
        if not age_gate:
            age_gate.append(asyncio.Semaphore(age_concurrency))
        s = AgedSession(backend, every, age_frames, AGE_BULK, audio,
                        (i * 7919 * FRAME) % audio.size, direct=direct, gate=age_gate[0])
        aged_sessions.append(s)

        def push(frame: np.ndarray) -> None:
            s.q.put_nowait(frame.astype(np.float32) / 32768.0)

        async def close() -> None:
            await s.close(backend)

        return push, (lambda: s.outputs), close

    async def all_aged() -> None:
        async def one(s: Any) -> None:
            waiter = asyncio.create_task(s.aged.wait())
            await asyncio.wait({waiter, s.task}, return_when=asyncio.FIRST_COMPLETED)
            if not s.aged.is_set():
                waiter.cancel()
                raise RuntimeError(f"an ageing session ended: {s.task.exception()!r}")

        await until_aged(asyncio.gather(*(one(s) for s in aged_sessions)),
                         lambda: sum(s.outputs for s in aged_sessions))

    while True:
        cmd = await asyncio.to_thread(conn.recv)
        if cmd["op"] == "stop":
            break
        path, n, seconds, first = cmd["path"], cmd["n"], cmd["seconds"], cmd["first"]
        controls = int(cmd.get("controls") or 0)
        tails_given: list[int] = []
        feed, age_frames = cmd.get("feed", "plain"), int(cmd.get("age_frames", 0))
        age_concurrency = int(cmd.get("age_concurrency", AGE_CONCURRENCY))
        direct = path == "direct"
        before: Callable[[], Awaitable[None]] | None = None
        # every phase says which spectrogram and token writes its engine core runs
        melspec = await switch_lever(backend, "set_melspec", bool(cmd.get("melspec")))
        tokens = await switch_lever(backend, "set_token_writes", bool(cmd.get("tokens")))
        trim = await switch_lever(backend, "set_window_trim", cmd.get("trim") or False)
        if cmd.get("melspec") and not melspec.get("on"):
            conn.send({"error": f"sync-free spectrogram refused: {melspec.get('why_not')}"})
            continue
        if cmd.get("tokens") and not tokens.get("on"):
            conn.send({"error": f"incremental token writes refused: {tokens.get('why_not')}"})
            continue
        if cmd.get("trim") and trim.get("mode") != cmd.get("trim"):
            conn.send({"error": f"window-trimmed attention refused: {trim.get('why_not')}"})
            continue
        pin_at = tuple(cmd.get("pin_at") or (0, 1))
        try:  # before the phase's VAD helpers start: they inherit this process's CPUs
            pinned = pin_cpus(bool(cmd.get("pin")), *pin_at)
        except RuntimeError as exc:
            conn.send({"error": f"pinning refused: {exc}"})
            continue
        if path == "stock":
            starter: Callable[[int], Awaitable[Handle]] = theirs
        elif feed == "production":
            engine.direct_input = direct  # the manager's sessions take the engine's choice
            vad_box[:] = [vad.VadService(math.ceil(n / vad.STREAMS_PER_PROCESS))]

            async def starter(i: int) -> Handle:
                return await production(i)
        elif feed == "aged-production":
            # The production feed, its sessions aged first: the manager's first engine
            # session per stream starts with `age_frames` in bulk steps.
            engine.direct_input = direct
            vad_box[:] = [vad.VadService(math.ceil(n / vad.STREAMS_PER_PROCESS))]
            if not age_gate:
                age_gate.append(asyncio.Semaphore(age_concurrency))
            steps = age_frames // AGE_BULK
            from bench.voxtral_age import (
                aged_prompts,
                ageing_frames,
                ageing_outputs,
                stagger_tail,
            )

            sessions_aged = itertools.count()
            # Staggered (issue 34): session k of the whole phase (all front ends) takes
            # one more step of its share of a re-anchor cycle, so re-anchors spread over
            # the measured window; own tokens: the model's last output fed back.
            stagger = cmd.get("stagger") or {}
            own_tokens = bool(cmd.get("own_tokens"))
            aged_count = [0]  # sessions whose last large ageing step has its output

            def ageing(live: AsyncIterator[np.ndarray], tokens: asyncio.Queue[list[int]],
                       direct: bool, steps: int = steps,
                       count: Iterator[int] = sessions_aged, first: int = first,
                       stagger: dict[str, Any] = stagger, tails: list[int] = tails_given,
                       own_tokens: bool = own_tokens, aged_count: list[int] = aged_count,
                       ) -> AsyncIterator[Any]:
                k = next(count)  # sessions start at different places in the speech
                tail = (stagger_tail(first + k, int(stagger["total"]), int(stagger["every"]))
                        if stagger else 0)
                tails.append(tail)
                frames = ageing_audio(audio, (k * 7919 * FRAME) % audio.size,
                                      ageing_frames(steps, AGE_BULK, tail=tail))

                def aged() -> None:
                    aged_count[0] += 1

                return aged_prompts(backend, prefixed(frames, live), tokens, AGE_BULK, steps,
                                    direct, age_gate[0], tail=tail, own_tokens=own_tokens,
                                    on_aged=aged)

            ageing_wrapper = AgeingBackend(backend, ageing)
            engine._backend = ageing_wrapper
            opened.clear()

            async def starter(i: int) -> Handle:
                return await production(i)

            async def before(n: int = n + controls, steps: int = steps,
                             wrapper: AgeingBackend = ageing_wrapper,
                             aged_count: list[int] = aged_count,
                             stagger: dict[str, Any] = stagger) -> None:
                if not stagger:
                    await until_first_sessions_aged(opened, n, ageing_outputs(steps))
                else:  # ages differ: each session says when it is aged
                    async def all_there() -> None:
                        while aged_count[0] < n:  # noqa: ASYNC110
                            await asyncio.sleep(0.2)

                    await until_aged(all_there(), lambda: sum(
                        x[0].outputs for x in opened.values() if x))
                wrapper.open = False
        elif feed == "aged":
            aged_sessions.clear()
            before = all_aged

            async def starter(i: int, direct: bool = direct,
                              age_frames: int = age_frames) -> Handle:
                return await aged(i, direct, age_frames)
        else:
            async def starter(i: int, direct: bool = direct) -> Handle:
                return await ours(i, direct)
        segments: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(set_levers, backend, lv, pin_at)
            for lv in cmd.get("segments") or []]

        async def sync() -> None:  # the orchestrator answers once every front end is here
            conn.send({"ready": True})
            go = await asyncio.to_thread(conn.recv)
            if go.get("op") != "go":
                raise RuntimeError(f"expected go, got {go!r}")

        try:
            profiled = cmd.get("profile") and options.torch_profiler_dir and path != "stock"
            result = await _phase(n, seconds, audio, starter, first, before,
                                  cmd.get("profile"), gpu_profile if profiled else None,
                                  segments=segments or None,
                                  sync=sync if cmd.get("sync") else None,
                                  controls=controls,
                                  control_speed=float(cmd.get("control_speed") or 0.97),
                                  counters=reanchor_counters if cmd.get("strict") else None,
                                  warm_s=float(cmd.get("warm_s") or WARM_S),
                                  deadline=cmd.get("deadline"))
            if tails_given:
                result["age_tails_frames"] = tails_given
            if path == "stock":
                result["stock_rollovers"] = stock_rollovers[0]
            result["feed"] = "plain" if path == "stock" else feed
            result["melspec"] = bool(melspec.get("on"))
            result["token_writes"] = bool(tokens.get("on"))
            result["window_trim"] = trim.get("mode") or False
            result["pin"] = pinned
            conn.send(result)
        except Exception as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            engine._backend = backend  # the aged-production feed's wrapper goes
            for service in vad_box:
                service.shutdown()
            vad_box.clear()
    await engine.aclose()
    conn.send({"stopped": True})


async def set_levers(backend: Any, levers: dict[str, Any],
                     pin_at: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """Switch the engine core's three levers to `levers` (melspec, tokens: bool; trim:
    False, "blocks" or "keys"), and pinning (`pin`, this front end's slot of `pin_at`), and
    say what runs; a lever that will not switch fails the window (an A/B whose B did not
    run is no A/B)."""
    said: dict[str, Any] = {"pin": bool(pin_cpus(bool(levers.get("pin")), *pin_at))}
    for setter, key in (("set_melspec", "melspec"), ("set_token_writes", "tokens"),
                        ("set_window_trim", "trim")):
        want = levers.get(key) or False
        answer = await switch_lever(backend, setter, want)
        got = (answer.get("mode") or False) if key == "trim" else bool(answer.get("on"))
        if got != want:
            raise RuntimeError(f"{key} {want!r} refused: {answer.get('why_not')}")
        said[key] = got
    return said


_USABLE_CPUS: set[int] = set()


def cpu_groups(usable: set[int]) -> list[list[int]]:
    """The usable CPUs grouped by physical core (hardware-thread siblings), in CPU order."""
    groups: dict[str, list[int]] = {}
    for cpu in sorted(usable):
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                       "thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values())


def pin_plan(slot: int, of: int, usable: set[int]) -> tuple[set[int], set[int]]:
    """(the CPUs of engine core `slot` of `of`, the CPUs everything else keeps): engines
    take whole physical cores from the top (CPU 0 takes the interrupts), the rest keep
    every other core."""
    groups = cpu_groups(usable)
    if len(groups) < of + 2:
        raise RuntimeError(f"{len(groups)} physical cores cannot give {of} engine cores one "
                           "each and keep two for the rest")
    mine = set(groups[len(groups) - 1 - slot])
    rest = usable - {c for g in groups[len(groups) - of:] for c in g}
    return mine, rest


def _set_cpus(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` onto `cpus` (affinity is per thread; new threads inherit
    their creator's); the threads set."""
    done = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)
                done += 1
    return done


def pin_cpus(on: bool, slot: int, of: int) -> list[int] | bool:
    """From a front-end process: with `on`, its engine-core process onto a physical core of
    its own (`pin_plan`) and this process and its other children (VAD helpers) off every
    engine's core; else all of them back onto the CPUs the process started with. Returns
    the engine core's CPUs, or False."""
    import psutil

    if not _USABLE_CPUS:
        _USABLE_CPUS.update(os.sched_getaffinity(0))
    usable = set(_USABLE_CPUS)
    mine, rest = pin_plan(slot, of, usable) if on else (usable, usable)
    cores = 0
    for child in psutil.Process().children(recursive=True):
        try:
            name = " ".join([child.name(), *child.cmdline()])
        except psutil.Error:
            continue
        is_core = "EngineCore" in name
        moved = _set_cpus(child.pid, mine if is_core else rest)
        cores += is_core and moved > 0
    if on and not cores:
        raise RuntimeError("no engine-core process among this front end's children took "
                           "the CPUs")
    _set_cpus(os.getpid(), rest)
    return sorted(mine) if on else False


async def until_aged(done: Awaitable[Any], steps: Callable[[], int],
                     stall_s: float = AGE_STALL_S, every_s: float = 1.0) -> None:
    """Await `done` while `steps()` (outputs of the ageing sessions) keeps growing; raise
    TimeoutError once it has not grown for `stall_s`."""
    task = asyncio.ensure_future(done)
    last, since = steps(), time.monotonic()
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=every_s)
            if finished:
                task.result()
                return
            now = steps()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= stall_s:
                raise TimeoutError(f"ageing stalled: no session got a step in {stall_s:.0f} s "
                                   f"({now} steps so far)")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class FrontEnd:
    """A front-end process and its pipe."""

    age_concurrency = AGE_CONCURRENCY

    def __init__(self, index: int, options: VllmEngineOptions) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_front_end, args=(child, options), daemon=False)
        self.proc.start()
        self.info: dict[str, Any] = {}

    async def ready(self, timeout_s: float = 480.0) -> dict[str, Any]:
        if not await asyncio.to_thread(self.conn.poll, timeout_s):
            raise RuntimeError(f"front end {self.index} did not start in {timeout_s:.0f} s")
        self.info = self.conn.recv()
        if "error" in self.info:
            raise RuntimeError(f"front end {self.index}: {self.info['error']}")
        return self.info

    async def phase(self, path: str, n: int, seconds: float, first: int,
                    feed: str = "plain", age_frames: int = 0,
                    profile: str | None = None, melspec: bool = False,
                    tokens: bool = False, trim: bool | str = False,
                    segments: list[dict[str, Any]] | None = None,
                    barrier: asyncio.Barrier | None = None, pin: bool = False,
                    pin_at: tuple[int, int] = (0, 1), **strict: Any) -> dict[str, Any]:
        """One phase on this front end. `strict` (bench.capacity.strict): `strict`,
        `controls`, `control_speed`, `stagger` ({"total", "every"}), `own_tokens`,
        `warm_s`."""
        self.conn.send({"op": "phase", "path": path, "n": n, "seconds": seconds,
                        "first": first, "feed": feed, "age_frames": age_frames,
                        "age_concurrency": self.age_concurrency, "profile": profile,
                        "melspec": melspec, "tokens": tokens, "trim": trim,
                        "pin": pin, "pin_at": list(pin_at),
                        "segments": segments, "sync": barrier is not None, **strict})
        result: dict[str, Any] = await asyncio.to_thread(self.conn.recv)
        if barrier is not None and "ready" in result:  # aged: start the windows together
            with contextlib.suppress(asyncio.BrokenBarrierError):
                await barrier.wait()
            self.conn.send({"op": "go"})
            result = await asyncio.to_thread(self.conn.recv)
        elif barrier is not None:  # failed before its windows: the others must not wait
            await barrier.abort()
        if "error" in result:
            raise RuntimeError(f"front end {self.index} ({path}, {n}): {result['error']}")
        return result

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send({"op": "stop"})
            await asyncio.to_thread(self.conn.poll, 60)
        await asyncio.to_thread(self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()


# ---- profiles -------------------------------------------------------------------------
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


# ---- orchestration --------------------------------------------------------------------
def plan(config: str, shared: bool = False) -> list[tuple[int, str]]:
    """(front end, path) pairs that run a configuration; sessions split evenly. With
    `shared`, one-engine configurations run on front end 1 (no engine of their own)."""
    config = base_of(config)
    path = "direct" if "direct" in config else ("stock" if config == "stock" else "project")
    k = engines_of(config)
    return [(f, path) for f in range(1, k + 1)] if k > 1 else [(1 if shared else 0, path)]


def feed_of(config: str, production: bool, age_frames: int) -> str:
    """How a configuration's sessions are fed: vLLM's stock path is always fed as its
    server feeds it (new sessions: it cannot re-anchor, so it has no aged steady state).
    Aged with `--production`: through the session manager and VAD, each stream's engine
    session aged first."""
    if config == "stock":
        return "plain"
    if age_frames:
        return "aged-production" if production else "aged"
    return "production" if production else "plain"


def levers_of(config: str) -> dict[str, Any]:
    """The levers a configuration's phases run (the engine core's three, and pinning)."""
    return {"melspec": MELSPEC in config, "tokens": TOKENS in config, "trim": trim_of(config),
            "pin": PIN in config}


def ab_refusal(configs: list[str], windows: int) -> str | None:
    """Why these configurations cannot share an in-phase A/B, else None."""
    if len(configs) < 2:
        return "needs two or more of the project's configurations"
    if len({base_of(c) for c in configs}) != 1:
        return "the configurations must differ only in +melspec, +tokens, +trim, +keys or +pin"
    if len({json.dumps(levers_of(c), sort_keys=True) for c in configs}) != len(configs):
        return "two configurations run the same levers"
    if windows < 2 * len(configs):
        return f"{windows} windows give some configuration fewer than two"
    return None


def ab_windows(configs: list[str], windows: int) -> list[dict[str, Any]]:
    """The in-phase A/B's windows: the configurations' levers in turn (A B A B …)."""
    return [levers_of(configs[j % len(configs)]) for j in range(windows)]


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
                                       for j in mine), 1) for a in answers]}
    return rows


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
                        trim=levers["trim"], segments=segments, barrier=barrier,
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
        torch_dir = (str((Path(args.profile_dir) / f"torch-fe{f}").resolve())
                     if args.gpu_profile and args.profile_dir else None)
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


def host_fingerprint() -> dict[str, Any]:
    """What the knee depends on besides the GPU: the host's CPU (hosts differ a lot)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), **cpu_topology(), "gpu": gpu,
            "mps": mps_servers()}


def cpu_topology() -> dict[str, Any]:
    """Physical cores behind the logical CPUs this process may use: three engine cores,
    their front ends and VAD helpers on 16 hyperthreads of 8 cores are not on 16 cores."""
    usable = os.sched_getaffinity(0)
    return {"usable_cpus": len(usable), "physical_cores": len(cpu_groups(usable)) or None}


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("realtime_share", "frames_per_s_p50", "frames_per_s_min", "backlog_p99_s",
            "front_end_us_per_chunk", "engine_core_us_per_chunk", "helpers_us_per_chunk",
            "gpu_util_p50")
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--streams", type=int, default=64, help="one level (without --find-knee)")
    ap.add_argument("--find-knee", action="store_true",
                    help="climb --ladder; per configuration the largest level with ≥ 95 %% "
                         "of sessions real time")
    ap.add_argument("--ladder", type=int, nargs="+", default=[64, 96, 128, 160])
    ap.add_argument("--configs", nargs="+", default=["stock", "project", "project-x2"],
                    choices=CONFIGS)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="for the whole GPU; each engine gets its share")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per level, order rotated; the median is reported")
    ap.add_argument("--age-min", type=float, nargs="+", default=None,
                    help="with --aged-ladder: after the knee, the project's configurations "
                         "at those levels with sessions aged this many minutes (first "
                         "value); alone: cost per chunk of sessions aged this many minutes, "
                         "with and without re-anchoring (bench.voxtral_age)")
    ap.add_argument("--aged-ladder", type=int, nargs="+", default=None)
    ap.add_argument("--production", action="store_true",
                    help="feed the project's sessions as an ASR actor does: a session "
                         "manager per stream with voice activity in helper processes")
    ap.add_argument("--share-front-end", action="store_true",
                    help="one-engine configurations run on front end 1 of the -x2 pair "
                         "(no third engine: the pair keeps the GPU's memory)")
    ap.add_argument("--profile-dir", default=None,
                    help="py-spy the front ends (and their children) at --profile-level")
    ap.add_argument("--profile-level", type=int, default=None,
                    help="the level (new sessions and aged) to profile")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="with --profile-dir: also vLLM's torch profiler in the engine cores "
                         "at --profile-level (`gpu_profile` per phase: GPU busy share, GPU "
                         "time per step, top kernels)")
    ap.add_argument("--partial", default=None,
                    help="write the rows measured so far to this file after every phase")
    ap.add_argument("--age-concurrency", type=int, default=AGE_CONCURRENCY,
                    help="sessions per front end in their bulk ageing steps at once")
    ap.add_argument("--aged-ab", action="store_true",
                    help="aged levels: one phase for all the project's configurations, "
                         "which must differ only in their engine-core levers, switched in "
                         "turn over --ab-windows windows of --seconds on the same aged "
                         "sessions (no second ageing, no phase order)")
    ap.add_argument("--ab-windows", type=int, default=4,
                    help="windows of an --aged-ab phase (A B A B …)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the engines' KV cache element type (engine.vllm.kv_cache_dtype)")
    ap.add_argument("--kv-trace", default=None,
                    help="folder: the engines' schedulers write where their KV cache is, "
                         "and each phase reports it (`kv`)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.gpu_profile and not (args.profile_dir and args.profile_level):
        ap.error("--gpu-profile needs --profile-dir and --profile-level")
    if args.aged_ab:
        why = ab_refusal([c for c in args.configs if c != "stock"], args.ab_windows)
        if why:
            ap.error(f"--aged-ab: {why}")
    if args.age_min is not None and not args.aged_ladder:
        from bench import voxtral_age

        aged = argparse.Namespace(
            model=args.model, streams=args.streams, seconds=args.seconds,
            age_min=args.age_min, every=4096, bulk=AGE_BULK,
            max_model_len=max(args.max_model_len, 32768), load_format=args.load_format,
            gpu_memory_utilization=args.gpu_memory_utilization)
        result = asyncio.run(voxtral_age.main_async(aged))
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    if args.kv_trace:  # read by the engine cores' schedulers, which inherit it
        Path(args.kv_trace).mkdir(parents=True, exist_ok=True)
        os.environ[TRACE_ENV] = str(Path(args.kv_trace).resolve())
    result = asyncio.run(main_async(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
