"""GPU tier: the project's `vllm` engine on a real GPU with real vLLM (random Voxtral
weights: assertions are about session mechanics, never about text).

Skipped unless CUDA and vLLM are present and BABELCAST_VOXTRAL_DIR names a model
folder (params.json + tekken.json, e.g. from ../shared/gpu/voxtral_config.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MODEL_DIR = os.environ.get("BABELCAST_VOXTRAL_DIR", "")


def _gpu_ready() -> bool:
    # No torch.cuda call here: a CUDA context in this process breaks vLLM's forked
    # engine core ("Cannot re-initialize CUDA in forked subprocess").
    return bool(MODEL_DIR and importlib.util.find_spec("vllm") and shutil.which("nvidia-smi"))


if not _gpu_ready():
    pytest.skip("needs CUDA, vLLM and BABELCAST_VOXTRAL_DIR", allow_module_level=True)

from tests.speech import AUDIO  # noqa: E402
from workers.engines.base import SessionOptions  # noqa: E402
from workers.engines.vllm_voxtral import VllmEngineOptions, VllmVoxtralEngine  # noqa: E402
from workers.events import SAMPLE_RATE, AudioChunk  # noqa: E402
from workers.sessions.manager import SessionManager, SessionPolicy  # noqa: E402
from workers.sessions.watchdog import RutPolicy  # noqa: E402

CHUNK = 1280  # one 80 ms frame


def speech() -> bytes:
    import soundfile

    data, rate = soundfile.read(str(AUDIO / "room-a.flac"), dtype="int16")
    assert rate == SAMPLE_RATE
    return bytes(data.tobytes())


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop: asyncio.AbstractEventLoop) -> Iterator[VllmVoxtralEngine]:
    eng = VllmVoxtralEngine(VllmEngineOptions(
        model=MODEL_DIR, max_streams=8, max_model_len=2048, load_format="dummy",
        gpu_memory_utilization=0.45))
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.aclose())


async def feed(session: Any, pcm: bytes, seconds: float, pos: int = 0) -> None:
    t0 = time.monotonic()
    n = int(seconds / 0.08)
    for i in range(n):
        off = (i * CHUNK * 2) % (len(pcm) - CHUNK * 2)
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.08 - time.monotonic()))
        await session.push(AudioChunk("g", pos + i * CHUNK, pcm[off : off + CHUNK * 2],
                                      time.time()))


async def drain(session: Any, sink: list[Any]) -> None:
    async for delta in session:
        sink.append(delta)


def test_sessions_decode_at_real_time_pace(engine: VllmVoxtralEngine,
                                           loop: asyncio.AbstractEventLoop) -> None:
    pcm = speech()

    async def run() -> list[int]:
        sessions = [engine.open_session(SessionOptions(f"s{i}", "auto")) for i in range(4)]
        sinks: list[list[Any]] = [[] for _ in sessions]
        drains = [asyncio.create_task(drain(s, k)) for s, k in zip(sessions, sinks, strict=True)]
        await asyncio.gather(*(feed(s, pcm, 10.0) for s in sessions))
        counts = [s.outputs for s in sessions]  # type: ignore[attr-defined]
        for s in sessions:
            await s.end_input()
        await asyncio.wait_for(asyncio.gather(*drains), 60)
        return counts

    counts = loop.run_until_complete(run())
    # 10 s of audio at 12.5 frames/s = 125 steps; the first ~0.6 s fills the encoder.
    assert all(100 <= c <= 140 for c in counts), counts


def test_closing_a_session_aborts_its_request_and_frees_the_slot(
    engine: VllmVoxtralEngine, loop: asyncio.AbstractEventLoop
) -> None:
    pcm = speech()

    async def run() -> tuple[int, int]:
        full = [engine.open_session(SessionOptions(f"f{i}", "auto")) for i in range(8)]
        feeds = [asyncio.create_task(feed(s, pcm, 6.0)) for s in full]
        await asyncio.sleep(3.0)
        aborts_before = engine.aborts
        feeds[0].cancel()
        await full[0].aclose()  # mid-stream: must abort, not leave an orphan
        extra = engine.open_session(SessionOptions("extra", "auto"))
        await feed(extra, pcm, 3.0)
        extra_outputs = extra.outputs  # type: ignore[attr-defined]
        for s in [*full[1:], extra]:
            await s.aclose()
        await asyncio.gather(*feeds[1:], return_exceptions=True)
        return engine.aborts - aborts_before, extra_outputs

    aborted, extra_outputs = loop.run_until_complete(run())
    assert aborted >= 1
    assert extra_outputs >= 25, "the freed slot did not serve a new session in real time"


def test_rollover_opens_a_new_session_and_decoding_goes_on(
    engine: VllmVoxtralEngine, loop: asyncio.AbstractEventLoop
) -> None:
    pcm = speech()
    # Random weights write random text; the rut watchdog is off for this test.
    policy = SessionPolicy(budget_s=8.0, margin_s=3.0, overlap_s=2.0,
                           rut=RutPolicy(chars_per_speech_s=0.0))

    async def run() -> SessionManager:
        manager = SessionManager(engine, SessionOptions("roll", "auto"), policy)
        manager.start()
        sink: list[Any] = []
        d = asyncio.create_task(drain(manager, sink))
        await feed(manager, pcm, 16.0)
        await manager.end_input()
        await asyncio.wait_for(d, 60)
        return manager

    manager = loop.run_until_complete(run())
    assert manager.counters["rollovers_budget"] >= 1
    assert manager.counters["sessions_opened"] >= 2


class FailingPrompts:
    """Test tool: the real backend, except that its prompt stream raises after a few
    prompts — a request that fails inside vLLM while others run beside it."""

    def __init__(self, inner: Any, after: int) -> None:
        self.inner = inner
        self.after = after

    async def prompts(self, audio: Any, tokens: Any) -> AsyncIterator[Any]:
        n = 0
        async for p in self.inner.prompts(audio, tokens):
            n += 1
            if n > self.after:
                raise RuntimeError("injected prompt failure")
            yield p

    def generate(self, prompts: Any, request_id: str) -> Any:
        return self.inner.generate(prompts, request_id)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def shutdown(self) -> None:
        """The shared real backend is shut down by its own engine."""


def test_one_failing_session_leaves_the_others_running(
    engine: VllmVoxtralEngine, loop: asyncio.AbstractEventLoop
) -> None:
    pcm = speech()
    failing = VllmVoxtralEngine(engine.options, backend=FailingPrompts(engine.backend, 10),
                                available=set())

    async def run() -> tuple[BaseException | None, list[int]]:
        good = [engine.open_session(SessionOptions(f"g{i}", "auto")) for i in range(3)]
        bad = failing.open_session(SessionOptions("bad", "auto"))
        sinks: list[list[Any]] = [[] for _ in good]
        drains = [asyncio.create_task(drain(s, k)) for s, k in zip(good, sinks, strict=True)]
        bad_drain = asyncio.create_task(drain(bad, []))
        await asyncio.gather(*(feed(s, pcm, 6.0) for s in [*good, bad]))
        bad_err: BaseException | None = None
        try:
            await asyncio.wait_for(bad_drain, 30)
        except Exception as exc:
            bad_err = exc
        counts = [s.outputs for s in good]  # type: ignore[attr-defined]
        for s in good:
            await s.end_input()
        await asyncio.wait_for(asyncio.gather(*drains), 60)
        return bad_err, counts

    bad_err, counts = loop.run_until_complete(run())
    assert bad_err is not None, "the failing request did not fail"
    assert all(c >= 60 for c in counts), counts
