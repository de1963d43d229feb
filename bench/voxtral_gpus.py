"""Voxtral capacity on the GPUs of one host, through Ray and the router, in one run: does
N GPUs hold N × what one holds?

    python -m bench.voxtral_gpus --model DIR --gpus 2 [--engines-per-gpu 2] \\
        [--ladder 32 48 64] [--seconds 20] [--kv-cache-dtype fp8] --json

A local Redis and Ray. Per GPU, `--engines-per-gpu` ASR actors (`AsrActor`: an ASR host
over the project's `vllm` engine, `1/engines-per-gpu` of a GPU in Ray and of
`--gpu-memory-utilization`, as `engine.vllm.engines_per_gpu` places them), every engine
started before anything is measured. Then for each ladder level L (streams per GPU), in
this order:
- `one`: L streams over the actors of one GPU;
- `all`: L × GPUs streams over every actor;
each stream placed by the router (`orchestrator.router.Router`, budget L / engines per GPU
rounded up) and fed real speech (examples/audio/room-a.flac, each stream from its own
offset) into Redis in 100 ms chunks at real-time pace, as ingest feeds it, for `--seconds`.
Afterwards the streams are removed from their actors.

A stream is real time when, from 3 s in, the 90th percentile of its ASR host's
`caption_lag_s` (a caption's emission minus the wall time its last audio was captured,
sampled every second) is at most `--max-lag` s, and its latest caption is at most
`--max-lag` s old at the end. A level holds when ≥ 95 % of its streams are real time. The
knee of `one` and of `all` is the largest level held with every lower level held too;
`ratio` = all's streams at its knee / one's at its knee (2 GPUs: ≈ 2 is the goal).

Random weights (`--load-format dummy`) write random text, and each output still costs what
it costs. New sessions only (bench.voxtral_capacity measures aged ones per GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.feed import speech  # noqa: E402
from bench.capacity.host import host_fingerprint  # noqa: E402
from bench.capacity.knee import knees  # noqa: E402

WARM_S = 3.0
CHUNK = 1600  # 100 ms at 16 kHz, as ingest writes it
REALTIME_SHARE = 0.95

ActorFactory = Callable[[str, float, Any], Any]
"""(actor id, GPU share, AsrHostOptions) -> a Ray actor handle with the ASR actor's API."""


def gpu_of(state: dict[str, Any]) -> str:
    """The GPU Ray gave an actor (its state's `gpus`), or "?" without one."""
    gpus = state.get("gpus") or []
    return str(gpus[0]) if gpus else "?"


def stream_realtime(lags: Sequence[float], last_age_s: float | None, max_lag: float) -> bool:
    """Real time: the stream's caption lag stayed low (90th percentile of the samples)
    and its captions still came at the end."""
    if not lags or last_age_s is None or last_age_s > max_lag:
        return False
    ranked = sorted(lags)
    return ranked[math.ceil(0.9 * len(ranked)) - 1] <= max_lag  # nearest rank


async def phase(actors: dict[str, Any], name: str, n: int, per_actor: int, seconds: float,
                bus: Any, audio: np.ndarray, max_lag: float, tag: str) -> dict[str, Any]:
    """n streams over `actors` through the router; fed in real time; lags sampled."""
    from orchestrator.actor_options import stream_options
    from orchestrator.config import parse_event
    from orchestrator.router import Router
    from workers.events import AudioChunk

    ids = [f"{tag}-s{i}" for i in range(n)]
    cfg = parse_event(  # the streams only: the actors here are the bench's own
        f"event: gpus\nengine: {{actors: {len(actors)}, streams_per_actor: {per_actor}}}\n"
        "streams:\n" + "".join(
        f"  - {{id: {sid}, source: push, language: en}}\n" for sid in ids))
    router = Router(budget=per_actor, actors=list(actors))
    placed: dict[str, str] = {}
    for s in cfg.streams:
        placed[s.id] = router.place(s.id)
        await actors[placed[s.id]].add_stream.remote(stream_options(s, cfg.translation))
    offsets = [(i * 7919 * CHUNK) % (audio.size - CHUNK) for i in range(n)]
    lags: dict[str, list[float]] = {sid: [] for sid in ids}
    ages: dict[str, float | None] = dict.fromkeys(ids)
    stop = asyncio.Event()

    async def feed() -> None:
        t0 = time.monotonic()
        for k in range(int(seconds * 10)):
            await asyncio.sleep(max(0.0, t0 + k * 0.1 - time.monotonic()))
            now = time.time()
            for sid, off in zip(ids, offsets, strict=True):
                j = (off + k * CHUNK) % (audio.size - CHUNK)
                await bus.add_audio(AudioChunk(sid, k * CHUNK, audio[j:j + CHUNK].tobytes(),
                                               now))
        stop.set()

    async def sample() -> None:
        await asyncio.sleep(WARM_S)
        while True:
            health = await asyncio.gather(*(a.health.remote() for a in actors.values()))
            for h in health:
                for sid, st in h.get("streams", {}).items():
                    if sid in lags and "caption_lag_s" in st:
                        lags[sid].append(float(st["caption_lag_s"]))
                        ages[sid] = float(st["caption_lag_age_s"])
            if stop.is_set():
                return
            await asyncio.sleep(1.0)

    try:
        await asyncio.gather(feed(), sample())
    finally:
        for sid, actor in placed.items():
            await actors[actor].remove_stream.remote(sid)
    realtime = [sid for sid in ids if stream_realtime(lags[sid], ages[sid], max_lag)]
    p50s = [statistics.median(v) for v in lags.values() if v]
    return {
        "gpus": name, "streams": n, "actors": len(actors),
        "streams_per_actor": {a: sum(1 for x in placed.values() if x == a) for a in actors},
        "realtime_streams": len(realtime), "realtime_share": round(len(realtime) / n, 3),
        "caption_lag_p50_s": round(statistics.median(p50s), 2) if p50s else None,
        "caption_lag_max_s": round(max(max(v) for v in lags.values() if v), 2)
        if any(lags.values()) else None,
        "streams_without_captions": sum(1 for v in lags.values() if not v),
    }


async def run(args: argparse.Namespace, make_actor: ActorFactory | None = None,
              redis_url: str | None = None) -> dict[str, Any]:
    """The bench; `make_actor` and `redis_url` are injected by tests (a FAKE engine's
    actor, the test Redis); otherwise AsrActors over the vllm engine and a local Redis."""
    import ray

    from orchestrator.redis_server import LocalRedisServer
    from workers.asr import AsrHostOptions
    from workers.bus import RedisBus, connect_redis

    local = None
    if redis_url is None:
        local = LocalRedisServer()
        local.start()
        redis_url = local.url
    per_gpu = args.engines_per_gpu
    top = max(args.ladder)
    per_actor = math.ceil(top / per_gpu)
    if make_actor is None:
        make_actor = vllm_actor_factory(args, per_actor)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    redis = connect_redis(redis_url)
    bus = RedisBus(redis)
    audio = speech()
    handles: dict[str, Any] = {}
    out: dict[str, Any] = {"host": host_fingerprint(), "gpus": args.gpus,
                           "engines_per_gpu": per_gpu, "ladder": sorted(args.ladder),
                           "seconds": args.seconds, "max_lag_s": args.max_lag}
    try:
        for i in range(args.gpus * per_gpu):
            aid = f"bench-gpus-asr-{i}"
            handles[aid] = make_actor(aid, 1.0 / per_gpu, AsrHostOptions(
                actor_id=aid, redis_url=redis_url, max_streams=per_actor))
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(h.health.remote() for h in handles.values())),
                               args.start_timeout)
        out["engines_started_in_s"] = round(time.monotonic() - t0, 1)
        states = dict(zip(handles, await asyncio.gather(
            *(h.state.remote() for h in handles.values())), strict=True))
        by_gpu: dict[str, list[str]] = {}
        for aid, st in states.items():
            by_gpu.setdefault(gpu_of(st), []).append(aid)
        out["actors_by_gpu"] = by_gpu
        first = sorted(by_gpu)[0]
        groups: dict[str, dict[str, Any]] = {
            "one": {a: handles[a] for a in by_gpu[first]}, "all": handles}
        levels: dict[int, dict[str, list[dict[str, Any]]]] = {}
        alive = ["one", "all"]
        for n in sorted(args.ladder):
            levels[n] = {}
            for name in alive:
                scale = 1 if name == "one" else len(by_gpu)
                row = await phase(groups[name], name, n * scale,
                                  math.ceil(n / per_gpu), args.seconds, bus, audio,
                                  args.max_lag, f"l{n}-{name}")
                levels[n][name] = [row]
                print(json.dumps(row), file=sys.stderr, flush=True)
            alive = [c for c in alive if levels[n][c][0]["realtime_share"] >= REALTIME_SHARE]
            if not alive:
                break
        found = knees(levels, ["one", "all"])
        out["by_level"] = {n: {c: rows[0] for c, rows in by.items()} for n, by in levels.items()}
        out["knee_streams_per_gpu"] = found
        one = found.get("one")
        every = found.get("all")
        out["knee_streams"] = {"one": one, "all": every * len(by_gpu) if every else None}
        out["ratio"] = (round(every * len(by_gpu) / one, 3) if one and every else None)
    finally:
        for handle in handles.values():
            ray.kill(handle, no_restart=True)
        await redis.aclose()
        if local is not None:
            local.stop()
    return out


def vllm_actor_factory(args: argparse.Namespace, per_actor: int) -> ActorFactory:
    import ray

    from orchestrator.ray_actors import AsrActor
    from workers.engines.vllm.engine import VllmEngineOptions

    engine = VllmEngineOptions(
        model=args.model, max_streams=per_actor, max_model_len=args.max_model_len,
        load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=round(args.gpu_memory_utilization / args.engines_per_gpu, 4))

    def make(aid: str, share: float, host: Any) -> Any:
        cls = ray.remote(num_cpus=0, num_gpus=share, max_restarts=0)(AsrActor)
        return cls.options(name=aid).remote(host, engine)

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--engines-per-gpu", type=int, default=2)
    ap.add_argument("--ladder", type=int, nargs="+", default=[32, 48, 64],
                    help="streams per GPU")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-lag", type=float, default=3.0)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="for each whole GPU; each engine gets its share")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
