"""Scale benchmark: how many real-time streams one embedded engine keeps up with here.

    python -m bench.scale --json [--streams 1,2,3,4,6,8] [--seconds 30] [--plot FILE]

Runs the real embedded engine (Whisper base, `--threads` CPU threads) in-process behind
one session manager per stream, as an ASR actor does, and for each N plays N streams of
the reference speech (the five LibriVox utterances, looped; stream i starts i/N of the
way into the loop so the streams do not pause in step) at wall-clock pace for `--seconds`.
Per N it measures:

- `rtf_demand`: the real-time factor the engine would need to keep its design cadence for
  N streams: N × decodes per stream-second on the first, unloaded step (1 stream) × the
  mean decode time at N. Above 1 the engine cannot keep up at its design pace;
- `rtf`: what it did: decode-thread busy seconds per second of real time (all N streams).
  One decode thread serves every stream, so this cannot pass 1: a demand above 1 shows as
  `rtf` near 1, fewer decodes per stream, longer windows and the lags below growing;
- `decode_lag_p50_s` / `_p95_s`: when a decode finishes, how old the newest audio in its
  window is (queueing behind other streams' decodes + the decode itself); at the design
  cadence it stays under `step_s` (1 s) plus one decode. `decode_lag_slope` is its trend
  (seconds of lag gained per second of audio; > 0 means a growing backlog);
- `final_latency_p50_s` / `_p95_s`: a final caption's emission minus the capture time of
  the audio at its last word;
- `decode_s_mean`, `decodes_per_stream_s`, `final_words_per_stream_s` (falls when audio
  goes undecoded), `cpu_s_per_audio_s` (this process, per stream-second of audio),
  `dropped_chunks` and `rut_rollovers` (the session manager's signs of trouble).

N is `sustained` while `rtf_demand` ≤ `--max-rtf` (1), `decode_lag_p95_s` ≤ `--max-lag`
and the lag does not grow (`decode_lag_slope` ≤ 0.05). `knee_streams` is the largest N
sustained with every smaller N sustained too. The run stops after the first N that is not
sustained (`--all` goes on); the default, 1..8 streams of 30 s, takes 2 to 4 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.rollover import Run, feed, talk  # noqa: E402
from bench.system import pct  # noqa: E402
from tests.speech import normalize  # noqa: E402
from workers.captions.segmenter import Segmenter  # noqa: E402
from workers.engines.base import EngineError, RecognizeSession, SessionOptions  # noqa: E402
from workers.engines.embedded import (  # noqa: E402
    EmbeddedEngineOptions,
    EmbeddedWhisperEngine,
    EmbeddedWhisperSession,
)
from workers.events import SAMPLE_RATE, Word  # noqa: E402
from workers.sessions.manager import SessionManager, SessionPolicy  # noqa: E402

MAX_LAG_SLOPE = 0.05


@dataclass(frozen=True, slots=True)
class Decode:
    stream: str
    window_end_s: float  # stream time of the newest audio in the decoded window
    done_wall: float


class _TimedSession(EmbeddedWhisperSession):
    """The embedded session, recording when each of its decodes finishes."""

    def __init__(self, engine: EmbeddedWhisperEngine, options: SessionOptions,
                 log: list[Decode]) -> None:
        super().__init__(engine, options)
        self._log = log

    async def _decode(self, start: int, beam: int, end: int | None = None, *,
                      final: bool = False, prompt: str | None = None,
                      ) -> tuple[list[Word], list[float]]:
        out = await super()._decode(start, beam, end, final=final, prompt=prompt)
        self._log.append(Decode(self.options.stream_id, self._buf_end_s, time.time()))
        return out


class TimedEngine(EmbeddedWhisperEngine):
    """The embedded engine whose sessions log their decodes (bench only)."""

    def __init__(self, options: EmbeddedEngineOptions) -> None:
        super().__init__(options)
        self.decodes: list[Decode] = []

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        if self._model is None:
            raise EngineError("engine not started", retryable=False)
        session = _TimedSession(self, options, self.decodes)
        session.start()
        return session


@dataclass
class StreamResult:
    finals: list[tuple[float, float, str]] = field(default_factory=list)  # (wall, end_s, text)
    manager: SessionManager | None = None


async def _consume(run: Run, out: StreamResult, stream: str) -> None:
    seg = Segmenter(stream, "en")
    async for delta in run.manager:
        now = time.time()
        for cap in seg.feed(delta):
            if cap.is_final and cap.text:
                out.finals.append((now, cap.audio_end_s, cap.text))


async def _one_stream(engine: TimedEngine, stream: str, pcm: bytes, t0: float) -> StreamResult:
    manager = SessionManager(engine, SessionOptions(stream, "en"), SessionPolicy())
    manager.start()
    run = Run(manager)
    out = StreamResult(manager=manager)
    await asyncio.gather(feed(run, pcm, t0), _consume(run, out, stream))
    return out


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 4:
        return None
    return round(float(np.polyfit(np.asarray(xs), np.asarray(ys), 1)[0]), 4)


async def run_n(engine: TimedEngine, n: int, loop_pcm: bytes, seconds: float,
                args: argparse.Namespace, cadence: float | None) -> dict[str, Any]:
    """One step: n streams for `seconds`. `cadence`: decodes per stream-second at the
    design pace (measured on the first, unloaded step; None: this is that step)."""
    samples = int(seconds * SAMPLE_RATE)
    loop = np.frombuffer(loop_pcm, dtype="<i2")
    pcms = []
    for i in range(n):
        start = (i * loop.size) // n
        idx = (start + np.arange(samples)) % loop.size
        pcms.append(loop[idx].tobytes())
    engine.decodes.clear()
    t0 = time.time() + 0.5
    live_end: dict[str, float] = {}

    async def sample_live_window() -> None:
        # Engine counters over the live audio only; the flush after it is not load.
        await asyncio.sleep(max(0.0, t0 - time.time()))
        before = engine.stats()
        cpu0 = time.process_time()
        await asyncio.sleep(max(0.0, t0 + seconds - time.time()))
        after = engine.stats()
        live_end["cpu"] = time.process_time() - cpu0
        live_end["busy"] = after["decode_busy_s"] - before["decode_busy_s"]
        live_end["calls"] = after["decode_calls"] - before["decode_calls"]

    sampler = asyncio.create_task(sample_live_window())
    results = await asyncio.gather(*(
        _one_stream(engine, f"s{i}", pcm, t0) for i, pcm in enumerate(pcms)))
    await sampler
    cpu, busy, calls = live_end["cpu"], live_end["busy"], live_end["calls"]

    live = [d for d in engine.decodes if d.window_end_s <= seconds - 0.05]
    lag = [d.done_wall - (t0 + d.window_end_s) for d in live]
    lag_t = [d.window_end_s for d in live]
    finals = [(w, e, txt) for r in results for (w, e, txt) in r.finals]
    final_lat = [w - (t0 + e) for w, e, _ in finals if e <= seconds - 0.05]
    final_t = [e for _, e, _ in finals if e <= seconds - 0.05]
    words = sum(len(normalize(txt).split()) for _, _, txt in finals)
    managers = [r.manager for r in results if r.manager is not None]
    row: dict[str, Any] = {
        "streams": n,
        "rtf": round(busy / seconds, 3),
        "rtf_demand": None,
        "rtf_per_stream": round(busy / (seconds * n), 3),
        "decode_s_mean": round(busy / calls, 3) if calls else None,
        "decodes_per_stream_s": round(calls / (seconds * n), 2),
        "decode_lag_p50_s": pct(lag, 0.5),
        "decode_lag_p95_s": pct(lag, 0.95),
        "decode_lag_max_s": round(max(lag), 3) if lag else None,
        "decode_lag_slope": _slope(lag_t, lag),
        "final_latency_p50_s": pct(final_lat, 0.5),
        "final_latency_p95_s": pct(final_lat, 0.95),
        "final_latency_slope": _slope(final_t, final_lat),
        "finals": len(finals),
        "final_words_per_stream_s": round(words / (seconds * n), 2),
        "cpu_s_per_audio_s": round(cpu / (seconds * n), 3),
        "dropped_chunks": sum(m.dropped_chunks for m in managers),
        "rut_rollovers": int(sum(m.counters.get("rollovers_rut", 0) for m in managers)),
    }
    per_stream = calls / (seconds * n)
    if calls:
        row["rtf_demand"] = round(n * (cadence or per_stream) * busy / calls, 3)
    slope = row["decode_lag_slope"] or 0.0
    row["sustained"] = bool(
        row["rtf_demand"] is not None
        and row["rtf_demand"] <= args.max_rtf
        and row["decode_lag_p95_s"] is not None
        and row["decode_lag_p95_s"] <= args.max_lag
        and slope <= MAX_LAG_SLOPE
    )
    return row


def plot(path: str, rows: list[dict[str, Any]], knee: int, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["streams"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(ns, [r["rtf_demand"] for r in rows], "o-", label="rtf needed at design cadence")
    ax1.plot(ns, [r["rtf"] for r in rows], "s--", label="rtf measured (decode busy s / s)")
    ax1.axhline(args.max_rtf, color="red", ls=":", lw=0.8)
    ax1.set_xlabel("concurrent real-time streams")
    ax1.set_ylabel("real-time factor")
    ax1.set_xticks(ns)
    if knee:
        ax1.axvline(knee, color="green", ls="--", label=f"knee: {knee} streams")
    ax1.legend(loc="lower right")
    for key, label in (("decode_lag_p95_s", "decode lag p95"),
                       ("final_latency_p50_s", "final latency p50"),
                       ("final_latency_p95_s", "final latency p95")):
        ax2.plot(ns, [r[key] if r[key] is not None else float("nan") for r in rows], "o-",
                 label=label)
    ax2.axhline(args.max_lag, color="grey", ls=":", label=f"max lag {args.max_lag} s")
    ax2.set_xlabel("concurrent real-time streams")
    ax2.set_ylabel("seconds")
    ax2.set_xticks(ns)
    ax2.legend()
    fig.suptitle(f"bench.scale: embedded whisper-base, {args.threads} threads, "
                 f"{args.seconds:.0f} s per step")
    fig.savefig(path, dpi=100, bbox_inches="tight")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    opts = EmbeddedEngineOptions(model=args.model, cpu_threads=args.threads)
    engine = TimedEngine(opts)
    await engine.start()
    loop_pcm, _ = talk(0.0)  # one pass of the reference utterances; streams loop it
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        cadence: float | None = None
        for n in args.streams:
            row = await run_n(engine, n, loop_pcm, args.seconds, args, cadence)
            rows.append(row)
            if cadence is None:
                cadence = row["decodes_per_stream_s"]
            if not row["sustained"] and not args.all:
                break
    finally:
        await engine.aclose()
    knee = 0
    for row in rows:
        if not row["sustained"]:
            break
        knee = row["streams"]
    result = {
        "model": args.model,
        "threads": args.threads,
        "seconds_per_step": args.seconds,
        "step_s": opts.step_s,
        "design_decodes_per_stream_s": rows[0]["decodes_per_stream_s"] if rows else None,
        "criteria": {"max_rtf_demand": args.max_rtf, "max_decode_lag_p95_s": args.max_lag,
                     "max_decode_lag_slope": MAX_LAG_SLOPE},
        "knee_streams": knee,
        "rows": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.plot:
        plot(args.plot, rows, knee, args)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,2,3,4,6,8",
                    help="comma-separated stream counts, in increasing order")
    ap.add_argument("--seconds", type=float, default=30.0, help="audio seconds per step")
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-rtf", type=float, default=1.0,
                    help="largest rtf_demand that still counts as keeping up")
    ap.add_argument("--max-lag", type=float, default=2.0,
                    help="largest decode lag p95 (s) that still counts as keeping up")
    ap.add_argument("--all", action="store_true", help="run every N, even past the knee")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="write an rtf/latency plot (PNG) here")
    args = ap.parse_args()
    args.streams = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
