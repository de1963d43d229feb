"""Feeding a session: the bench's speech, 80 ms frames of it, and the production feed
(a session manager per stream with voice activity in helper processes, as an ASR
actor feeds its engine).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from workers.engines.base import SessionOptions
from workers.events import AudioChunk

ROOT = Path(__file__).resolve().parents[2]
FRAME = 1280


Handle = tuple[Callable[[np.ndarray], None], Callable[[], int], Callable[[], Awaitable[None]]]


def speech() -> np.ndarray:
    """examples/audio/room-a.flac as 16 kHz mono PCM16 (PyAV, a dependency)."""
    import av

    with av.open(str(ROOT / "examples" / "audio" / "room-a.flac")) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
        parts = [f.to_ndarray().ravel() for frame in container.decode(audio=0)
                 for f in resampler.resample(frame)]
    return np.concatenate(parts).astype(np.int16)


def speech_frame(audio: np.ndarray, offset: int, k: int) -> np.ndarray:
    """The `k`-th 80 ms frame from `offset` of the bench's speech (wrapping), as the model's
    buffer takes it: float32 in [-1, 1)."""
    j = (offset + k * FRAME) % (audio.size - FRAME)
    return audio[j : j + FRAME].astype(np.float32) / 32768.0


# ---- the production feed ----------------------------------------------------------------
def track_sessions(engine: Any) -> dict[str, list[Any]]:
    """Bench-only: remember each stream's engine sessions (to count their outputs)."""
    opened: dict[str, list[Any]] = {}
    real_open = engine.open_session

    def tracking_open(options: SessionOptions) -> Any:
        session = real_open(options)
        opened.setdefault(options.stream_id, []).append(session)
        return session

    engine.open_session = tracking_open
    return opened


async def open_production(engine: Any, vad_service: Any, opened: dict[str, list[Any]],
                          i: int) -> Handle:
    """One stream fed as an ASR actor feeds it (workers/asr.py `_open`): a session manager
    over the engine, with voice activity from the VAD helper processes."""
    from workers.sessions.manager import SessionManager, SessionPolicy

    sid = f"prod{i}-{uuid.uuid4().hex[:6]}"
    manager = SessionManager(engine, SessionOptions(sid, "auto"), SessionPolicy(),
                             vad=vad_service.stream(sid))
    manager.start()
    pos = [0]

    async def drain() -> None:
        async for _ in manager:
            pass

    d = asyncio.create_task(drain())

    def push(frame: np.ndarray) -> None:
        manager.push_nowait(AudioChunk(sid, pos[0], frame.tobytes(), time.time()))
        pos[0] += FRAME

    async def close() -> None:
        await manager.aclose()
        d.cancel()
        opened.pop(sid, None)

    return push, (lambda: sum(x.outputs for x in opened.get(sid, ()))), close
