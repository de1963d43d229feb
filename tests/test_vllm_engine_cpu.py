"""The `vllm` engine's plain parts, without vLLM: options → engine args, capability
detection, and session bookkeeping against a fake backend (named as such) that
implements the same async API as the real AsyncLLM backend."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from workers.engines.base import EngineError, SessionOptions
from workers.engines.vllm_voxtral import (
    VllmEngineOptions,
    VllmVoxtralEngine,
    capabilities_for,
    engine_kwargs,
)
from workers.events import AudioChunk

pytestmark = pytest.mark.unit

STOCK_026 = {"model", "tokenizer_mode", "config_format", "load_format", "dtype",
             "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "gpu_memory_utilization", "enforce_eager", "enable_prefix_caching",
             "limit_mm_per_prompt", "compilation_config", "attention_backend"}
UNBOUNDED = STOCK_026 | {"enable_realtime_unbounded", "realtime_blank_run_k"}


def test_engine_args_follow_the_documented_mapping() -> None:
    kw = engine_kwargs(VllmEngineOptions(model="/m", max_streams=16, load_format="dummy"),
                       STOCK_026)
    assert kw["max_num_seqs"] == 16
    assert kw["max_num_batched_tokens"] == 400 * 16
    assert kw["tokenizer_mode"] == kw["config_format"] == "mistral"
    assert kw["load_format"] == "dummy"
    assert kw["enable_prefix_caching"] is False
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "enable_realtime_unbounded" not in kw


def test_unbounded_vllm_is_detected_and_used() -> None:
    o = VllmEngineOptions(model="/m")
    kw = engine_kwargs(o, UNBOUNDED)
    assert kw["enable_realtime_unbounded"] is True and kw["realtime_blank_run_k"] == 200
    assert capabilities_for(o, UNBOUNDED).reanchors_natively
    stock = capabilities_for(VllmEngineOptions(model="/m", max_model_len=600), STOCK_026)
    assert not stock.reanchors_natively
    assert stock.max_session_s == pytest.approx(48.0)


@dataclass
class _Completion:
    token_ids: list[int]
    text: str


@dataclass
class _Output:
    outputs: list[_Completion]


@dataclass
class FakeVllmBackend:
    """FAKE: stands in for AsyncLLM where vLLM cannot run. One prompt per audio chunk,
    one output per prompt; every 5th output carries text; fed-back tokens are checked."""

    aborted: list[str] = field(default_factory=list)
    fed_back: int = 0
    fail_after: int | None = None

    async def prompts(self, audio: AsyncIterator[np.ndarray],
                      tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        n = 0
        async for chunk in audio:
            n += 1
            if n > 1:
                await asyncio.wait_for(tokens.get(), 5)  # the session fed the last output back
                self.fed_back += 1
            yield chunk.size

    async def generate(self, prompts: AsyncIterator[Any], request_id: str) -> AsyncIterator[Any]:
        n = 0
        async for _ in prompts:
            n += 1
            if self.fail_after is not None and n > self.fail_after:
                raise RuntimeError("fake engine failure")
            yield _Output([_Completion([32], f" w{n}" if n % 5 == 0 else "")])

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        """Nothing to release."""


def chunk(i: int) -> AudioChunk:
    return AudioChunk("s", i * 1280, bytes(2560), time.time())


def test_session_feeds_tokens_back_drops_empty_deltas_and_ends_cleanly() -> None:
    async def run() -> tuple[list[str], FakeVllmBackend, VllmVoxtralEngine]:
        backend = FakeVllmBackend()
        engine = VllmVoxtralEngine(VllmEngineOptions(model="/m"), backend=backend,
                                   available=STOCK_026)
        session = engine.open_session(SessionOptions("s"))
        for i in range(20):
            await session.push(chunk(i))
        await session.end_input()
        texts = [w.text async for d in session for w in d.committed]
        return texts, backend, engine

    texts, backend, engine = asyncio.run(asyncio.wait_for(run(), 10))
    assert texts == [" w5", " w10", " w15", " w20"]
    assert backend.fed_back == 19
    assert backend.aborted == [], "a finished request needs no abort"
    assert engine.sessions_open == 0


def test_closing_mid_stream_aborts_the_request() -> None:
    async def run() -> FakeVllmBackend:
        backend = FakeVllmBackend()
        engine = VllmVoxtralEngine(VllmEngineOptions(model="/m"), backend=backend,
                                   available=STOCK_026)
        session = engine.open_session(SessionOptions("s"))
        for i in range(3):
            await session.push(chunk(i))
        await asyncio.sleep(0.05)
        await session.aclose()
        return backend

    backend = asyncio.run(asyncio.wait_for(run(), 10))
    assert len(backend.aborted) == 1 and backend.aborted[0].startswith("bc-s-")


def test_engine_failure_surfaces_as_an_engine_error() -> None:
    async def run() -> None:
        engine = VllmVoxtralEngine(VllmEngineOptions(model="/m"),
                                   backend=FakeVllmBackend(fail_after=3), available=STOCK_026)
        session = engine.open_session(SessionOptions("s"))
        for i in range(10):
            await session.push(chunk(i))
        async for _ in session:
            pass

    with pytest.raises(EngineError):
        asyncio.run(asyncio.wait_for(run(), 10))


def test_module_imports_without_vllm_installed() -> None:
    code = ("import sys; sys.modules['vllm'] = None; "
            "import workers.engines.vllm_voxtral as m; print(m.VllmVoxtralEngine.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VllmVoxtralEngine"
