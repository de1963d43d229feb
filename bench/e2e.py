"""End-to-end benchmark: N streams of the reference speech through the whole system.

    python -m bench.e2e --json [--streams 2|calibrated] [--model whisper-base] [--speech heldout]
        [--engine "final_beam_size: 5, pause_s: 1.0"]

Starts `babelcast run` (local redis-server child, local Ray, embedded engine, gateway) on a
generated event with N `source: push` streams, connects one caption WebSocket per stream,
then plays the speech (`reference`: the five LibriVox utterances the project was tuned on;
`heldout`: recordings in no file of this repository, `tests.speech.heldout_talks()`) into
every stream at once, in real time, over `/v1/streams/{id}/audio`, logging when each chunk
left. It listens until nothing is open and nothing has arrived for a few seconds
(bench.playback.drain), the senders going on with silence meanwhile as a live source does
(`session_counters.stalls` counts only the source's stalls, not the end of the test), and
measures what the clients received:

- `wer`: word error rate of the joined finals against the reference text (all streams pooled);
- `engine_offline_wer`: the same model on the whole recording, not streamed (greedy, after
  the run, so it does not compete for CPU);
- `partial_latency_*` / `final_latency_*`: client receipt time minus the time the bench sent
  the chunk holding the end of the caption's last word (the sender's clock: ingest, Redis
  and the gateway are inside the figure);
- `open_at_end`: streams whose last caption was still a partial when the bench stopped
  listening (a final that never came); `drain_s`: how long it listened after the audio;
- `finals_revised`: publications of a segment after its final (must be 0);
- `rtf`: the engine's decode-thread busy seconds per second of stream audio (all streams);
- `calibration` (with `--streams calibrated`): the streams the engine's calibration gives
  this host (`workers.engines.calibrate`, cached per host), which the run then plays;
  `cpu_s_per_audio_s`: CPU seconds of the whole process tree (gateway, Ray, actors) and
  its redis-server per second of stream audio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.playback import LEAD_IN_S, TAIL_S, Leg, drain, keep_live, play  # noqa: E402
from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, client_headers, number_or_text, pct  # noqa: E402
from tests.speech import (  # noqa: E402 - shared speech helpers
    Talk,
    heldout_talks,
    normalize,
    reference_talk,
)
from workers.events import SAMPLE_RATE  # noqa: E402

CHUNK = SAMPLE_RATE // 10


def talks(speech: str) -> list[Talk]:
    return [reference_talk()] if speech == "reference" else heldout_talks()


async def _client(base: str, stream: str, lang: str, leg: Leg,
                  out: list[tuple[float, dict[str, Any]]], done: asyncio.Event) -> None:
    url = base.replace("http://", "ws://") + f"/v1/streams/{stream}/captions?lang={lang}&since=0"
    async with websockets.connect(url, additional_headers=client_headers(base)) as ws:
        while not done.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), 0.5)
            except TimeoutError:
                continue
            now = time.time()
            msg = json.loads(raw)
            out.append((now, msg))
            if msg.get("type") == "caption":
                leg.last_message = now
                leg.open_text = "" if msg["is_final"] else msg["text"]


def _offline_wer(model: str, chosen: list[Talk]) -> float:
    """The same model on each whole recording (greedy), pooled over the recordings."""
    import jiwer

    from workers.engines.models import load_whisper

    whisper = load_whisper(model, cpu_threads=2)
    refs, hyps = [], []
    for t in chosen:
        audio = np.frombuffer(t.pcm, dtype="<i2").astype(np.float32) / 32768.0
        segments, _ = whisper.transcribe(audio, language="en", beam_size=1,
                                         vad_filter=False, condition_on_previous_text=False)
        refs.append(normalize(t.text))
        hyps.append(normalize(" ".join(s.text for s in segments)))
    return float(jiwer.wer(" ".join(refs), " ".join(hyps)))


async def run(streams: int, model: str, speech: str, tmp: Path,
              engine_extra: str = "") -> dict[str, Any]:
    import jiwer

    chosen = talks(speech)
    lead = bytes(2 * int(LEAD_IN_S * SAMPLE_RATE))
    tail = bytes(2 * int(TAIL_S * SAMPLE_RATE))
    pcm = lead + b"".join(t.pcm + tail for t in chosen)
    text = " ".join(t.text for t in chosen)
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    ids = [f"room-{i}" for i in range(streams)]
    lines = [
        "event: bench e2e",
        f"engine: {{kind: embedded, model: {model}, actors: 1, streams_per_actor: {streams}"
        f"{', ' + engine_extra if engine_extra else ''}}}",
        "streams:",
        *[f"  - {{id: {s}, source: push, language: en}}" for s in ids],
    ]
    legs = {s: Leg(s) for s in ids}
    received: dict[str, list[tuple[float, dict[str, Any]]]] = {s: [] for s in ids}
    async with babelcast_run(lines, tmp) as server:
        base, redis = server.base, server.redis
        done = asyncio.Event()
        clients = [asyncio.create_task(_client(base, s, "en", legs[s], received[s], done))
                   for s in ids]
        ws_base = base.replace("http://", "ws://")
        senders = [await websockets.connect(f"{ws_base}/v1/streams/{s}/audio",
                                           additional_headers=server.headers("publish", s))
                   for s in ids]
        await asyncio.sleep(0.5)  # the caption sockets are open before the first audio
        cpu_start = server.cpu_s()
        await asyncio.gather(*(play(ws.send, pcm, CHUNK, legs[s].sent, bytes)
                               for s, ws in zip(ids, senders, strict=True)))
        audio_end = time.time()
        stop_live = asyncio.Event()
        live = [asyncio.create_task(keep_live(ws.send, CHUNK, bytes, stop_live))
                for ws in senders]
        drained = [asyncio.Event() for _ in ids]
        await asyncio.gather(*(drain(legs[s], ev) for s, ev in zip(ids, drained, strict=True)))
        drain_s = time.time() - audio_end
        stop_live.set()
        await asyncio.gather(*live)
        cpu_used = server.cpu_s() - cpu_start
        done.set()
        await asyncio.gather(*clients, return_exceptions=True)
        for ws in senders:
            await ws.close()
        # Numbers only: with calibration on (the default) the hash also says where the
        # figure came from ("calibration_source": "cache").
        engine = {k: n for k, v in redis.hgetall("actor:asr-0").items()
                  if k != "updated" and isinstance(n := number_or_text(v), float)}
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
            if not msg["text"]:
                continue
            latency = recv_t - legs[s].sent.wall_of(float(msg["audio_end_s"]))
            if msg["is_final"]:
                final_ids.add(msg["segment_id"])
                final_lat.append(latency)
                texts.append(msg["text"])
            else:
                partial_lat.append(latency)
        hyps.append(normalize(" ".join(texts)))
    ref = normalize(text)
    wer = float(jiwer.wer([ref] * len(ids), hyps))
    return {
        "streams": streams,
        "model": model,
        "engine_extra": engine_extra or None,
        "speech": [t.name for t in chosen],
        "audio_s_per_stream": round(audio_s, 2),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
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
        "open_at_end": sum(1 for leg in legs.values() if leg.open_text.strip()),
        "drain_s": round(drain_s, 1),
        "session_counters": session_counters,
        "rtf": round(engine.get("decode_busy_s", 0.0) / (audio_s * streams), 3),
        "engine_decode_calls": int(engine.get("decode_calls", 0)),
        "cpu_s_per_audio_s": round(cpu_used / (audio_s * streams), 3),
        "_talks": chosen,
        "_final_lat": final_lat,
        "_partial_lat": partial_lat,
    }


async def _calibrate(model: str) -> dict[str, Any]:
    """The engine's calibrated streams for this host (default engine options, 2 threads:
    what the event file here runs), measured before `babelcast run` starts."""
    import dataclasses

    from workers.engines.calibrate import calibration
    from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine

    engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model=model, cpu_threads=2))
    await engine.start()
    try:
        cal = await calibration(engine)
    finally:
        await engine.aclose()
    return {k: v for k, v in dataclasses.asdict(cal).items() if k != "key"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="2",
                    help="streams to play, or 'calibrated': what the engine's calibration "
                         "gives this host (measured once, then cached)")
    ap.add_argument("--engine", default="",
                    help="more engine keys for the event file, YAML flow style "
                         "(e.g. 'final_beam_size: 5, pause_s: 1.0')")
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--speech", default="reference", choices=["reference", "heldout"],
                    help="reference: the tuning set; heldout: speech in no file of the repo")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a latency plot (PNG) here")
    args = ap.parse_args()
    calibration = None
    if args.streams == "calibrated":
        calibration = asyncio.run(_calibrate(args.model))
        streams = int(calibration["streams"])
    else:
        streams = int(args.streams)
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        result = asyncio.run(run(streams, args.model, args.speech, Path(tmp), args.engine))
    result["calibration"] = calibration
    result["engine_offline_wer"] = round(_offline_wer(args.model, result.pop("_talks")), 4)
    result["wer_minus_offline"] = round(result["wer"] - result["engine_offline_wer"], 4)
    final_lat = result.pop("_final_lat")
    partial_lat = result.pop("_partial_lat")
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
