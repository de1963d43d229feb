"""End-to-end benchmark: N streams of the reference speech through the whole system.

    python -m bench.e2e --json [--streams 2] [--model whisper-base] [--plot FILE]

Starts `babelcast run` (local redis-server child, local Ray, embedded engine,
gateway) on a generated event whose N streams each play the five LibriVox
utterances once, connects one WebSocket client per stream before the audio
starts, and measures what the clients receive:

- `wer`: word error rate of the joined finals against the reference text (all streams pooled);
- `engine_offline_wer`: the same model on the whole file, not streamed (after the run, so it
  does not compete for CPU);
- `partial_latency_*` / `final_latency_*`: client receipt time minus the capture time of the
  audio at the end of the caption's last word (`audio_end_wall`, stamped by ingest);
- `finals_revised`: publications of a segment after its final (must be 0);
- `rtf`: the engine's decode-thread busy seconds per second of stream audio (all streams);
  `cpu_s_per_audio_s`: CPU seconds of the whole process tree (gateway, Ray, actors) and
  its redis-server per second of stream audio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, pct  # noqa: E402
from tests.speech import (  # noqa: E402 - shared reference-speech helpers
    normalize,
    reference_text,
    write_reference_wav,
)


async def _client(base: str, stream: str, lang: str, out: list[tuple[float, dict[str, Any]]],
                  done: asyncio.Event) -> None:
    url = base.replace("http://", "ws://") + f"/v1/streams/{stream}/captions?lang={lang}&since=0"
    async with websockets.connect(url) as ws:
        while not done.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), 1.0)
            except TimeoutError:
                continue
            out.append((time.time(), json.loads(raw)))


async def _wait_ended(base: str, streams: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base) as http:
        while time.monotonic() < deadline:
            states = [(await http.get(f"/v1/streams/{s}")).json()["status"] for s in streams]
            if all(st.get("source_state") == "ended" for st in states):
                return
            await asyncio.sleep(1.0)
    raise TimeoutError("sources did not end in time")


def _offline_wer(model: str, wav: Path) -> float:
    import jiwer

    from workers.engines.models import load_whisper

    with wave.open(str(wav)) as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32)
    whisper = load_whisper(model, cpu_threads=2)
    segments, _ = whisper.transcribe(audio / 32768.0, language="en", beam_size=1,
                                     vad_filter=False, condition_on_previous_text=False)
    return float(jiwer.wer(normalize(reference_text()), normalize(" ".join(
        s.text for s in segments))))


async def run(streams: int, model: str, tmp: Path) -> dict[str, Any]:
    import jiwer

    wav = write_reference_wav(tmp / "talk.wav", lead_in_s=3.0)
    with wave.open(str(wav)) as w:
        audio_s = w.getnframes() / w.getframerate()
    ids = [f"room-{i}" for i in range(streams)]
    lines = [
        "event: bench e2e",
        f"engine: {{kind: embedded, model: {model}, actors: 1, streams_per_actor: {streams}}}",
        "streams:",
        *[f'  - {{id: {s}, source: "{wav}", language: en}}' for s in ids],
    ]
    async with babelcast_run(lines, tmp) as server:
        base, redis = server.base, server.redis
        received: dict[str, list[tuple[float, dict[str, Any]]]] = {s: [] for s in ids}
        done = asyncio.Event()
        clients = [asyncio.create_task(_client(base, s, "en", received[s], done)) for s in ids]
        cpu_start = server.cpu_s()
        await _wait_ended(base, ids, audio_s + 120)
        await asyncio.sleep(4.0)  # the last pause closes the last caption
        cpu_used = server.cpu_s() - cpu_start
        done.set()
        await asyncio.gather(*clients, return_exceptions=True)
        engine = {k: float(v) for k, v in redis.hgetall("actor:asr-0").items()
                  if k != "updated"}
        session_counters: dict[str, float] = {}
        for s in ids:
            status = redis.hgetall(f"status:{s}")
            for key in ("stalls", "gap_fill_s", "late_audio_dropped_s", "rollovers_rut",
                        "rollovers_engine_error", "rollovers_budget"):
                session_counters[key] = session_counters.get(key, 0.0) + float(
                    status.get(key, 0))

    partial_lat: list[float] = []
    final_lat: list[float] = []
    finals_revised = 0
    hyps: list[str] = []
    for s in ids:
        final_ids: set[int] = set()
        texts = []
        for recv_t, msg in received[s]:
            if msg.get("type") != "caption":
                continue
            if msg["segment_id"] in final_ids:
                finals_revised += 1
            latency = recv_t - msg["audio_end_wall"]
            if msg["is_final"]:
                final_ids.add(msg["segment_id"])
                if msg["text"]:
                    final_lat.append(latency)
                    texts.append(msg["text"])
            else:
                partial_lat.append(latency)
        hyps.append(normalize(" ".join(texts)))
    ref = normalize(reference_text())
    wer = float(jiwer.wer([ref] * len(ids), hyps))
    return {
        "streams": streams,
        "model": model,
        "audio_s_per_stream": round(audio_s, 2),
        "wer": round(wer, 4),
        "wer_per_stream": [round(float(jiwer.wer(ref, h)), 4) for h in hyps],
        "partial_latency_p50_s": pct(partial_lat, 0.5),
        "partial_latency_p95_s": pct(partial_lat, 0.95),
        "final_latency_p50_s": pct(final_lat, 0.5),
        "final_latency_p95_s": pct(final_lat, 0.95),
        "final_latency_mean_s": round(statistics.fmean(final_lat), 3) if final_lat else None,
        "finals": len(final_lat),
        "partials": len(partial_lat),
        "finals_revised": finals_revised,
        "session_counters": session_counters,
        "rtf": round(engine.get("decode_busy_s", 0.0) / (audio_s * streams), 3),
        "engine_decode_calls": int(engine.get("decode_calls", 0)),
        "cpu_s_per_audio_s": round(cpu_used / (audio_s * streams), 3),
        "_wav": str(wav),
        "_final_lat": final_lat,
        "_partial_lat": partial_lat,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a latency plot (PNG) here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        result = asyncio.run(run(args.streams, args.model, Path(tmp)))
        result["engine_offline_wer"] = round(_offline_wer(args.model, Path(result["_wav"])), 4)
    final_lat = result.pop("_final_lat")
    partial_lat = result.pop("_partial_lat")
    result.pop("_wav")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist([partial_lat, final_lat], bins=30, label=["partial", "final"])
        ax.set_xlabel("audio end → client receipt (s)")
        ax.set_ylabel("captions")
        ax.set_title(f"bench.e2e: {args.streams} streams, {args.model}")
        ax.legend()
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
