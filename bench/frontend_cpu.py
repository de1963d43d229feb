"""The vllm engine's front end, our own part: CPU per 80 ms chunk before and after two
changes, in one run (issue 34: the front end at the knee and on the way to 200).

    python -m bench.frontend_cpu --json [--streams 25] [--seconds 30] [--rounds 2]

On the H200 host the front-end process spent 1,418 µs of CPU per chunk at 25 aged
sessions (bench/results/capacity_h200/2026-12-05-project-direct-x3-75-spread-aligned80
.json); part of that is vLLM's AsyncLLM, part the session manager, its voice activity and
its rut watchdog, which run for every chunk of every stream in every ASR actor. This bench
measures that part where vLLM cannot run: N streams fed as an actor feeds them (session
manager, VAD helper processes: bench.capacity.feed.open_production) into the `vllm`
engine's real session code over the FAKE vLLM backend (tests/fake_vllm.py, clearly a
stand-in: its own cost is in the figures, the same in both legs), arrivals spread over the
80 ms cycle and the engine's shared tick on, as in production. Two legs, alternated
`--rounds` times in one run:

- `before`: the VAD helpers reached through a ProcessPoolExecutor (the transport before
  eba8ca8, kept here as `LegacyPoolVad`) and the rut watchdog's full walk of its window
  (before 728e8c2, kept in tests/test_rut_walk.py as the reference);
- `after`: the code as it is.

Per leg: `front_end_us_per_chunk` (this process's CPU over the measured window, per chunk
fed), `helpers_us_per_chunk` (the VAD processes), frames/s p50, sessions keeping up by the
strict rule. Beside them, two parts on their own: `vad_call` (the caller's CPU per call,
one call in flight and N) and `rut_walk` (µs per `in_rut` of a talking stream, 80 s kept).
Ratios are after/before, medians of the rounds. A CPU host's figures, not the H200's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.results import stamp  # noqa: E402
from bench.report import emit  # noqa: E402


class LegacyPoolVad:
    """BASELINE ONLY: the VAD service's transport before eba8ca8 — one single-worker
    ProcessPoolExecutor per helper, `run_in_executor` per call. The same helper functions
    (`vad._remote_flags`), so the flags are the same; only the way there differs."""

    def __init__(self, processes: int = 1) -> None:
        self._pools = [ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            for _ in range(processes)]
        self._n = 0

    async def call(self, shard: int, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pools[shard], fn,
                                                                *args)

    def stream(self, name: str) -> Any:
        from workers.engines import vad

        service, shard = self, self._n % len(self._pools)
        self._n += 1
        key = f"{name}#{self._n}"

        class Stream:
            async def flags(self, pcm: bytes) -> list[bool]:
                result: list[bool] = await service.call(shard, vad._remote_flags, key, pcm)
                return result

            def reset(self) -> None:
                service._pools[shard].submit(vad._remote_drop, key)

            def close(self) -> None:
                self.reset()

        return Stream()

    def shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def full_rut_walk() -> Iterator[None]:
    """BASELINE ONLY: the rut watchdog walks its whole window, as before 728e8c2."""
    from tests.test_rut_walk import full_walk
    from workers.sessions.watchdog import RutWatchdog

    bounded = RutWatchdog.in_rut
    RutWatchdog.in_rut = full_walk  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        RutWatchdog.in_rut = bounded  # type: ignore[method-assign]


async def _leg(name: str, streams: int, seconds: float, warm_s: float) -> dict[str, Any]:
    from bench.capacity.feed import open_production, speech, track_sessions
    from bench.capacity.phase import _phase
    from tests.fake_vllm import FakeVllmBackend
    from workers.engines import vad
    from workers.engines.vllm.engine import (
        DEFAULT_GEOMETRY,
        VllmEngineOptions,
        VllmVoxtralEngine,
    )

    engine = VllmVoxtralEngine(
        VllmEngineOptions(model="/fake", max_streams=streams, reanchor="off",
                          aligned_feed_ms=80),
        backend=FakeVllmBackend(text_every=3), geometry=DEFAULT_GEOMETRY)
    await engine.start()
    opened = track_sessions(engine)
    helpers = math.ceil(streams / vad.STREAMS_PER_PROCESS)
    service: Any = LegacyPoolVad(helpers) if name == "before" else vad.VadService(helpers)
    walk = full_rut_walk() if name == "before" else contextlib.nullcontext()
    try:
        with walk:
            result = await _phase(streams, seconds, speech(),
                                  lambda i: open_production(engine, service, opened, i),
                                  arrivals="spread", warm_s=warm_s)
    finally:
        service.shutdown()
        await engine.aclose()
    verdicts = result["sessions"]
    return {"front_end_us_per_chunk": round(result["front_end_us_per_chunk"], 1),
            "helpers_us_per_chunk": round(result["helpers_us_per_chunk"], 1),
            "frames_per_s_p50": round(statistics.median(result["fps"]), 3),
            "keep_up": sum(1 for v in verdicts if v["keeps_up"]),
            "sessions": len(verdicts)}


async def _vad_calls(streams: int, calls: int) -> dict[str, Any]:
    """The caller's CPU per call (the helper's is not counted), and the flags compared."""
    from bench.capacity.feed import speech
    from workers.engines import vad

    audio = speech()
    pieces = [audio[i:i + 1280].tobytes() for i in range(0, 1280 * calls, 1280)]
    out: dict[str, Any] = {}
    flags: dict[str, list[bool]] = {}
    for name, service in (("before", LegacyPoolVad()), ("after", vad.VadService())):
        try:
            await service.call(0, vad._remote_drop, "warm")  # the helper starts
            for inflight in (1, streams):
                handles = [service.stream(f"{name}{inflight}-{i}") for i in range(inflight)]
                got: list[list[bool]] = [[] for _ in handles]
                t0 = time.process_time()

                async def run(i: int, handles: list[Any] = handles,
                              got: list[list[bool]] = got) -> None:
                    for piece in pieces[: calls // len(handles)]:
                        got[i] += await handles[i].flags(piece)

                await asyncio.gather(*(run(i) for i in range(inflight)))
                done = (calls // inflight) * inflight
                out[f"{name}_us_per_call_{inflight}_in_flight"] = round(
                    (time.process_time() - t0) / done * 1e6, 1)
                flags.setdefault(name, got[0])
        finally:
            service.shutdown()
    out["same_flags"] = flags["before"] == flags["after"]
    return out


def _rut_walk() -> dict[str, Any]:
    from tests.test_rut_walk import FRAME, full_walk
    from workers.events import SAMPLE_RATE
    from workers.sessions.watchdog import RutPolicy, RutWatchdog

    w = RutWatchdog(RutPolicy())
    frames = int(80 * SAMPLE_RATE / FRAME)  # 80 s of talk; text 1 s behind the audio
    for k in range(frames):
        w.speech(k * FRAME, FRAME)
        if k % 3 == 0 and k > 31:
            w.text((k - 31) * FRAME, 4)
    heard = (frames - 31) * FRAME
    out: dict[str, Any] = {}
    walks: tuple[tuple[str, Callable[[], bool]], ...] = (
        ("before", lambda: full_walk(w, heard)), ("after", lambda: w.in_rut(heard)))
    for name, fn in walks:
        n = 3000
        t0 = time.process_time()
        for _ in range(n):
            fn()
        out[f"{name}_us_per_call"] = round((time.process_time() - t0) / n * 1e6, 2)
    out["same_answer"] = full_walk(w, heard) == w.in_rut(heard)
    return out


async def run(streams: int, seconds: float, rounds: int, warm_s: float) -> dict[str, Any]:
    legs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for _ in range(rounds):
        for name in ("before", "after"):
            legs[name].append(await _leg(name, streams, seconds, warm_s))
    med = {name: statistics.median(r["front_end_us_per_chunk"] for r in rows)
           for name, rows in legs.items()}
    return {"kind": "frontend_cpu", "streams": streams, "seconds": seconds,
            "rounds": rounds, "backend": "FAKE vLLM (tests/fake_vllm.py)",
            "front_end_us_per_chunk_median": med,
            "front_end_ratio": round(med["after"] / med["before"], 3),
            "legs": legs,
            "vad_call": await _vad_calls(streams, 1000),
            "rut_walk": _rut_walk()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(run(a.streams, a.seconds, a.rounds, a.warm))
    emit(stamp(result, "python -m bench.frontend_cpu " + " ".join(sys.argv[1:])), a.json)


if __name__ == "__main__":
    main()
