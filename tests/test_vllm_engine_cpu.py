"""The `vllm` engine's plain parts, without vLLM: options → engine args, the stream
geometry from tekken.json, session budgets, slots, health, stamps and pacing, and the
checks at start (workers/engines/vllm/checks.py), against a fake backend
(tests/fake_vllm.py, named as such) that implements the real backend's async API and
paces prompts like Voxtral's realtime buffer. What the start checks read from the GPU
(the plugin worker's probe) is the fake's scripted answer here."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fake_vllm import FRAME, FakeVllmBackend, started_health
from workers.engines.base import EngineError, SessionOptions
from workers.engines.vllm.checks import WHY_CHARS, kv_sessions, kv_shortfall
from workers.engines.vllm.engine import (
    AHEAD_FRAMES,
    SCHEDULER_CLS,
    WORKER_CLS,
    StreamGeometry,
    VllmEngineOptions,
    VllmVoxtralEngine,
    capabilities_for,
    engine_kwargs,
    read_geometry,
    wants_direct,
    wants_reanchor,
)
from workers.events import SAMPLE_RATE, AudioChunk, Word
from workers.sessions.manager import SessionManager, SessionPolicy, session_budget

pytestmark = pytest.mark.unit

STOCK_026 = {"model", "tokenizer_mode", "config_format", "load_format", "dtype",
             "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "gpu_memory_utilization", "enforce_eager", "enable_prefix_caching",
             "limit_mm_per_prompt", "compilation_config", "attention_backend",
             "scheduler_cls", "worker_cls", "async_scheduling", "disable_log_stats"}
FORK = STOCK_026 | {"enable_realtime_unbounded", "realtime_blank_run_k"}
G480 = StreamGeometry(delay_s=0.48, left_pad=32, right_pad=17)


def run(coro: object, timeout: float = 20) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


def chunk(i: int, pos0: int = 0, frames: int = 1) -> AudioChunk:
    return AudioChunk("s", pos0 + i * FRAME * frames, bytes(2 * FRAME * frames), time.time())


def engine_with(backend: FakeVllmBackend, **opts: object) -> VllmVoxtralEngine:
    return VllmVoxtralEngine(VllmEngineOptions(model="/m", **opts),  # type: ignore[arg-type]
                             backend=backend, geometry=G480)


def model_folder(folder: Path) -> str:
    """A model folder as far as the engine reads it: tekken.json's delay and padding."""
    (folder / "tekken.json").write_text(json.dumps(
        {"audio": {"transcription_delay_ms": 480, "streaming_n_left_pad_tokens": 32}}))
    return str(folder)


def built(backend: FakeVllmBackend, folder: Path, **opts: object) -> VllmVoxtralEngine:
    """An engine that builds its backend in start() and checks it, as it does a real one;
    the backend is the FAKE, its answers scripted by the test."""
    return VllmVoxtralEngine(
        VllmEngineOptions(model=model_folder(folder), **opts),  # type: ignore[arg-type]
        backend_factory=lambda _: backend)


AGED_BLOCKS = 78
"""KV blocks one session aged past both windows holds (the probe's geometry below)."""


def probe_for(sessions: int, **more: object) -> dict[str, object]:
    """The plugin worker's probe for a cache that holds `sessions` aged sessions."""
    return {"supported": True, "keep": 8191, "unit": 128, "block_sizes": [128, 16],
            "windows": [8192, 189], "kv_blocks": AGED_BLOCKS * sessions, **more}


# -- options ----------------------------------------------------------------------------

def test_engine_args_leave_headroom_for_rollovers() -> None:
    kw = engine_kwargs(VllmEngineOptions(model="/m", max_streams=16, load_format="dummy"),
                       STOCK_026)
    # A warm rollover opens a 17th session for a moment: max_num_seqs must allow it.
    assert kw["max_num_seqs"] == 20
    assert kw["max_num_batched_tokens"] == 400 * 20
    assert kw["tokenizer_mode"] == kw["config_format"] == "mistral"
    assert kw["enable_prefix_caching"] is False
    assert kw["disable_log_stats"] is True  # nothing reads vLLM's stats
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "scheduler_cls" not in kw
    assert engine_kwargs(VllmEngineOptions(model="/m", max_streams=2), STOCK_026)[
        "max_num_seqs"] == 3
    assert engine_kwargs(VllmEngineOptions(model="/m", max_streams=8, rollover_headroom=0),
                         STOCK_026)["max_num_seqs"] == 8
    # The KV cache's type is vLLM's own unless asked (fp8: half the memory per position).
    assert "kv_cache_dtype" not in kw
    assert engine_kwargs(VllmEngineOptions(model="/m", kv_cache_dtype="fp8"),
                         STOCK_026 | {"kv_cache_dtype"})["kv_cache_dtype"] == "fp8"
    # vLLM's torch profiler exists only where a benchmark asks for it.
    assert "profiler_config" not in engine_kwargs(VllmEngineOptions(model="/m"),
                                                  STOCK_026 | {"profiler_config"})
    profiled = engine_kwargs(VllmEngineOptions(model="/m", torch_profiler_dir="/t"),
                             STOCK_026 | {"profiler_config"})["profiler_config"]
    assert profiled["profiler"] == "torch" and profiled["torch_profiler_dir"] == "/t"


def test_fork_flags_are_never_switched_on_or_claimed() -> None:
    """A fork's enable_realtime_unbounded needs per-request wiring this engine does not
    do, so it must neither be switched on nor reported as native re-anchoring."""
    o = VllmEngineOptions(model="/m", reanchor="off")
    kw = engine_kwargs(o, FORK)
    assert "enable_realtime_unbounded" not in kw and "realtime_blank_run_k" not in kw
    engine = engine_with(FakeVllmBackend(), reanchor="off")
    assert not engine.capabilities.reanchors_natively
    assert engine.capabilities.max_session_s is not None


def test_reanchor_plugin_is_asked_for_only_where_it_was_run() -> None:
    auto = VllmEngineOptions(model="/m")
    assert wants_reanchor(auto, "0.26.0", STOCK_026)
    assert not wants_reanchor(auto, "0.33.0", STOCK_026)  # not run there: roll over
    # The exact version proven, not its series: a patch release may move what the plugin
    # mirrors, and an unreleased build of 0.26 is not 0.26.0.
    for unproven in ("0.26.1", "0.26", "0.26.0.dev3", "0.26.0rc1", "0.2"):
        assert not wants_reanchor(auto, unproven, STOCK_026), unproven
    assert wants_reanchor(VllmEngineOptions(model="/m", reanchor="on"), "0.33.0", STOCK_026)
    assert not wants_reanchor(VllmEngineOptions(model="/m", reanchor="off"), "0.26.0",
                              STOCK_026)
    assert not wants_reanchor(auto, "0.26.0", STOCK_026 - {"worker_cls"})
    kw = engine_kwargs(auto, STOCK_026, reanchor=True)
    assert kw["scheduler_cls"] == SCHEDULER_CLS and kw["worker_cls"] == WORKER_CLS
    assert kw["async_scheduling"] is True


def test_plugin_classes_are_named_where_they_live() -> None:
    root = Path(__file__).resolve().parent.parent
    for qualname in (SCHEDULER_CLS, WORKER_CLS):
        module, cls = qualname.rsplit(".", 1)
        source = (root / (module.replace(".", "/") + ".py")).read_text()
        assert f"class {cls}(" in source


# -- geometry and budgets (padding counts) ---------------------------------------------

def test_geometry_comes_from_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "tekken.json").write_text(json.dumps(
        {"audio": {"transcription_delay_ms": 480, "streaming_n_left_pad_tokens": 32}}))
    g = read_geometry(str(tmp_path))
    assert g == G480 and g.first_frames == 7
    (tmp_path / "tekken.json").write_text(json.dumps(
        {"audio": {"transcription_delay_ms": 960, "streaming_n_left_pad_tokens": 32}}))
    assert read_geometry(str(tmp_path)).right_pad == 12 + 11
    (tmp_path / "tekken.json").write_text(json.dumps({"vocab": []}))
    with pytest.raises(EngineError, match="transcription_delay_ms"):
        read_geometry(str(tmp_path))
    with pytest.raises(EngineError, match=r"nothing/tekken\.json"):
        read_geometry(str(tmp_path / "nothing"))


def test_session_budget_counts_the_padding_positions() -> None:
    o = VllmEngineOptions(model="/m", max_model_len=600)
    caps = capabilities_for(o, G480, reanchoring=False)
    # 600 positions − 32 left pad − 17 right pad − 16 slack, × 80 ms (not 600 × 80 ms).
    assert caps.max_session_s == pytest.approx((600 - 32 - 17 - 16) * 0.08)
    assert session_budget(None, caps) == caps.max_session_s
    assert session_budget(100.0, caps) == caps.max_session_s  # clamped
    assert session_budget(30.0, caps) == 30.0
    reanchoring = capabilities_for(o, G480, reanchoring=True)
    assert reanchoring.reanchors_natively and session_budget(None, reanchoring) is None


# -- sessions --------------------------------------------------------------------------

def test_session_feeds_tokens_back_drops_empty_deltas_and_ends_cleanly() -> None:
    async def go() -> tuple[list[Word], FakeVllmBackend, VllmVoxtralEngine]:
        backend = FakeVllmBackend(right_pad=3)
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        for i in range(26):
            await session.push(chunk(i))
        await session.end_input()
        words = [w async for d in session for w in d.committed]
        await asyncio.sleep(0)
        return words, backend, engine

    words, backend, engine = run(go())  # type: ignore[misc]
    # 26 frames: 26 − 7 + 1 = 20 outputs on audio, then 3 on the right padding.
    assert [w.text for w in words] == [" w4", " w9", " w14", " w19"]
    assert backend.fed_back == 22
    assert backend.aborted == [], "a finished request needs no abort"
    assert engine.sessions_open == 0


def test_direct_input_is_an_engine_option_that_sessions_follow() -> None:
    async def go(direct: bool) -> tuple[list[str], FakeVllmBackend]:
        backend = FakeVllmBackend()
        engine = engine_with(backend, direct_input="on" if direct else "off")
        session = engine.open_session(SessionOptions("s"))
        for i in range(26):
            await session.push(chunk(i))
        await session.end_input()
        return [w.text async for d in session for w in d.committed], backend

    words_off, off = run(go(False))  # type: ignore[misc]
    words_on, on = run(go(True))  # type: ignore[misc]
    assert (off.direct_sessions, on.direct_sessions) == (0, 1)
    # "auto" decides by the installed vLLM's version: a backend without one keeps the renderer
    assert engine_with(FakeVllmBackend()).direct_input is False
    assert wants_direct(VllmEngineOptions(model="/m"), "0.26.0")
    assert not wants_direct(VllmEngineOptions(model="/m"), "0.33.0")
    assert not wants_direct(VllmEngineOptions(model="/m"), "0.26.1")  # exact versions only
    assert wants_direct(VllmEngineOptions(model="/m", direct_input="on"), "0.26.1")
    assert not wants_direct(VllmEngineOptions(model="/m", direct_input="off"), "0.26.0")
    assert words_on == words_off == [" w4", " w9", " w14", " w19"]
    # health says which input path and which spectrogram the engine runs
    described = engine_with(FakeVllmBackend(), direct_input="on").describe()
    assert described["engine_input"] == "direct" and described["engine_melspec"] == "vllm"
    assert described["engine_token_writes"] == "vllm" and described["engine_attention"] == "vllm"


def test_stamps_come_from_the_output_index_not_from_arrival() -> None:
    """Audio replayed into a new session (rollover overlap, rut replay) arrives all at
    once; each word still gets the time of the audio it was decoded from."""
    async def go() -> tuple[list[Word], FakeVllmBackend]:
        backend = FakeVllmBackend(right_pad=0)
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        start = 10 * SAMPLE_RATE  # the replayed window starts 10 s into the stream
        for i in range(100):  # 8 s of audio, all at once
            session.push_nowait(chunk(i, pos0=start))
        await session.end_input()
        return [w async for d in session for w in d.committed], backend

    words, _ = run(go())  # type: ignore[misc]
    assert words
    for w in words:
        k = int(w.text.strip()[1:])
        assert w.end_s == pytest.approx(10.0 + (k + 1) * 0.08)
    ends = [w.end_s for w in words]
    assert ends == sorted(ends)


def test_audio_reaches_the_model_at_its_pace_and_the_input_bound_holds() -> None:
    """Pushed faster than the model decodes, audio waits in the session's bounded queue
    (oldest dropped and counted), never in the model buffer's unbounded one."""
    async def go() -> tuple[list[Word], FakeVllmBackend, int]:
        backend = FakeVllmBackend(right_pad=0)
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        for i in range(700):  # 56 s at once: 100 over the 600-chunk bound
            session.push_nowait(chunk(i))
        dropped = session.dropped_chunks
        await session.end_input()
        return [w async for d in session for w in d.committed], backend, dropped

    words, backend, dropped = run(go())  # type: ignore[misc]
    assert dropped == 100
    assert backend.max_ahead <= (AHEAD_FRAMES + 1) * FRAME, backend.max_ahead
    # The first 100 chunks were dropped: the session's audio starts at chunk 100, and
    # the stamps say so.
    first = words[0]
    k = int(first.text.strip()[1:])
    assert first.end_s == pytest.approx(100 * 0.08 + (k + 1) * 0.08)


def test_a_hole_in_the_input_keeps_later_stamps_right() -> None:
    async def go() -> list[Word]:
        backend = FakeVllmBackend(right_pad=0, text_every=1)
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        for i in [*range(40), *range(50, 90)]:  # chunks 40..49 lost upstream
            session.push_nowait(chunk(i))
        await session.end_input()
        return [w async for d in session for w in d.committed]

    words = run(go())  # type: ignore[arg-type]
    by_k = {int(w.text.strip()[1:]): w for w in words}  # type: ignore[union-attr]
    assert by_k[10].end_s == pytest.approx(11 * 0.08)  # model sample 11·1280: before
    assert by_k[45].end_s == pytest.approx((46 + 10) * 0.08)  # after the hole: +10 frames


def test_sessions_beyond_the_slots_are_refused_and_slots_come_back() -> None:
    """vLLM 0.26's V2 runner dies ("No free indices") when more requests are live than
    max_num_seqs: the engine never opens more sessions than its slots."""
    async def go() -> tuple[int, int]:
        engine = engine_with(FakeVllmBackend(), max_streams=2, rollover_headroom=1)
        sessions = [engine.open_session(SessionOptions(f"s{i}")) for i in range(3)]
        with pytest.raises(EngineError, match="slots"):
            engine.open_session(SessionOptions("x"))
        await sessions[0].aclose()
        again = engine.open_session(SessionOptions("y"))
        # Cancelled before its task ever ran: the slot still comes back.
        quick = engine.open_session(SessionOptions("z")) if engine.sessions_open < 3 else None
        await again.aclose()
        if quick is not None:
            await quick.aclose()
        for s in sessions[1:]:
            await s.aclose()
        await asyncio.sleep(0)
        return engine.sessions_open, engine.slot_refusals

    open_after, refusals = run(go())  # type: ignore[misc]
    assert open_after == 0 and refusals == 1


def test_a_session_cancelled_before_it_ran_frees_its_slot() -> None:
    async def go() -> int:
        engine = engine_with(FakeVllmBackend(), max_streams=1, rollover_headroom=0)
        s = engine.open_session(SessionOptions("s"))
        await s.aclose()  # cancels a task that has not started yet
        await asyncio.sleep(0)
        return engine.sessions_open

    assert run(go()) == 0


def test_a_dead_engine_is_unhealthy_and_fails_sessions_for_good() -> None:
    async def go() -> tuple[bool, bool, EngineError, EngineError]:
        backend = FakeVllmBackend(fail_after=5)
        engine = engine_with(backend)
        healthy = await engine.check_health()
        session = engine.open_session(SessionOptions("s"))
        backend.errored = True  # the engine core died; its requests fail
        for i in range(30):
            await session.push(chunk(i))
        try:
            async for _ in session:
                pass
            raise AssertionError("the session did not fail")
        except EngineError as exc:
            running = exc
        try:
            engine.open_session(SessionOptions("t"))
            raise AssertionError("a dead engine opened a session")
        except EngineError as exc:
            opening = exc
        return healthy, await engine.check_health(), running, opening

    healthy, after, running, opening = run(go())  # type: ignore[misc]
    assert healthy and not after
    assert not running.retryable and not opening.retryable


def test_a_failing_request_is_an_engine_error() -> None:
    async def go() -> None:
        engine = engine_with(FakeVllmBackend(fail_after=3))
        session = engine.open_session(SessionOptions("s"))
        for i in range(20):
            await session.push(chunk(i))
        async for _ in session:
            pass

    with pytest.raises(EngineError) as err:
        run(go())
    assert err.value.retryable


def test_a_request_the_engine_ended_in_error_fails_the_session_for_a_new_one() -> None:
    """The re-anchoring scheduler ends a request whose keys it could not rotate with
    FINISHED_ERROR: its last output says finish_reason "error", and vLLM's front end keeps
    a streaming request's generator open after it. That is not an end of audio: the
    session fails with a retryable error, counted, and aborts the request (so that no
    late chunk of it lingers in the engine). Negative control: a request that ends
    normally (our END) fails nothing. The error is the FAKE backend's, shaped as vLLM's
    output."""
    async def go(error_after: int | None) -> tuple[BaseException | None, VllmVoxtralEngine,
                                                  FakeVllmBackend, list[str]]:
        backend = FakeVllmBackend(error_after=error_after, right_pad=0, text_every=1)
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        for i in range(30):
            await session.push(chunk(i))
        await session.end_input()
        words: list[str] = []
        try:
            async for d in session:
                words += [w.text for w in d.committed]
        except EngineError as exc:
            return exc, engine, backend, words
        return None, engine, backend, words

    failed, engine, backend, words = run(go(5))  # type: ignore[misc]
    assert isinstance(failed, EngineError) and failed.retryable
    assert "ended the request because its re-anchored state could not be kept" in str(failed)
    assert words == [" w0", " w1", " w2", " w3", " w4"]  # nothing from the errored output
    assert engine.stats()["request_errors"] == 1
    assert len(backend.aborted) == 1 and engine.aborts == 1 and engine.sessions_open == 0
    ended, engine, backend, _ = run(go(None))  # type: ignore[misc]
    assert ended is None and engine.stats()["request_errors"] == 0


def test_the_session_manager_replaces_a_session_whose_request_ended_in_error() -> None:
    """Through the real session manager: the failed session is replaced at once (reason
    engine_error, counted), and the stream goes on captioning on the new one. The error
    is the FAKE backend's (its first request ends in error after 5 outputs)."""
    async def go() -> tuple[SessionManager, FakeVllmBackend, VllmVoxtralEngine, int]:
        backend = FakeVllmBackend(error_after=5, right_pad=0, text_every=1)
        engine = engine_with(backend, reanchor="off")
        manager = SessionManager(engine, SessionOptions("s"),
                                 SessionPolicy(restart_backoff_s=0.0))
        manager.start()
        words = 0

        async def consume() -> None:
            nonlocal words
            async for delta in manager:
                words += len(delta.committed)

        task = asyncio.create_task(consume())
        for i in range(100):  # 8 s of silence, at 8 × real time
            await manager.push(chunk(i))
            await asyncio.sleep(0.01)
        await manager.end_input()
        await asyncio.wait_for(task, 15)
        return manager, backend, engine, words

    manager, backend, engine, words = run(go(), 40)  # type: ignore[misc]
    assert manager.counters["rollovers_engine_error"] == 1
    assert len(backend.requests) == 2 and engine.stats()["request_errors"] == 1
    assert words > 20, "the new session captions on"


def test_closing_mid_stream_aborts_the_request() -> None:
    async def go() -> FakeVllmBackend:
        backend = FakeVllmBackend()
        engine = engine_with(backend)
        session = engine.open_session(SessionOptions("s"))
        for i in range(12):
            await session.push(chunk(i))
        await asyncio.sleep(0.05)
        await session.aclose()
        return backend

    backend = run(go())
    assert len(backend.aborted) == 1 and backend.aborted[0].startswith("bc-s-")  # type: ignore[union-attr]


def test_shutdown_runs_off_the_event_loop() -> None:
    """AsyncLLM.shutdown() blocks while the engine core stops; the actor's loop (other
    streams, health answers) must keep running meanwhile."""
    async def go() -> float:
        engine = engine_with(FakeVllmBackend(shutdown_block_s=0.6))
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        await engine.aclose()
        stop = True
        await t
        return max(gaps)

    assert run(go()) < 0.3


def test_a_session_ends_itself_before_max_model_len() -> None:
    """Without re-anchoring (or when it falls behind) the session stops feeding before
    its positions would pass max_model_len, so the manager replaces it in time."""
    async def go(shift: int) -> tuple[int, int]:
        backend = FakeVllmBackend(right_pad=0)
        engine = engine_with(backend, max_model_len=160, reanchor="off")
        session = engine.open_session(SessionOptions("s"))
        engine._shifts[session.request_id] = shift  # type: ignore[attr-defined]
        for i in range(300):
            session.push_nowait(chunk(i))
        await session.end_input()
        async for _ in session:
            pass
        return session.outputs, engine.overruns  # type: ignore[attr-defined]

    outputs, overruns = run(go(0))  # type: ignore[misc]
    # The first prompt holds 39 positions (BOS, 32 of left pad, 6 of delay), each later
    # output one more; the right padding adds 17: all below max_model_len.
    assert overruns == 1
    assert 160 - 16 - 2 <= 38 + outputs + 17 < 160
    outputs, overruns = run(go(10_000))  # type: ignore[misc]
    assert overruns == 0 and outputs == 300 - 7 + 1  # re-anchored: all audio decoded


def test_module_imports_without_vllm_installed() -> None:
    code = ("import sys; sys.modules['vllm'] = None; "
            "import workers.engines.vllm.engine as m; "
            "import workers.engines.vllm.reanchor.plan, workers.engines.vllm.reanchor.rope; "
            "print(m.VllmVoxtralEngine.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VllmVoxtralEngine"


def test_engines_sharing_a_gpu_start_one_at_a_time(tmp_path: Path) -> None:
    """A second process wanting the same GPU's start lock waits until the first lets go
    (vLLM profiles free memory while it starts); another GPU's lock is free."""
    from workers.engines.vllm.engine import gpu_start_lock

    root, folder = str(Path(__file__).resolve().parent.parent), str(tmp_path)
    code = (f"import os, sys, time; sys.path.insert(0, {root!r}); "
            "os.environ['CUDA_VISIBLE_DEVICES'] = sys.argv[1]; "
            "from workers.engines.vllm.engine import gpu_start_lock; t = time.monotonic(); "
            f"ctx = gpu_start_lock({folder!r}); ctx.__enter__(); "
            "print(round(time.monotonic() - t, 2)); ctx.__exit__(None, None, None)")
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        with gpu_start_lock(str(tmp_path)):
            same = subprocess.Popen([sys.executable, "-c", code, "0"], stdout=subprocess.PIPE)
            other = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True,
                                   text=True, timeout=60)
            time.sleep(3.0)
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    out, _ = same.communicate(timeout=60)
    assert float(other.stdout) < 1.0  # GPU 1: not held
    assert float(out) >= 1.0  # GPU 0: waited for the holder


def test_the_engine_says_how_many_aged_sessions_its_kv_cache_holds() -> None:
    """The worker's probe gives the cache's blocks and the windows; the engine warns when
    its session slots outnumber the aged sessions they hold, and health says the figure."""
    probe = {"supported": True, "block_sizes": [128, 16], "windows": [8192, 189],
             "kv_blocks": 5117}
    assert kv_sessions(probe) == 65
    assert kv_sessions({**probe, "kv_blocks": 2636}) == 33
    assert kv_sessions({k: v for k, v in probe.items() if k != "kv_blocks"}) is None
    assert kv_sessions({**probe, "windows": [None, 189]}) is None  # full attention
    assert kv_sessions({**probe, "windows": [8192]}) is None  # groups disagree: unknown
    assert kv_sessions({"supported": False, "why_not": "no plugin"}) is None
    assert kv_sessions(probe_for(16)) == 16
    assert kv_shortfall(45, 36, 65) is None
    assert kv_shortfall(45, 36, None) is None
    said = kv_shortfall(45, 36, 33)
    assert said is not None and "~33" in said and "fewer than its 36 streams" in said
    assert "does not start" in said and "engine.streams_per_actor to 33 or less" in said
    assert "kv_cache_dtype fp8" in said and "gpu_memory_utilization" in said
    assert "engines_per_gpu" in said
    said = kv_shortfall(45, 36, 40)
    assert said is not None and "45 session slots" in said and "capped at 40" in said
    engine = engine_with(FakeVllmBackend())
    assert "engine_kv_sessions" not in engine.describe()
    engine.kv_sessions = 65
    assert engine.describe()["engine_kv_sessions"] == "65"


def test_an_engine_whose_kv_cache_cannot_hold_its_streams_aged_refuses_to_start(
        tmp_path: Path) -> None:
    """On the H200 an engine whose cache filled gave its sessions no steps: an engine
    that would fill it with its own streams does not start, says what to change, and
    gives its GPU memory back. Negative control: one aged session more held, it starts.
    The cache's size is the fake's scripted probe."""
    short = FakeVllmBackend(version="0.26.0", reanchor_requested=True,
                            probe_answer=probe_for(15))
    with pytest.raises(EngineError) as refused:
        run(built(short, tmp_path, max_streams=16).start())
    assert not refused.value.retryable
    said = str(refused.value)
    assert "~15 sessions" in said and "fewer than its 16 streams" in said
    for setting in ("engine.streams_per_actor", "engine.vllm.kv_cache_dtype fp8",
                    "gpu_memory_utilization", "engines_per_gpu"):
        assert setting in said, setting
    assert short.shutdowns == 1, "a refused engine keeps no AsyncLLM"
    enough = FakeVllmBackend(version="0.26.0", reanchor_requested=True,
                             probe_answer=probe_for(16))
    described = run(started_health(built(enough, tmp_path, max_streams=16)))
    assert described["engine_session_slots"] == "16"  # type: ignore[index]
    assert described["engine_mode"] == "reanchor"  # type: ignore[index]


def test_a_kv_cache_short_of_the_rollover_headroom_caps_the_session_slots(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """16 streams + 4 headroom, a cache for 18 aged sessions: 18 slots, and the operator is
    told the headroom shrank and why. Negative controls: a cache for 20 keeps 20 slots
    without a word; a probe without the cache's size leaves the slots as they are."""
    async def go(probe: dict[str, object]) -> tuple[dict[str, str], int]:
        engine = built(FakeVllmBackend(version="0.26.0", reanchor_requested=True,
                                       probe_answer=probe), tmp_path, max_streams=16)
        await engine.start()
        try:
            opened = []
            with pytest.raises(EngineError, match="slots"):
                for i in range(30):
                    opened.append(engine.open_session(SessionOptions(f"s{i}")))
            for session in opened:
                await session.aclose()
            return engine.describe(), len(opened)
        finally:
            await engine.aclose()

    with caplog.at_level(logging.WARNING, logger="workers.engines.vllm.checks"):
        described, opened = run(go(probe_for(18)))  # type: ignore[misc]
    assert described["engine_session_slots"] == "18" and opened == 18
    told = [r.getMessage() for r in caplog.records if "capped at 18" in r.getMessage()]
    assert len(told) == 1 and "20 session slots (16 streams + headroom)" in told[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.engines.vllm.checks"):
        described, opened = run(go(probe_for(20)))  # type: ignore[misc]
        assert (described["engine_session_slots"], opened) == ("20", 20)
        unknown = probe_for(20)
        del unknown["kv_blocks"]
        described, opened = run(go(unknown))  # type: ignore[misc]
        assert (described["engine_session_slots"], opened) == ("20", 20)
    assert not [r for r in caplog.records if "KV cache" in r.getMessage()]


def test_health_says_why_sessions_roll_over_when_reanchoring_was_asked_for(
        tmp_path: Path) -> None:
    """The probe's refusal (or the version gate) is what `babelcast status` shows next to
    "rollover", cut to a status line's length. Negative controls: an engine that
    re-anchors, and one told not to, give no reason. The probe is the fake's script."""
    int4 = ("KV cache dtype 'int4_per_token_head' is stored as bytes this plugin cannot "
            "rotate")

    def mode(**opts: object) -> tuple[str, str | None]:
        d = run(started_health(built(FakeVllmBackend(**opts), tmp_path)))  # type: ignore[arg-type]
        return d["engine_mode"], d["engine_mode_why"] or None  # type: ignore[index]

    refused = {"supported": False, "why_not": int4}
    assert mode(version="0.26.0", reanchor_requested=True, probe_answer=refused) == (
        "rollover", int4)
    long = {"supported": False, "why_not": "x" * 5000}
    _, why = mode(version="0.26.0", reanchor_requested=True, probe_answer=long)
    assert why is not None and len(why) == WHY_CHARS
    _, why = mode(version="0.26.0", reanchor_requested=True,
                  probe_answer=RuntimeError("no method babelcast_reanchor_probe"))
    assert why == "RuntimeError: no method babelcast_reanchor_probe"
    _, why = mode(version="0.33.0")  # "auto" on a version the plugin never ran on
    assert why is not None and "vLLM 0.33.0 is not a version the plugin was run on" in why
    assert mode(version="0.26.0", reanchor_requested=True,
                probe_answer=probe_for(40)) == ("reanchor", None)
    off = run(started_health(built(FakeVllmBackend(version="0.26.0"), tmp_path, reanchor="off")))
    assert (off["engine_mode"], off["engine_mode_why"]) == ("rollover", "")  # type: ignore[index]


def test_direct_input_runs_only_where_its_check_at_start_finds_it_equal_to_the_renderer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """direct.check_equal_async runs at every start where direct input is wanted: equal,
    sessions build their inputs directly; a mismatch or a check that raises, they go
    through vLLM's renderer and health says why (cut to a status line). The check's report
    is the FAKE backend's script: only the GPU tier runs the real comparison."""
    def start(answer: dict[str, object] | Exception, **opts: object
              ) -> tuple[dict[str, str], FakeVllmBackend]:
        backend = FakeVllmBackend(version="0.26.0", direct_answer=answer)
        return run(started_health(built(backend, tmp_path, **opts))), backend  # type: ignore[return-value]

    equal, backend = start({"prompts": 30, "equal": True, "mismatches": []})
    assert equal["engine_input"] == "direct" and equal["engine_input_why"] == ""
    assert backend.direct_checks == 1
    mismatch = ("prompt 0: audio[0].audio_arrays: (torch.bfloat16, (2160,)) != "
                "(torch.float32, (2160,))")
    with caplog.at_level(logging.WARNING, logger="workers.engines.vllm.checks"):
        differs, _ = start({"prompts": 30, "equal": False,
                            "mismatches": [mismatch, "prompt 0: EngineCoreRequest bytes differ"]})
        raised, _ = start(RuntimeError("renderer: no audio processor " + "x" * 500))
    assert differs["engine_input"] == "renderer" and differs["engine_input_why"] == mismatch
    assert raised["engine_input"] == "renderer"
    why = raised["engine_input_why"]
    assert why.startswith("its check failed: RuntimeError: renderer: no audio processor")
    assert len(why) == WHY_CHARS
    told = [r.getMessage() for r in caplog.records if "direct chunk input is off" in r.getMessage()]
    assert len(told) == 2 and mismatch in told[0]
    # Nothing checked where direct input is not wanted: "off", or "auto" on another vLLM.
    for opts, version in (({"direct_input": "off"}, "0.26.0"), ({}, "0.33.0")):
        backend = FakeVllmBackend(version=version)
        d = run(started_health(built(backend, tmp_path, **opts)))
        assert d["engine_input"] == "renderer" and d["engine_input_why"] == ""  # type: ignore[index]
        assert backend.direct_checks == 0


def test_the_tick_gather_is_asked_for_at_start_only_on_the_tick_and_health_says_so(
        tmp_path: Path) -> None:
    """`tick_gather_ms` is switched on through the plugin worker once the engine started,
    and only on the tick it gathers for; health says whether it holds. The worker's
    answer is the FAKE backend's: the holding itself runs in vLLM's scheduler on a GPU."""
    def start(backend: FakeVllmBackend, **opts: object) -> dict[str, str]:
        return run(started_health(built(backend, tmp_path, **opts)))  # type: ignore[return-value]

    on = FakeVllmBackend(version="0.26.0")
    assert start(on, tick_gather_ms=5.0, aligned_feed_ms=80)["engine_tick_gather"] == "5 ms"
    assert on.gather_asked == [5.0]
    # Not asked for: off, and never switched (not even to 0).
    off = FakeVllmBackend(version="0.26.0")
    assert start(off, aligned_feed_ms=80)["engine_tick_gather"] == "off"
    # Without the tick there is nothing to gather: the option is not passed on.
    untimed = FakeVllmBackend(version="0.26.0")
    assert start(untimed, tick_gather_ms=5.0)["engine_tick_gather"] == "off"
    assert off.gather_asked == untimed.gather_asked == []
    # A worker that refuses or fails leaves vLLM's own steps and the engine running.
    for answer in ({"on": False, "why_not": "the plugin worker is not loaded"},
                   RuntimeError("collective_rpc timed out")):
        refused = FakeVllmBackend(version="0.26.0", gather_answer=answer)
        assert start(refused, tick_gather_ms=5.0, aligned_feed_ms=80)[
            "engine_tick_gather"] == "off"
        assert refused.gather_asked == [5.0]


def test_a_direct_input_check_that_does_not_answer_keeps_the_renderer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renderer that hangs must not hang the engine's start: past its time the check
    counts as failed. Negative control: a check that answers in time is taken. (The
    FAKE backend's check sleeps; the limit is shortened from 60 s for the test.)"""
    monkeypatch.setattr("workers.engines.vllm.checks.DIRECT_CHECK_S", 0.2)
    slow = FakeVllmBackend(version="0.26.0", direct_check_s=30.0)
    d = run(started_health(built(slow, tmp_path)), 10)
    assert d["engine_input"] == "renderer"  # type: ignore[index]
    assert d["engine_input_why"].startswith("its check failed: TimeoutError")  # type: ignore[index]
    quick = FakeVllmBackend(version="0.26.0", direct_check_s=0.01)
    assert run(started_health(built(quick, tmp_path)), 10)["engine_input"] == "direct"  # type: ignore[index]


def test_sessions_of_an_engine_whose_direct_check_failed_go_through_the_renderer(
        tmp_path: Path) -> None:
    """What the check decided is what the sessions do (the FAKE backend counts the sessions
    that asked for direct prompts)."""
    async def go(equal: bool) -> int:
        backend = FakeVllmBackend(version="0.26.0", direct_answer={
            "prompts": 30, "equal": equal, "mismatches": [] if equal else ["prompt 3: x"]})
        engine = built(backend, tmp_path, reanchor="off")
        await engine.start()
        try:
            session = engine.open_session(SessionOptions("s"))
            for i in range(10):
                await session.push(chunk(i))
            await session.end_input()
            async for _ in session:
                pass
        finally:
            await engine.aclose()
        return backend.direct_sessions

    assert run(go(True)) == 1
    assert run(go(False)) == 0


def test_reanchor_stats_tell_routine_deferrals_from_failed_rotations() -> None:
    """The plugin worker's counts (polled into reanchor_counts): a re-anchor deferred
    because a step of the request is still in flight is routine (tried again at its next
    chunk); a rotation that raised ended a request and is what the alert counts."""
    engine = engine_with(FakeVllmBackend())
    engine.reanchor_counts = {"reanchors": 7, "rotation_failed": 2, "preempted_ended": 1,
                              "deferred": {"a step of this request is still in flight": 40,
                                           "no block to free yet": 3}}
    stats = engine.stats()
    assert stats["reanchors"] == 7 and stats["reanchor_deferred"] == 43
    assert stats["reanchor_rotation_failures"] == 2
    assert stats["reanchor_preempted_ended"] == 1  # counted apart from the rotation alert
    assert "reanchor_failures" not in stats
    assert engine_with(FakeVllmBackend()).stats()["reanchor_rotation_failures"] == 0


def test_the_asr_actor_exports_failed_rotations_as_a_counter_from_zero() -> None:
    """babelcast_engine_reanchor_rotation_failures_total (alert AsrReanchorRotationFailed):
    the ASR actor turns the engine's cumulative count into increments, the series exists
    at 0 from the first report (so increase() sees the first failure), and the deferrals
    stay out of it."""
    from orchestrator import ray_metrics
    from orchestrator.metric_catalog import spec
    from workers.asr import AsrHost, AsrHostOptions
    from workers.telemetry import RecordingSink

    engine = engine_with(FakeVllmBackend())
    sink = RecordingSink()
    host = AsrHost(AsrHostOptions("asr-0", "redis://unused", 4), engine, sink)
    key = ("asr-0", "engine_reanchor_rotation_failures")
    engine.reanchor_counts = {"reanchors": 3, "deferred": {"in flight": 9}}
    host._export_engine(engine.stats())
    assert sink.actor_counters[key] == 0
    engine.reanchor_counts = {"reanchors": 5, "deferred": {"in flight": 30},
                              "rotation_failed": 2}
    host._export_engine(engine.stats())
    host._export_engine(engine.stats())
    assert sink.actor_counters[key] == 2
    name = ray_metrics.ACTOR_COUNTERS[key[1]]
    assert name == "babelcast_engine_reanchor_rotation_failures_total"
    assert spec(name).kind == "counter" and spec(name).labels == ("actor",)


def test_a_benchmark_may_measure_past_the_kv_bound_and_is_only_warned() -> None:
    """kv_bound_slots False (bench.voxtral_capacity, which runs levels past the product's
    bound on purpose): the slots stay as asked; the bound itself still refuses (above)."""
    from workers.engines.vllm.checks import session_slots

    assert session_slots(45, 36, 20, bound=False) == 45
    with pytest.raises(EngineError, match="streams_per_actor"):
        session_slots(45, 36, 20)


def _handed_places(aligned_ms: int) -> tuple[dict[int, list[float]], FakeVllmBackend]:
    """Two sessions whose streams arrive 40 ms apart in the 80 ms cycle, 12 chunks each
    at real-time pace: where in the cycle each hands its audio to the model."""
    async def go() -> tuple[dict[int, list[float]], FakeVllmBackend]:
        backend = FakeVllmBackend(right_pad=0)
        engine = engine_with(backend, aligned_feed_ms=aligned_ms)
        a, b = (engine.open_session(SessionOptions(s)) for s in ("a", "b"))
        t0 = time.monotonic()

        async def feed(session: object, offset: float) -> None:
            for i in range(12):
                await asyncio.sleep(max(0.0, t0 + offset + i * 0.08 - time.monotonic()))
                session.push_nowait(chunk(i))  # type: ignore[attr-defined]
            await session.end_input()  # type: ignore[attr-defined]

        async def drain(session: object) -> None:
            async for _ in session:  # type: ignore[attr-defined]
                pass

        await asyncio.gather(feed(a, 0.0), feed(b, 0.04), drain(a), drain(b))
        out: dict[int, list[float]] = {}
        for k, t in backend.handed_at:
            out.setdefault(k, []).append(t)
        return out, backend

    return run(go())  # type: ignore[return-value]


def _gap_to_nearest(xs: list[float], ys: list[float]) -> float:
    """Median distance from each of xs to the nearest of ys."""
    gaps = sorted(min(abs(x - y) for y in ys) for x in xs)
    return gaps[len(gaps) // 2]


def test_an_aligned_feed_hands_sessions_audio_on_one_shared_tick() -> None:
    """engine.vllm.aligned_feed_ms: two streams 40 ms apart in the cycle reach the model
    together (the engine core can take both in one step); as they arrive, 40 ms apart
    (the negative control: the same measure tells the two apart)."""
    apart, _ = _handed_places(0)
    assert _gap_to_nearest(apart[0][2:], apart[1][2:]) == pytest.approx(0.04, abs=0.015)
    together, backend = _handed_places(80)
    assert len(together[0]) == len(together[1]) == 12
    assert _gap_to_nearest(together[0][2:], together[1][2:]) < 0.01
    engine = engine_with(backend, aligned_feed_ms=80)
    assert engine.describe()["engine_feed"] == "aligned 80 ms"
    assert engine_with(backend).describe()["engine_feed"] == "as it arrives"


def test_an_aligned_feed_never_holds_a_session_that_is_behind() -> None:
    """A backlog (here 3 s pushed at once) goes to the model at its pace, not one chunk a
    tick: only a caught-up session's chunk waits for the tick."""
    async def go() -> tuple[float, int]:
        backend = FakeVllmBackend(right_pad=0)
        engine = engine_with(backend, aligned_feed_ms=80)
        session = engine.open_session(SessionOptions("s"))
        t0 = time.monotonic()
        for i in range(38):
            session.push_nowait(chunk(i))
        await session.end_input()
        async for _ in session:
            pass
        assert engine.feed_grid is not None
        return time.monotonic() - t0, engine.feed_grid.waits

    took, held = run(go())  # type: ignore[misc]
    assert took < 1.0, took  # 38 ticks would be 3 s
    assert held <= 1
