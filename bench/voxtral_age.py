"""What a Voxtral session costs per 80 ms chunk as it ages, with and without re-anchoring,
on one GPU, in one run.

    python -m bench.voxtral_age --model DIR [--streams 16] [--age-min 0 30] --json

One AsyncLLM with the re-anchoring plugin. For each age and mode (`reanchor`: sessions
re-anchor every `--every` positions; `rollover`: stock sessions, as vLLM keeps them
until a rollover), `--streams` sessions are first aged — fed `age` minutes of audio in
bulk prompts of `--bulk` frames with blank tokens fed back, which builds the same token
history, positions, features and KV as real-time decoding would, in seconds instead of
minutes — then decoded at real-time pace for `--seconds`, and measured: CPU per chunk
of this process (vLLM's front end and the feeding loop) and of the engine-core process
(scheduler, model runner), frames/s per session, GPU utilisation. Phases alternate
between the modes, so neither gets the warm slot. `max_model_len` must hold the oldest
stock session (30 min = 22,500 positions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.ageing import ALIGN, Session  # noqa: E402
from bench.capacity.feed import speech  # noqa: E402
from bench.capacity.host import _gpu_util  # noqa: E402
from workers.engines.vllm.engine import VllmEngineOptions, VllmVoxtralEngine  # noqa: E402

FRAME = 1280


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _core_pid() -> int:
    import os

    import psutil

    kids = psutil.Process(os.getpid()).children(recursive=True)
    named = [p.pid for p in kids if "EngineCore" in " ".join([*p.cmdline(), p.name()])]
    return int((named or [p.pid for p in kids])[0])


async def phase(backend: Any, mode: str, every: int, age_min: float, n: int, seconds: float,
                bulk: int, audio: np.ndarray) -> dict[str, Any]:
    age_frames = int(age_min * 60 / 0.08) // bulk * bulk
    sessions = [Session(backend, every if mode == "reanchor" else None, age_frames, bulk,
                        audio, (i * 7919 * FRAME) % audio.size) for i in range(n)]
    t_age = time.monotonic()
    await asyncio.gather(*(s.aged.wait() for s in sessions))
    aged_s = time.monotonic() - t_age
    core = _core_pid()
    stop = asyncio.Event()
    util: list[float] = []
    util_task = asyncio.create_task(_gpu_util(stop, util))
    warm, t0 = 2.0, time.monotonic()
    frames = int((seconds + warm) / 0.08)
    marks: dict[str, Any] = {}

    async def pace(s: Session) -> None:
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))
            s.push()

    async def mark() -> None:
        await asyncio.sleep(warm)
        marks["start"] = (time.monotonic(), time.process_time(), _cpu(core),
                          [s.outputs for s in sessions])

    await asyncio.gather(*(pace(s) for s in sessions), mark())
    t1, f1, c1 = time.monotonic(), time.process_time(), _cpu(core)
    t0m, f0, c0, o0 = marks["start"]
    decoded = sum(s.outputs for s in sessions) - sum(o0)
    stop.set()
    await util_task
    for s in sessions:
        await s.close(backend)
    fps = [(s.outputs - o) / (t1 - t0m) for s, o in zip(sessions, o0, strict=True)]
    return {
        "mode": mode, "age_min": age_min, "streams": n, "aged_in_s": round(aged_s, 1),
        "frames_per_s_p50": round(statistics.median(fps), 2),
        "realtime_streams": sum(1 for x in fps if x >= 12.0),
        "front_cpu_us_per_chunk": round((f1 - f0) / max(1, decoded) * 1e6),
        "core_cpu_us_per_chunk": round((c1 - c0) / max(1, decoded) * 1e6),
        "gpu_util": round(statistics.median(util), 1) if util else None,
    }


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    import vllm

    engine = VllmVoxtralEngine(VllmEngineOptions(
        model=a.model, max_streams=a.streams, max_model_len=a.max_model_len,
        load_format=a.load_format, gpu_memory_utilization=a.gpu_memory_utilization,
        reanchor="on", reanchor_every=a.every,
        max_num_batched_tokens=max(a.bulk * 2, 400 * a.streams)))
    t = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - t
    audio = speech()
    backend: Any = engine.backend
    await phase(backend, "rollover", a.every, 0, a.streams, 4.0, a.bulk, audio)  # warm-up
    await phase(backend, "reanchor", a.every, 0, a.streams, 4.0, a.bulk, audio)
    results: list[dict[str, Any]] = []
    for i, age in enumerate(a.age_min):
        order = ("reanchor", "rollover") if i % 2 == 0 else ("rollover", "reanchor")
        for mode in order:
            results.append(await phase(backend, mode, a.every, age, a.streams, a.seconds,
                                       a.bulk, audio))
    counts = dict(engine.reanchor_counts)
    counts.pop("shift_by_request", None)
    await engine.aclose()
    return {"vllm_version": vllm.__version__, "engine_start_s": round(start_s, 1),
            "reanchoring": engine.reanchoring, "probe": engine.reanchor_probe,
            "every": a.every, "max_model_len": a.max_model_len, "seconds": a.seconds,
            "phases": results, "reanchor_stats": counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--age-min", type=float, nargs="+", default=[0.0, 30.0])
    ap.add_argument("--every", type=int, default=4096, help="positions between re-anchors")
    ap.add_argument("--bulk", type=int, default=768,
                    help=f"frames per ageing prompt (a multiple of {ALIGN})")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(main_async(a))
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
