"""Ingest benchmark: the reference speech through every ingest path, one after another.

    python -m bench.ingest --json [--model whisper-base] [--only hls,srt-listener]

Starts `babelcast run` (local redis-server child, local Ray, the embedded engine,
the gateway) on one event with a stream per ingest path, then plays the five
LibriVox utterances (after a beep that ties the stream's audio clock to the
encoder's) through each path in turn, so no two compete for the two cores:

- `file`: the event's own file source (it starts with the event);
- `hls`, `rtmp-pull`, `rtmp-push`, `srt-pull`, `srt-listener`: a real ffmpeg
  encoder fed PCM at real time by this process (tests/ingest_support.py),
  HLS with `-hls_time 2 -hls_list_size 6` behind a local web server;
- `ws-push`: PCM16 frames on the gateway's `/v1/streams/{id}/audio` WebSocket;
- `realtime`: a client of the gateway's vLLM-compatible `/v1/realtime`.

Per path: `delay_p50_s` / `delay_p95_s`, each final caption's emit time minus
when its last word reached the encoder (for `file`, when ingest read it);
`audio_delay_s`, when the beep reached Redis minus when it reached the encoder;
`stalls`, `filler_s`, `dropped_audio_s` over the speech (the session manager's
counters, read when the encoder stops); `wer` of the finals.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import websockets
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, client_headers, pct  # noqa: E402
from tests.ingest_support import (  # noqa: E402 - the encoders the ingest tests use
    BEEP_AT_S,
    SRT_PASSPHRASE,
    STREAM_KEY,
    Encoder,
    serve_folder,
    transport,
    with_beep,
)
from tests.speech import AUDIO, decode_pcm16, normalize, reference_text  # noqa: E402
from workers.bus import audio_key, cancel_safe, captions_key, status_key  # noqa: E402
from workers.events import SAMPLE_RATE  # noqa: E402

PATHS = ("file", "hls", "rtmp-pull", "rtmp-push", "srt-pull", "srt-listener", "ws-push",
         "realtime")
CHUNK = SAMPLE_RATE // 10 * 2
TAIL_S = 5.0  # after the speech: the last pause closes the last caption


def speech() -> bytes:
    talk = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in ("room-a", "room-b"))
    return with_beep(talk) + bytes(2 * SAMPLE_RATE * 2)


class PacedSender:
    """This process as the encoder of a push path: 100 ms chunks at real time."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.walls: list[float] = []

    async def play(self, pcm: bytes, send: Any) -> None:
        t0 = time.monotonic()
        for i, off in enumerate(range(0, len(pcm), CHUNK)):
            await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.1 - time.monotonic()))
            await send(pcm[off : off + CHUNK])
            self.ends.append((off + CHUNK) // 2)
            self.walls.append(time.time())

    def wall_of(self, pos_s: float) -> float:
        import bisect

        pos = int(pos_s * SAMPLE_RATE)
        i = min(bisect.bisect_left(self.ends, pos), len(self.ends) - 1)
        return self.walls[i] - (self.ends[i] - pos) / SAMPLE_RATE


async def ws_push(base: str, stream: str, pcm: bytes) -> PacedSender:
    sender = PacedSender()
    url = base.replace("http://", "ws://") + f"/v1/streams/{stream}/audio"
    async with websockets.connect(url, additional_headers=client_headers(base, "publish",
                                                                         stream)) as ws:
        await sender.play(pcm, ws.send)
    return sender


async def realtime(base: str, stream: str, pcm: bytes, model: str,
                   at_end: Any) -> PacedSender:
    """`at_end`: awaited when the audio is sent, before waiting for transcription.done."""
    sender = PacedSender()
    url = base.replace("http://", "ws://") + f"/v1/realtime?stream={stream}"
    async with websockets.connect(url, additional_headers=client_headers(base, "publish",
                                                                         stream)) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "model": model}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": False}))

        async def append(chunk: bytes) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(chunk).decode()}))

        await sender.play(pcm, append)
        await at_end()
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until transcription.done
            try:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
            except TimeoutError:
                break
            if msg.get("type") == "transcription.done":
                break
    return sender


async def beep(redis: Any, stream: str) -> tuple[float, float] | None:
    """(stream time of the beep's onset, wall time that sample reached Redis)."""
    for _, f in await redis.xrange(audio_key(stream)):
        if f.get(b"k") != b"pcm":
            continue
        samples = np.frombuffer(f[b"pcm"], dtype="<i2")
        loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > 8000)
        if loud.size:
            onset = int(f[b"pos"]) + int(loud[0])
            end = int(f[b"pos"]) + samples.size
            # A chunk's wall is when its last sample was captured.
            return onset / SAMPLE_RATE, float(f[b"wall"]) - (end - onset) / SAMPLE_RATE
    return None


async def counters(redis: Any, stream: str) -> dict[str, float]:
    raw = await redis.hgetall(status_key(stream))
    st = {k.decode(): v.decode() for k, v in raw.items()}
    return {"stalls": float(st.get("stalls", 0)), "filler_s": float(st.get("gap_fill_s", 0)),
            "dropped_audio_s": float(st.get("late_audio_dropped_s", 0))}


async def finals(redis: Any, stream: str) -> list[dict[str, Any]]:
    out = []
    for _, f in await redis.xrange(captions_key(stream, "en")):
        msg = json.loads(f[b"d"])
        if msg["is_final"] and msg["text"]:
            out.append(msg)
    return out


async def play(path: str, base: str, redis: Any, pcm: bytes, model: str,
               folders: dict[str, Any]) -> dict[str, Any]:
    """One path's turn; returns its measurements."""
    import jiwer

    before = await counters(redis, path)
    after: dict[str, float] = {}

    async def at_end() -> None:  # the speech is out: stalls after this are the end's
        after.update(await counters(redis, path))

    wall_of: Any
    if path == "file":
        while (await redis.hget(status_key(path), "source_state")) != b"ended":  # noqa: ASYNC110
            await asyncio.sleep(0.5)  # a Redis hash: no change event to await
        wall_of = None
    elif path == "ws-push":
        wall_of = (await ws_push(base, path, pcm)).wall_of
    elif path == "realtime":
        wall_of = (await realtime(base, path, pcm, model, at_end)).wall_of
    else:
        encoder = Encoder(folders[path].output)
        await encoder.start(pcm)
        await encoder.finish(timeout_s=120)
        wall_of = encoder.wall_of
    if not after:
        await at_end()
    await asyncio.sleep(TAIL_S)
    caps = await finals(redis, path)
    found = await beep(redis, path)
    result: dict[str, Any] = {k: round(after[k] - before[k], 2) for k in after}
    if wall_of is None:  # the file: ingest is the encoder
        delays = [c["emit_time"] - c["audio_end_wall"] for c in caps]
        result["audio_delay_s"] = 0.0
    elif found is None:
        delays = []
        result["audio_delay_s"] = None
    else:
        onset_s, onset_wall = found
        offset = onset_s - BEEP_AT_S
        delays = [c["emit_time"] - wall_of(c["audio_end_s"] - offset) for c in caps]
        result["audio_delay_s"] = round(onset_wall - wall_of(BEEP_AT_S), 3)
    hyp = normalize(" ".join(c["text"] for c in caps))
    result.update(delay_p50_s=pct(delays, 0.5), delay_p95_s=pct(delays, 0.95),
                  finals=len(caps), wer=round(float(jiwer.wer(normalize(reference_text()),
                                                               hyp)), 4))
    return result


async def run(model: str, only: list[str], tmp: Path) -> dict[str, Any]:
    pcm = speech()
    wav = tmp / "talk.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    www = tmp / "www"
    www.mkdir()
    os.environ["BENCH_RTMP_KEY"] = STREAM_KEY
    os.environ["BENCH_SRT_PASSPHRASE"] = SRT_PASSPHRASE
    with serve_folder(www) as http_base:
        folders = {}
        for name in ("hls", "rtmp-pull", "rtmp-push", "srt-pull", "srt-listener"):
            (www / name).mkdir()
            folders[name] = transport(name, www / name, http_base)
        lines = ["event: bench ingest",
                 f"engine: {{kind: embedded, model: {model}, actors: 1, "
                 f"streams_per_actor: {len(PATHS)}}}", "streams:",
                 f'  - {{id: file, source: "{wav}", language: en}}']
        for name, t in folders.items():
            key = {"rtmp-push": ", key_env: BENCH_RTMP_KEY",
                   "srt-listener": ", key_env: BENCH_SRT_PASSPHRASE"}.get(name, "")
            lines.append(f'  - {{id: {name}, source: "{t.source}", language: en{key}}}')
        lines += ["  - {id: ws-push, source: push, language: en}",
                  "  - {id: realtime, source: push, language: en}"]
        results: dict[str, Any] = {}
        async with babelcast_run(lines, tmp) as server:
            kwargs = server.redis.connection_pool.connection_kwargs
            redis = cancel_safe(Redis(host=kwargs["host"], port=kwargs["port"],
                                      db=kwargs.get("db", 0)))
            try:
                for path in PATHS:
                    if path in only:
                        results[path] = await play(path, server.base, redis, pcm, model,
                                                   folders)
            finally:
                await redis.aclose()
    return {"model": model, "speech_s": round(len(pcm) / 2 / SAMPLE_RATE, 1),
            "paths": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--only", default=",".join(PATHS),
                    help=f"comma-separated paths (default all: {','.join(PATHS)})")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    only = [p for p in args.only.split(",") if p]
    unknown = set(only) - set(PATHS)
    if unknown:
        ap.error(f"unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}")
    if "file" not in only:
        only.insert(0, "file")  # it starts with the event either way: measure it
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        result = asyncio.run(run(args.model, only, Path(tmp)))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
