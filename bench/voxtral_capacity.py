"""Voxtral capacity on one GPU: N real-time-paced sessions through the project's `vllm`
engine, then the same N through vLLM's own realtime serving path
(`OpenAIServingRealtime.transcribe_realtime`), in the same run and on the same AsyncLLM:
after a warm-up phase the two paths alternate for `--rounds` rounds.

    python -m bench.voxtral_capacity --model DIR [--streams 64] [--seconds 30] --json

Each session is fed 80 ms of audio every 80 ms (real speech, looped). A session is
real time when it decodes ≥ 12.0 frames/s (12.5 is exact real time) over the
measured window; backlog is audio fed minus audio decoded at the end. Random
weights (`--load-format dummy`) give random text and a real cost per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engines.base import SessionOptions  # noqa: E402
from workers.engines.vllm_voxtral import VllmEngineOptions, VllmVoxtralEngine  # noqa: E402
from workers.events import AudioChunk  # noqa: E402

FRAME = 1280
REALTIME_FPS = 12.0


def speech() -> np.ndarray:
    import soundfile

    data, _ = soundfile.read(str(ROOT / "examples" / "audio" / "room-a.flac"), dtype="int16")
    return np.asarray(data, dtype=np.int16)


async def _gpu_util(stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        try:
            res = await asyncio.to_thread(
                subprocess.run, ["nvidia-smi", "--query-gpu=utilization.gpu",
                                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5)
            out.append(float(res.stdout.split()[0]))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        await asyncio.sleep(1.0)


async def _phase(n: int, seconds: float, audio: np.ndarray,
                 start: Callable[[int], Awaitable[tuple[Callable[[np.ndarray], None],
                                                        Callable[[], int],
                                                        Callable[[], Awaitable[None]]]]]
                 ) -> dict[str, Any]:
    """Run n sessions; `start(i)` returns (push a PCM16 frame, outputs so far, close)."""
    handles = [await start(i) for i in range(n)]
    stop = asyncio.Event()
    util: list[float] = []
    util_task = asyncio.create_task(_gpu_util(stop, util))
    warm = 3.0
    t0 = time.monotonic()
    frames = int(seconds / 0.08)
    counts_at_warm: list[int] = []

    async def pace(i: int) -> None:
        push = handles[i][0]
        offset = (i * 7919 * FRAME) % (audio.size - FRAME)
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))
            j = (offset + k * FRAME) % (audio.size - FRAME)
            push(audio[j : j + FRAME])  # PCM16, as a client sends it

    async def mark() -> None:
        await asyncio.sleep(warm)
        counts_at_warm.extend(h[1]() for h in handles)

    await asyncio.gather(*(pace(i) for i in range(n)), mark())
    elapsed = time.monotonic() - t0 - warm
    final = [h[1]() for h in handles]
    stop.set()
    await util_task
    for h in handles:
        await h[2]()
    fps = [(f - w) / elapsed for f, w in zip(final, counts_at_warm, strict=True)]
    backlog = sorted(seconds - f * 0.08 for f in final)
    return {
        "streams": n,
        "realtime_streams": sum(1 for x in fps if x >= REALTIME_FPS),
        "frames_per_s_p50": round(statistics.median(fps), 2),
        "frames_per_s_min": round(min(fps), 2),
        "backlog_p99_s": round(backlog[min(len(backlog) - 1, int(0.99 * len(backlog)))], 2),
        "gpu_util": round(statistics.median(util), 1) if util else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    engine = VllmVoxtralEngine(VllmEngineOptions(
        model=args.model, max_streams=args.streams, max_model_len=args.max_model_len,
        load_format=args.load_format, gpu_memory_utilization=args.gpu_memory_utilization))
    t = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - t
    audio = speech()

    async def ours(i: int) -> Any:
        session = engine.open_session(SessionOptions(f"ours{i}", "auto"))
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

    # vLLM's own serving path, on the same AsyncLLM.
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.speech_to_text.realtime.serving import OpenAIServingRealtime

    backend: Any = engine.backend
    llm = backend.llm
    serving = OpenAIServingRealtime(
        llm, OpenAIServingModels(llm, [BaseModelPath(name="voxtral", model_path=args.model)]),
        request_logger=None)

    async def theirs(i: int) -> Any:
        audio_q: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        count = [0]
        rid = f"base-{i}-{uuid.uuid4().hex[:8]}"

        async def audio_gen() -> AsyncIterator[np.ndarray]:
            while (a := await audio_q.get()) is not None:
                yield a

        async def run() -> None:
            gen = llm.generate(prompt=serving.transcribe_realtime(audio_gen(), tokens),
                               sampling_params=backend.sampling, request_id=rid)
            async for out in gen:
                if out.outputs:
                    count[0] += 1
                    tokens.put_nowait(list(out.outputs[0].token_ids))

        task = asyncio.create_task(run())

        async def close() -> None:
            await llm.abort(rid)
            task.cancel()

        def push(frame: np.ndarray) -> None:
            # vLLM's realtime connection converts each PCM16 frame the same way.
            audio_q.put_nowait(frame.astype(np.float32) / 32768.0)

        return push, (lambda: count[0]), close

    # Warm the engine at this batch size first (graph capture, first-shape compiles),
    # then alternate the two paths so neither gets the cold or the warm slot.
    await _phase(args.streams, min(8.0, args.seconds), audio, theirs)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        rounds.append({"baseline": await _phase(args.streams, args.seconds, audio, theirs),
                       "project": await _phase(args.streams, args.seconds, audio, ours)})
    await engine.aclose()
    project, baseline = rounds[-1]["project"], rounds[-1]["baseline"]
    ratio = (project["realtime_streams"] / baseline["realtime_streams"]
             if baseline["realtime_streams"] else None)
    return {**project, "vllm_version": vllm.__version__, "engine_start_s": round(start_s, 1),
            "seconds": args.seconds, "baseline_vllm_serving": baseline,
            "realtime_ratio_vs_baseline": ratio,
            "fps_ratio_vs_baseline": round(project["frames_per_s_p50"]
                                           / baseline["frames_per_s_p50"], 3),
            "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--rounds", type=int, default=2,
                    help="baseline/project rounds after a warm-up; the last one is reported")
    ap.add_argument("--age-min", type=float, nargs="+", default=None,
                    help="instead: cost per chunk of sessions aged this many minutes, with "
                         "and without re-anchoring (bench.voxtral_age)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.age_min is not None:
        from bench import voxtral_age

        aged = argparse.Namespace(
            model=args.model, streams=args.streams, seconds=args.seconds,
            age_min=args.age_min, every=4096, bulk=750,
            max_model_len=max(args.max_model_len, 32768), load_format=args.load_format,
            gpu_memory_utilization=args.gpu_memory_utilization)
        result = asyncio.run(voxtral_age.main_async(aged))
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    result = asyncio.run(main_async(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
