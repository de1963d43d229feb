"""The ASR actor's own CPU per 80 ms chunk, against the strict bench's front end, in one run
(issue 34: what the product adds on top of the engine at the knee).

    python -m bench.actor_cpu --json [--streams 25] [--seconds 30] [--rounds 2] [--profile 15]

The strict capacity bench feeds each engine's sessions from a front-end process of its own
(session manager, VAD helpers, the engine's session code, vLLM's AsyncLLM): 1,418 µs of CPU
per chunk at 25 aged sessions on the H200. An ASR actor in `babelcast run` does that and
more in its one event loop: it reads every stream's audio from Redis (one XREAD for all),
guards each stream's backlog, segments the words into captions, publishes them (XADD,
status fields), enqueues translation jobs and reports its figures every second. The whole
product on an H100 (bench/results/product/2026-12-05-h100-vllm-x3-45.json) spent 6.3 ms
of ASR CPU per chunk, of which the engine cores and VAD helpers account for ~2.7 ms by the
strict bench's parts: if the actor's own process carries the rest, its loop is full near
25 streams, whatever the GPU holds.

This bench measures that part where vLLM cannot run. Two legs over the same N streams,
alternated `--rounds` times in one run, both on the `vllm` engine's real session code over
the FAKE vLLM backend (tests/fake_vllm.py, clearly a stand-in: its own cost is in both
legs' figures, the same in each), the engine's shared 80 ms tick on, VAD in helper
processes as GPU actors run it:

- `front_end`: bench.frontend_cpu's leg, the strict bench's production feed (a session
  manager per stream, chunks handed over in this process, spread over the 80 ms cycle);
- `actor`: the real `AsrHost` (workers/asr/host.py) with its streams added as the
  supervisor adds them (one translation target each), a real `redis-server`, and a
  separate feeder process that writes each stream's 80 ms chunks to `audio:{stream}` at
  wall pace, spread over the cycle, as gateway workers do for push streams.

Per leg: `us_per_chunk` (this process's CPU over the measured window per chunk handed to a
session), `helpers_us_per_chunk` (the VAD helpers); for the actor also the captions and
translation jobs it wrote and its worst stream's caption lag at the end. `actor_over_front
_end` is the ratio of the medians. With `--profile S`, one more actor leg runs under
cProfile for S seconds and `profile` lists where its CPU went, by module and by function
(cProfile's own cost inflates call-heavy code; read the shares, not the microseconds).
A CPU host's figures, not the H200's: the ratio and the shares carry over, the µs do not.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import math
import multiprocessing
import os
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.results import stamp  # noqa: E402
from bench.report import emit  # noqa: E402
from bench.system import pct  # noqa: E402

FRAME = 1280  # 80 ms at 16 kHz
CHUNK_S = FRAME / 16000


def _feeder(redis_url: str, streams: list[str], seconds: float, ready: Any) -> None:
    """A separate process: each stream's 80 ms chunks to Redis at wall pace, stream i's at
    i/N of the way into the cycle (independent encoders), the real speech looped."""
    sys.path.insert(0, str(ROOT))
    from bench.capacity.feed import speech
    from workers.bus import RedisBus, connect_redis
    from workers.events import AudioChunk

    audio = speech()

    async def main() -> None:
        bus = RedisBus(connect_redis(redis_url))
        ready.set()
        t0 = time.time() + 0.5
        n = len(streams)
        offsets = [(i * 7919 * FRAME) % (audio.size - FRAME) for i in range(n)]
        slots = [(i / n * CHUNK_S, i) for i in range(n)]
        k = 0
        while (k + 1) * CHUNK_S <= seconds:
            base = t0 + (k + 1) * CHUNK_S
            for at, i in slots:
                delay = base + at - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                j = (offsets[i] + k * FRAME) % (audio.size - FRAME)
                await bus.add_audio(AudioChunk(streams[i], k * FRAME,
                                               audio[j:j + FRAME].tobytes(), base + at))
            k += 1
        await bus.redis.aclose()

    asyncio.run(main())


async def _commands(redis: Any) -> dict[str, int]:
    """Redis's own count of each command since it started (INFO commandstats): the
    feeder's XADDs are in it too (one per chunk), and this bench's own few reads."""
    info = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def _actor_leg(streams: int, seconds: float, warm_s: float, redis_url: str,
                     skip: frozenset[int], read_every_ms: int | None = None,
                     profile_s: float = 0.0) -> dict[str, Any]:
    import uuid

    from bench.capacity.host import _children_cpu_s
    from tests.fake_vllm import FakeVllmBackend
    from workers.asr import AsrHost, AsrHostOptions
    from workers.bus import captions_key
    from workers.engines import vad
    from workers.engines.vllm.engine import DEFAULT_GEOMETRY, VllmEngineOptions, VllmVoxtralEngine
    from workers.events import AudioChunk, StreamOptions

    engine = VllmVoxtralEngine(
        VllmEngineOptions(model="/fake", max_streams=streams, reanchor="off",
                          aligned_feed_ms=80),
        backend=FakeVllmBackend(text_every=3), geometry=DEFAULT_GEOMETRY)
    options = AsrHostOptions("bench-asr", redis_url, streams, vad_process=True,
                             vad_processes=math.ceil(streams / vad.STREAMS_PER_PROCESS))
    if read_every_ms is not None:
        options = replace(options, read_every_ms=read_every_ms)
    host = AsrHost(options, engine)
    await host.start()
    delays: list[float] = []  # a chunk's capture (its `wall`) to the read that returned it
    measuring = [False]
    read_audio = host.bus.read_audio

    async def timed_read(*args: Any, **kwargs: Any) -> Any:
        items = await read_audio(*args, **kwargs)
        if measuring[0]:
            now = time.time()
            delays.extend(now - item.wall for _s, _e, item in items
                          if isinstance(item, AudioChunk))
        return items

    host.bus.read_audio = timed_read  # type: ignore[method-assign]
    tag = uuid.uuid4().hex[:6]
    ids = [f"a{tag}-{i}" for i in range(streams)]
    for sid in ids:
        await host.add_stream(StreamOptions(stream_id=sid, name=sid, source="push",
                                            language="en", targets=("pt",)))
    measure_s = profile_s or seconds
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    feeder = ctx.Process(target=_feeder, args=(redis_url, ids, warm_s + measure_s + 2.0, ready),
                         daemon=True)
    feeder.start()
    skip = skip | {feeder.pid or 0}  # its CPU is the encoders', not the actor's
    try:
        await asyncio.get_running_loop().run_in_executor(None, ready.wait, 60)
        await asyncio.sleep(0.5 + warm_s)
        redis = host.bus.redis

        async def captions() -> int:
            return sum([await redis.xlen(captions_key(sid, "en")) for sid in ids])

        before: dict[str, Any] = {
            "audio_s": host.audio_s, "cpu": time.process_time(),
            "kids": _children_cpu_s(skip)[1], "t": time.monotonic(),
            "captions": await captions(), "commands": await _commands(redis)}
        measuring[0] = True
        prof = cProfile.Profile(time.process_time) if profile_s else None
        if prof is not None:
            prof.enable()
        await asyncio.sleep(measure_s)
        if prof is not None:
            prof.disable()
        measuring[0] = False
        elapsed = time.monotonic() - before["t"]
        cpu = time.process_time() - before["cpu"]
        kids = _children_cpu_s(skip)[1] - before["kids"]
        chunks = max(1, round((host.audio_s - before["audio_s"]) / CHUNK_S))
        written = await captions() - before["captions"]
        after = await _commands(redis)
        commands = {c: round((n - before["commands"].get(c, 0)) / chunks, 3)
                    for c, n in sorted(after.items(), key=lambda kv: -kv[1])
                    if n > before["commands"].get(c, 0)}
        lag = host.lag_summary()
        out: dict[str, Any] = {
            "us_per_chunk": round(cpu / chunks * 1e6, 1),
            "helpers_us_per_chunk": round(kids / chunks * 1e6, 1),
            "chunks_per_s": round(chunks / elapsed, 1),
            "chunks_expected_per_s": round(streams / CHUNK_S, 1),
            "read_every_ms": options.read_every_ms,
            "read_delay_ms_p50": round(1000 * (pct(delays, 0.5) or 0.0), 1),
            "read_delay_ms_p95": round(1000 * (pct(delays, 0.95) or 0.0), 1),
            "captions_written": written,
            "redis_calls_per_chunk": commands,
            "max_caption_lag_s": lag["max_caption_lag_s"],
            "streams_behind": lag["streams_behind"]}
        if prof is not None:
            out["profile"] = _profile_shares(prof, cpu)
        return out
    finally:
        feeder.join(timeout=measure_s + warm_s + 10)
        if feeder.is_alive():
            feeder.kill()
        await host.stop(finish_s=1.0)  # its VAD helpers too


def _profile_shares(prof: cProfile.Profile, cpu_s: float, top: int = 25) -> dict[str, Any]:
    """Where the profiled CPU went: self time by top-level package/module and the top
    functions (self time, share of the profiled total)."""
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1.0
    by_module: dict[str, float] = {}
    funcs = []
    for (file, line, name), (_cc, _nc, tt, _ct, _callers) in raw.items():
        where = _area(file)
        by_module[where] = by_module.get(where, 0.0) + tt
        funcs.append((tt, f"{where}:{name}:{line}"))
    funcs.sort(reverse=True)
    return {"profiled_self_s": round(total, 3), "process_cpu_s": round(cpu_s, 3),
            "by_area": {k: round(v / total, 3) for k, v in
                        sorted(by_module.items(), key=lambda kv: -kv[1])[:top]},
            "top_functions": [{"fn": f, "share": round(t / total, 3)} for t, f in funcs[:top]]}


def _area(file: str) -> str:
    """A profiled function's area: our module (workers/asr/stream.py), a package
    (redis, asyncio, numpy), or the built-ins."""
    if file.startswith("~") or file.startswith("<"):
        return "builtins"
    p = Path(file)
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        pass
    parts = p.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return parts[parts.index(marker) + 1]
    if "asyncio" in parts:
        return "asyncio"
    return p.name


async def run(streams: int, seconds: float, rounds: int, warm_s: float,
              profile_s: float) -> dict[str, Any]:
    from bench.frontend_cpu import _leg
    from orchestrator.redis_server import LocalRedisServer

    server = LocalRedisServer()
    url = server.start()
    skip = frozenset({server._proc.pid} if server._proc else ())
    legs: dict[str, list[dict[str, Any]]] = {"front_end": [], "actor_unpaced": [],
                                             "actor": []}
    try:
        for _ in range(rounds):
            fe = await _leg("after", streams, seconds + warm_s, warm_s)
            legs["front_end"].append({"us_per_chunk": fe["front_end_us_per_chunk"],
                                      "helpers_us_per_chunk": fe["helpers_us_per_chunk"],
                                      "keep_up": fe["keep_up"], "sessions": fe["sessions"]})
            legs["actor_unpaced"].append(
                await _actor_leg(streams, seconds, warm_s, url, skip, read_every_ms=0))
            legs["actor"].append(await _actor_leg(streams, seconds, warm_s, url, skip))
        profiled = (await _actor_leg(streams, seconds, warm_s, url, skip,
                                     profile_s=profile_s) if profile_s else None)
    finally:
        server.stop()
    med = {name: statistics.median(r["us_per_chunk"] for r in rows)
           for name, rows in legs.items()}
    return {"kind": "actor_cpu", "streams": streams, "seconds": seconds, "rounds": rounds,
            "backend": "FAKE vLLM (tests/fake_vllm.py)", "cpus": os.cpu_count(),
            "us_per_chunk_median": med,
            "actor_over_front_end": round(med["actor"] / med["front_end"], 3),
            "unpaced_over_front_end": round(med["actor_unpaced"] / med["front_end"], 3),
            "actor_over_unpaced": round(med["actor"] / med["actor_unpaced"], 3),
            "actor_cores_at_this_level": round(med["actor"] * streams / CHUNK_S / 1e6, 3),
            "legs": legs,
            **({"profile": profiled.pop("profile"), "profiled_leg": profiled}
               if profiled else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=float, default=5.0)
    ap.add_argument("--profile", type=float, default=0.0,
                    help="seconds of one more actor leg under cProfile (0: none)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(run(a.streams, a.seconds, a.rounds, a.warm, a.profile))
    emit(stamp(result, "python -m bench.actor_cpu " + " ".join(sys.argv[1:])), a.json)


if __name__ == "__main__":
    main()
