"""The capacity bench's bookkeeping (bench/capacity; the GPU part runs on the H200 only): a
knee is the largest level every lower level of which also held ≥ 95 % real time, as a
median over rounds; rounds rotate the order so no configuration always runs first."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.capacity.ageing import (
    AgeingBackend,
    ageing_audio,
    prefixed,
    until_aged,
    until_first_sessions_aged,
)
from bench.capacity.configs import (
    CONFIGS,
    GATHER,
    GATHER_MS,
    PIN,
    ab_refusal,
    ab_windows,
    base_of,
    engines_of,
    feed_of,
    front_end_streams,
    levers_of,
    plan,
    trim_of,
)
from bench.capacity.feed import open_production, speech, track_sessions
from bench.capacity.frontend import FrontEnd
from bench.capacity.host import cpu_topology
from bench.capacity.knee import knee_ratios_at_least, knees, rotated
from bench.capacity.orchestrate import ab_rows, by_front_end, run_config
from bench.capacity.phase import WARM_S, _phase
from bench.capacity.pinning import _set_cpus, pin_plan
from bench.capacity.report import gpu_profiles, kv_summary, summarize_gpu_trace, summarize_profiles
from tests.fake_vllm import FRAME, FakeVllmBackend
from workers.engines import vad
from workers.engines.base import SessionOptions
from workers.engines.vllm.engine import DEFAULT_GEOMETRY, VllmEngineOptions, VllmVoxtralEngine
from workers.events import AudioChunk

pytestmark = pytest.mark.unit


def _rows(*shares: float) -> list[dict[str, Any]]:
    return [{"realtime_share": s} for s in shares]


def test_the_knee_is_the_last_level_that_held_with_every_lower_one() -> None:
    levels = {
        64: {"stock": _rows(1.0, 1.0), "project": _rows(1.0, 1.0)},
        96: {"stock": _rows(0.5, 0.96), "project": _rows(1.0, 0.97)},
        128: {"project": _rows(0.2, 0.96, 0.99)},  # median 0.96: holds
        160: {"project": _rows(0.9, 0.8)},
    }
    assert knees(levels, ["stock", "project"]) == {"stock": 64, "project": 128}


def test_a_configuration_that_misses_the_first_level_has_no_knee() -> None:
    levels = {64: {"stock": _rows(0.94, 0.94)}, 96: {"stock": _rows(1.0, 1.0)}}
    assert knees(levels, ["stock", "project"]) == {"stock": None, "project": None}


def test_rounds_rotate_the_order() -> None:
    configs = ["stock", "project", "project-x2"]
    firsts = [rotated(configs, k)[0] for k in range(3)]
    assert sorted(firsts) == sorted(configs)
    assert rotated(configs, 4) == ["project", "project-x2", "stock"]


def test_two_front_end_configurations_split_over_front_ends_one_and_two() -> None:
    assert plan("stock") == [(0, "stock")]
    assert plan("project") == [(0, "project")]
    assert plan("project-direct") == [(0, "direct")]
    assert plan("project-x2") == [(1, "project"), (2, "project")]
    assert plan("project-direct-x2") == [(1, "direct"), (2, "direct")]
    assert plan("project-direct-x4") == [(1, "direct"), (2, "direct"), (3, "direct"),
                                         (4, "direct")]
    assert [engines_of(c) for c in ("stock", "project-direct", "project-x3")] == [1, 1, 3]


def test_a_melspec_configuration_runs_where_its_base_runs() -> None:
    """`+melspec` switches the engine cores' spectrogram on the same engines."""
    assert "project-direct-x2+melspec" in CONFIGS
    assert "stock+melspec" not in CONFIGS  # vLLM's path is measured as it ships
    assert plan("project-direct-x2+melspec") == plan("project-direct-x2")
    assert plan("project-direct+melspec", shared=True) == [(1, "direct")]
    assert engines_of("project-direct-x4+melspec") == 4
    assert feed_of("project-direct-x2+melspec", production=True, age_frames=0) == "production"


def test_the_token_writes_lever_runs_alone_or_with_the_spectrogram() -> None:
    """`+tokens` and `+melspec+tokens` switch the engine cores' token writes on the same
    engines; the base configuration is the same."""
    for c in ("project-direct-x2+tokens", "project-direct-x2+melspec+tokens"):
        assert c in CONFIGS
        assert base_of(c) == "project-direct-x2"
        assert plan(c) == plan("project-direct-x2") and engines_of(c) == 2
    assert "stock+tokens" not in CONFIGS
    assert base_of("project+tokens+melspec") == "project"


def test_the_window_trim_lever_runs_with_the_other_two() -> None:
    """`+melspec+tokens+trim` adds window-trimmed attention on the same engines."""
    c = "project-direct-x2+melspec+tokens+trim"
    assert c in CONFIGS and "stock+trim" not in CONFIGS
    assert base_of(c) == "project-direct-x2"
    assert plan(c) == plan("project-direct-x2") and engines_of(c) == 2
    assert trim_of(c) == "blocks"
    keys = "project-direct-x2+melspec+tokens+keys"
    assert keys in CONFIGS and base_of(keys) == "project-direct-x2"
    assert trim_of(keys) == "keys" and trim_of("project-direct-x2") is False


def test_the_tick_gather_lever_is_an_ab_partner_of_the_same_levers_without_it() -> None:
    """`+gather` holds each tick's first step for GATHER_MS (gather.py), on the same
    engines: its first measurement is an in-phase A/B against the configuration without
    it, windows in turn."""
    keys = "project-direct-x3+melspec+tokens+keys"
    gathered = keys + GATHER
    assert gathered in CONFIGS and gathered + PIN in CONFIGS and "stock+gather" not in CONFIGS
    assert base_of(gathered) == "project-direct-x3" and engines_of(gathered) == 3
    assert levers_of(gathered)["gather"] == GATHER_MS > 0
    assert levers_of(keys)["gather"] == 0.0
    assert ab_refusal([keys, gathered], 4) is None
    assert [w["gather"] for w in ab_windows([keys, gathered], 4)] == [0.0, GATHER_MS] * 2


def test_one_engine_configurations_move_to_front_end_one_when_shared() -> None:
    assert plan("stock", shared=True) == [(1, "stock")]
    assert plan("project-direct", shared=True) == [(1, "direct")]
    assert plan("project-direct-x2", shared=True) == [(1, "direct"), (2, "direct")]


def test_front_end_one_is_sized_for_every_session_only_when_a_one_engine_config_runs_there(
) -> None:
    """vLLM reserves memory per sequence slot before it sizes the KV cache: a front end sized
    for sessions it never gets has fewer blocks than its peers."""
    size = front_end_streams
    x3 = ["project-direct-x3+melspec+tokens+keys"]
    assert [size(f, x3, 104, shared=True) for f in (1, 2, 3)] == [35, 35, 35]
    with_stock = ["stock", *x3]
    assert [size(f, with_stock, 104, shared=True) for f in (1, 2, 3)] == [104, 35, 35]
    assert [size(f, with_stock, 104, shared=False) for f in (0, 1, 2, 3)] == [104, 35, 35, 35]
    mixed = ["project-direct-x2", "project-direct-x4"]  # the fewest engines take the most
    assert [size(f, mixed, 96, shared=True) for f in (1, 4)] == [48, 48]


def test_the_stock_path_is_always_fed_as_vllm_serves_it() -> None:
    assert feed_of("stock", production=True, age_frames=750) == "plain"
    assert feed_of("project-direct", production=True, age_frames=0) == "production"
    assert feed_of("project-direct-x2", production=True, age_frames=750) == "aged-production"
    assert feed_of("project-direct-x2", production=False, age_frames=750) == "aged"
    assert feed_of("project", production=False, age_frames=0) == "plain"


def test_profiles_are_summed_per_process_and_leaf(tmp_path: Path) -> None:
    (tmp_path / "project-direct-x2-96-fe1.txt").write_text(
        'process 11:"python -m bench";main (a.py:1);render (b.py:2) 30\n'
        'process 11:"python -m bench";main (a.py:1);send (c.py:3) 10\n'
        'process 12:"VLLM::EngineCore";step (d.py:4);render (b.py:2) 60\n')
    got = summarize_profiles(str(tmp_path))["project-direct-x2-96-fe1"]
    assert got["samples"] == 100
    assert got["processes"] == {'process 12 VLLM::EngineCore': 0.6,
                                'process 11 python -m bench': 0.4}
    assert got["top_leaves"][0] == ["render (b.py:2)", 0.9]


def test_a_phase_without_samples_says_what_py_spy_said(tmp_path: Path) -> None:
    (tmp_path / "x-96-fe1.log").write_text(
        "py-spy> Sampling process 67 times a second\n\nError: Permission Denied\n")
    (tmp_path / "x-96-fe1.txt").write_text("")
    assert summarize_profiles(str(tmp_path)) == {
        "x-96-fe1": {"samples": 0, "py_spy": "Error: Permission Denied"}}


def test_a_child_process_is_counted_as_itself(tmp_path: Path) -> None:
    """With --subprocesses a child's stack starts with its parent's `process` frame."""
    (tmp_path / "p.txt").write_text(
        'process 11:"python -m bench";main (a.py:1);feed (f.py:2) 25\n'
        'process 11:"python -m bench";process 12:"VLLM::EngineCore";boot (a.py:1);'
        'step (d.py:4);melspec (v.py:776) 50\n'
        'process 11:"python -m bench";process 12:"VLLM::EngineCore";boot (a.py:1);'
        'step (d.py:4);forward (v.py:9) 25\n')
    got = summarize_profiles(str(tmp_path))["p"]
    assert got["processes"] == {"process 12 VLLM::EngineCore": 0.75,
                                "process 11 python -m bench": 0.25}
    # frames in every sample of a process (its parent's, from the fork) are left out
    assert got["top_inclusive"]["process 12 VLLM::EngineCore"] == [
        ["melspec (v.py:776)", 0.5], ["forward (v.py:9)", 0.25]]


async def fake_engine(backend: Any, **options: Any) -> VllmVoxtralEngine:
    """The `vllm` engine's real session code over a FAKE backend, started, 3 streams."""
    engine = VllmVoxtralEngine(
        VllmEngineOptions(model="/fake", max_streams=3, reanchor="off", **options),
        backend=backend, geometry=DEFAULT_GEOMETRY)
    await engine.start()
    return engine


@pytest.mark.integration
async def test_the_production_feed_runs_real_speech_through_the_manager_and_vad() -> None:
    """The production feed on the `vllm` engine's real session code over the FAKE vLLM
    backend (vLLM cannot run here): every stream is decoded through a session manager,
    its voice activity comes from the helper processes, and the phase counts its frames."""
    engine = await fake_engine(FakeVllmBackend(text_every=3))
    opened = track_sessions(engine)
    service = vad.VadService(2)
    try:
        result = await _phase(
            3, 4.5, speech(), lambda i: open_production(engine, service, opened, i))
    finally:
        service.shutdown()
        await engine.aclose()
    assert len(result["fps"]) == 3
    # fed at 12.5 frames/s; the fake decodes every frame it is given
    assert all(11.0 <= f <= 13.5 for f in result["fps"]), result["fps"]
    assert max(result["backlog_s"]) < 1.0
    assert result["helpers_us_per_chunk"] > 0  # Silero ran in the helper processes


@pytest.mark.integration
async def test_a_phase_profiles_its_measured_window_with_its_children(tmp_path: Path) -> None:
    """`--profile-dir`: the front end py-spies itself (with `--subprocesses`: its engine
    core and VAD helpers) once the warm-up is over, and the profile sums per process. FAKE
    vLLM backend (vLLM cannot run here); py-spy and Silero are real."""
    engine = await fake_engine(FakeVllmBackend(text_every=3))
    opened = track_sessions(engine)
    service = vad.VadService(1)
    profile = tmp_path / "project-direct-3-fe0.txt"
    t0 = time.monotonic()
    started: list[float] = []

    async def gpu_profile() -> str:  # FAKE: stands in for vLLM's torch profiler (no GPU)
        started.append(time.monotonic() - t0)
        await asyncio.sleep(0.2)
        return str(tmp_path / "engine.pt.trace.json.gz")

    async def front_end_work() -> None:
        # py-spy counts busy samples only, and with the FAKE backend this front end is
        # idle most of the time: a fresh-clone run caught 4 busy samples, all of the VAD
        # helper, and none of it. ~2 ms of Python every ~7 ms keeps it busy enough to be
        # sampled every time, as a real front end is (536 µs of CPU per chunk on an H100).
        while True:
            sum(range(100_000))
            await asyncio.sleep(0.005)

    work = asyncio.create_task(front_end_work())
    try:
        result = await _phase(
            3, 5.5, speech(), lambda i: open_production(engine, service, opened, i),
            profile=str(profile), gpu_profile=gpu_profile)
    finally:
        work.cancel()
        service.shutdown()
        await engine.aclose()
    assert len(result["fps"]) == 3
    # the GPU profile too starts once the warm-up is over, and the phase names its trace
    assert len(started) == 1 and started[0] >= WARM_S
    assert result["gpu_trace"] == str(tmp_path / "engine.pt.trace.json.gz")
    got = summarize_profiles(str(tmp_path))["project-direct-3-fe0"]
    if got["samples"] == 0:  # a host that forbids attaching: the bench says why
        assert "ermission" in got["py_spy"] or "rror" in got["py_spy"], got
        return
    assert "Sampling process" in profile.with_suffix(".log").read_text(), "py-spy ran"
    # py-spy counts busy samples only; this front end is the process that was sampled
    assert any(p.startswith(f"process {os.getpid()} ") for p in got["processes"]), got


def test_kv_summary_reports_the_peak_of_each_engine_in_the_window(tmp_path: Path) -> None:
    """The engine cores' KV trace (one file per engine) becomes a phase's `kv`."""
    def line(t: float, free: int, running: int, held: tuple[int, int]) -> str:
        return json.dumps({"t": t, "blocks": 100, "free": free, "running": running,
                           "waiting": 1 if free < 10 else 0, "groups": [
                               {"spec": "SlidingWindowSpec", "block_size": 16,
                                "window": 189, "held": held[0], "requests": 10},
                               {"spec": "SlidingWindowSpec", "block_size": 128,
                                "window": 8192, "held": held[1], "requests": 8}]})
    (tmp_path / "kv-1.jsonl").write_text("\n".join([
        line(5.0, 0, 9, (90, 9)),  # before the window: not counted
        line(10.0, 60, 4, (20, 20)), line(11.0, 8, 8, (40, 52)), "not json",
        line(12.0, 30, 8, (40, 30))]) + "\n")
    (tmp_path / "kv-2.jsonl").write_text(line(50.0, 0, 1, (1, 1)) + "\n")  # outside
    [engine] = kv_summary(str(tmp_path), 9.0, 13.0)
    assert engine["engine"] == "kv-1" and engine["used_max"] == 0.92
    assert engine["running_max"] == 8 and engine["waiting_max"] == 1
    assert engine["blocks_per_request_at_peak"] == {
        "SlidingWindowSpec(window 189, block 16)": 4.0,  # 10 sessions hold some
        "SlidingWindowSpec(window 8192, block 128)": 6.5}
    assert "steps_per_s" not in engine  # a trace without step counts says nothing of steps


def test_kv_summary_reports_steps_per_second_and_requests_per_step(tmp_path: Path) -> None:
    """Each trace line counts the steps with tokens since the line before it (the first
    line's reach back before the window) and the requests they scheduled."""
    def line(t: float, steps: int, batched: int) -> str:
        return json.dumps({"t": t, "blocks": 10, "free": 5, "running": 2, "waiting": 0,
                           "steps": steps, "batched": batched, "groups": []})
    (tmp_path / "kv-7.jsonl").write_text("\n".join([
        line(10.0, 999, 999),  # counts steps before the window began: left out
        line(11.0, 300, 900), line(12.0, 100, 100), line(14.0, 200, 600)]) + "\n")
    (tmp_path / "kv-8.jsonl").write_text("\n".join([line(10.0, 5, 5), line(12.0, 0, 0)]))
    one, idle = kv_summary(str(tmp_path), 10.0, 14.0)
    assert one["steps_per_s"] == 150.0  # 600 steps in 4 s
    assert one["requests_per_step"] == 2.67  # 1,600 requests over 600 steps
    assert idle["steps_per_s"] == 0.0 and idle["requests_per_step"] is None


def test_a_torch_profiler_trace_gives_steps_and_their_requests(tmp_path: Path) -> None:
    """A real torch profiler trace (CPU only here: no GPU activity), annotated as vLLM
    annotates engine steps, gzipped as vLLM writes it."""
    import gzip

    import torch

    raw = tmp_path / "trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ctx, gen in ((1, 9), (0, 12), (2, 10)):
            with torch.profiler.record_function(
                    f"execute_context_{ctx}({ctx * 39})_generation_{gen}({gen})"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_chrome_trace(str(raw))
    packed = tmp_path / "engine.pt.trace.json.gz"
    packed.write_bytes(gzip.compress(raw.read_bytes()))
    got = summarize_gpu_trace(str(packed))
    assert got["steps"] == 3
    assert got["requests_per_step"] == 11.33  # (10 + 12 + 12) / 3
    assert got["step_cpu_ms_p50"] > 0
    assert got["gpu_busy_share"] == 0.0 and got["top_gpu"] == []  # no CUDA activity here


def test_gpu_busy_time_counts_overlapping_kernels_once(tmp_path: Path) -> None:
    """Hand-written trace events (the shape CUPTI's activity takes in a torch trace): the
    busy share is the union of the GPU's intervals, kernels rank by their GPU time."""
    def ev(name: str, cat: str, ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    events = [
        ev("execute_context_0(0)_generation_4(4)", "user_annotation", 0, 400),
        ev("execute_context_0(0)_generation_6(6)", "user_annotation", 500, 500),
        ev("gemm", "kernel", 100, 200), ev("gemm", "kernel", 600, 100),
        ev("flash_fwd", "kernel", 250, 100),  # overlaps the first gemm by 50
        ev("Memcpy HtoD", "gpu_memcpy", 900, 50),
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    got = summarize_gpu_trace(str(tmp_path / "t.json"))
    assert got["window_s"] == 0.001 and got["steps"] == 2
    assert got["gpu_busy_share"] == 0.4  # 100-350, 600-700, 900-950: 400 of 1000 µs
    assert got["gpu_busy_ms_per_step"] == 0.2
    assert got["top_gpu"][0] == ["gemm", 0.3, round(300 / 450, 3), 2]
    assert got["gpu_ms_by_category"] == {"gpu_memcpy": 0.05, "kernel": 0.4}
    missing = gpu_profiles({"fe1": None, "fe2": str(tmp_path / "none.json")})
    assert "no trace" in missing["fe1"]["error"]
    assert missing["fe2"]["error"].startswith("FileNotFoundError")


async def test_slow_ageing_goes_on_and_stalled_ageing_stops() -> None:
    """Ageing is stuck only when no session gets a step for a while, not when it is slow."""
    steps = [0]

    async def slow() -> None:  # a step every 0.1 s, 1 s in all: longer than the stall limit
        for _ in range(10):
            await asyncio.sleep(0.1)
            steps[0] += 1

    await until_aged(slow(), lambda: steps[0], stall_s=0.4, every_s=0.05)
    assert steps[0] == 10

    never = asyncio.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stalled"):
        await until_aged(never.wait(), lambda: steps[0], stall_s=0.3, every_s=0.05)
    assert time.monotonic() - t0 < 2.0

    async def broken() -> None:
        raise RuntimeError("an ageing session ended")

    with pytest.raises(RuntimeError, match="ended"):
        await until_aged(broken(), lambda: 0, stall_s=5)


@pytest.mark.integration
async def test_the_aged_production_feed_ages_each_managers_first_session() -> None:
    """`--production --age-min M`: streams fed through the session manager and VAD, each
    stream's first engine session aged before the clock starts; a session opened later
    (a restart) is new. FAKE vLLM backend (its ageing here is 40 frames of speech in front
    of the session's own audio; on the GPU it is bench/capacity/ageing.py's bulk steps)."""
    fake = FakeVllmBackend(text_every=3)
    audio = speech()
    frames = ageing_audio(audio, 0, 40)
    wrapper = AgeingBackend(
        fake, lambda live, tokens, direct: fake.prompts(prefixed(frames, live),
                                                        tokens))
    engine = await fake_engine(wrapper, direct_input="on")
    opened = track_sessions(engine)
    service = vad.VadService(1)
    at_clock: list[int] = []

    async def before() -> None:
        await until_first_sessions_aged(opened, 3, 30)
        wrapper.open = False
        at_clock.extend(x[0].outputs for x in opened.values())

    try:
        result = await _phase(3, 4.5, audio,
                              lambda i: open_production(engine, service, opened, i),
                              before=before)
        assert wrapper.aged_sessions == 3 and fake.direct_sessions == 0
        # a session opened once the clock started takes the real path, not aged
        later = engine.open_session(SessionOptions("later", "auto"))
        await later.push(AudioChunk("later", 0, audio[:FRAME * 9].tobytes(), 0.0))
        async for _ in later:
            break
        await later.aclose()
        assert fake.direct_sessions == 1 and wrapper.aged_sessions == 3
    finally:
        service.shutdown()
        await engine.aclose()
    # fed 40 frames first: the fake's first prompt takes 7, then one output per frame
    assert len(at_clock) == 3 and all(n >= 30 for n in at_clock), at_clock
    # then live, in real time, through the manager and the VAD helpers
    assert all(11.0 <= f <= 13.5 for f in result["fps"]), result["fps"]
    assert result["helpers_us_per_chunk"] > 0


async def test_a_session_past_its_bulk_steps_frees_its_ageing_place_before_live_audio() -> None:
    """The ageing gate (bench/capacity/ageing.py): a session gives its place back when its
    last bulk step's output comes, although its next (one-frame) step waits for live audio
    that comes only once every session has aged. Driven here by plain tasks in the order
    vLLM's buffer takes its steps: with the place given back at that next step instead,
    ageing stalled on the H200 once the gate's first 8 sessions were through."""
    from bench.capacity.ageing import BulkPlace

    bulk_steps, sessions, size = 3, 5, 2
    gate = asyncio.Semaphore(size)
    live = asyncio.Event()
    aged = [asyncio.Event() for _ in range(sessions)]
    in_bulk: list[int] = [0]
    most: list[int] = [0]

    async def session(i: int) -> None:
        place = BulkPlace(gate, bulk_steps)
        try:
            for step in range(bulk_steps + 3):
                if step == bulk_steps + 1:
                    await live.wait()  # the one-frame steps take live audio
                await place.before_step(step)
                if step == 1:
                    in_bulk[0] += 1
                    most[0] = max(most[0], in_bulk[0])
                await asyncio.sleep(0.01)  # the step runs; its output comes
                if step == bulk_steps:
                    in_bulk[0] -= 1
                place.on_output(step + 1)
                if step + 1 == bulk_steps + 1:
                    aged[i].set()
        finally:
            place.release()

    tasks = [asyncio.create_task(session(i)) for i in range(sessions)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in aged)), 5)
        assert most[0] == size  # the gate still bounds the bulk steps
        live.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    finally:
        for t in tasks:
            t.cancel()
    assert gate._value == size  # every place came back, once
    # a session that ends inside its bulk steps gives its place back too
    early = BulkPlace(gate, bulk_steps)
    await early.before_step(1)
    early.release()
    early.release()
    assert gate._value == size


async def test_a_failing_front_end_does_not_leave_the_others_answer_on_the_pipe() -> None:
    """When one of a configuration's front ends fails a phase, the others' answers are
    still read before the phase fails, and every error is named. Before, the first error
    left the other front end's answer unread, the next configuration's read met it in a
    second thread, and that configuration failed with "Ran out of input" (H200)."""
    finished: list[int] = []

    class Front:  # stands in for FrontEnd's pipe side only
        def __init__(self, index: int, delay: float, error: str | None) -> None:
            self.index, self.delay, self.error = index, delay, error

        async def phase(self, *_: Any, **__: Any) -> dict[str, Any]:
            await asyncio.sleep(self.delay)
            finished.append(self.index)
            if self.error:
                raise RuntimeError(f"front end {self.index}: {self.error}")
            return {"fps": [12.5], "backlog_s": [0.1], "front_end_us_per_chunk": 1.0,
                    "engine_core_us_per_chunk": 1.0, "helpers_us_per_chunk": 0.0}

    fronts: Any = {1: Front(1, 0.0, "ageing stalled"), 2: Front(2, 0.3, None)}
    with pytest.raises(RuntimeError, match="front end 1: ageing stalled"):
        await run_config(fronts, "project-direct-x2", 2, 1.0)
    assert finished == [1, 2]  # front end 2's answer was read before the error came out
    fronts = {1: Front(1, 0.0, "ageing stalled"), 2: Front(2, 0.1, "Timeout")}
    with pytest.raises(RuntimeError, match="front end 1: ageing stalled; front end 2: Timeout"):
        await run_config(fronts, "project-direct-x2", 2, 1.0)
    fronts = {1: Front(1, 0.0, None), 2: Front(2, 0.0, None)}
    assert (await run_config(fronts, "project-direct-x2", 2, 1.0))["realtime_share"] == 1.0


def test_a_phase_says_which_engine_lagged() -> None:
    """Two engines of three real time reads as 67 % for the phase; the breakdown names the
    third and its own CPU per chunk."""
    parts = plan("project-direct-x3", shared=True)
    results = [{"fps": fps, "backlog_s": [0.1] * len(fps), "front_end_us_per_chunk": 1000.0,
                "engine_core_us_per_chunk": core, "helpers_us_per_chunk": 600.0,
                "aged_in_s": 90.0}
               for fps, core in (([12.4, 12.5], 1800.0), ([12.3, 12.4], 1900.0),
                                 ([10.6, 11.9], 2600.0))]
    rows = by_front_end(parts, [2, 2, 2], results)
    assert [r["front_end"] for r in rows] == [1, 2, 3]
    assert [r["realtime_streams"] for r in rows] == [2, 2, 0]
    assert rows[2]["frames_per_s_min"] == 10.6 and rows[2]["engine_core_us_per_chunk"] == 2600.0


def test_pinning_gives_each_engine_core_a_physical_core_from_the_top(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight cores of two hardware threads: three engine cores take cores 7, 6 and 5 (both
    threads each); everything else keeps cores 0-4. Too few cores is refused, not bent."""
    groups = [[c, c + 8] for c in range(8)]
    monkeypatch.setattr("bench.capacity.pinning.cpu_groups", lambda usable: groups)
    usable = set(range(16))
    plans = [pin_plan(slot, 3, usable) for slot in range(3)]
    assert [sorted(m) for m, _ in plans] == [[7, 15], [6, 14], [5, 13]]
    assert all(r == {0, 1, 2, 3, 4, 8, 9, 10, 11, 12} for _, r in plans)
    with pytest.raises(RuntimeError, match="8 physical cores cannot give 7"):
        pin_plan(0, 7, usable)


def test_pinning_moves_every_thread_of_a_process_and_back() -> None:
    """Affinity is per thread: a process's threads that already run move too."""
    import threading

    first = min(os.sched_getaffinity(0))
    everything = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c",
                              "import threading, time\n"
                              "t = threading.Thread(target=time.sleep, args=(30,))\n"
                              "t.start(); print('up', flush=True); t.join()"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 2
        assert _set_cpus(child.pid, {first}) == 2
        assert all(os.sched_getaffinity(t) == {first} for t in tids)
        _set_cpus(child.pid, everything)
        assert all(os.sched_getaffinity(t) == everything for t in tids)
    finally:
        child.kill()
        child.wait()
    assert threading.current_thread() is threading.main_thread()


def test_a_pin_configuration_is_an_ab_partner_of_its_unpinned_self() -> None:
    config = "project-direct-x3+melspec+tokens+keys"
    assert config + PIN in CONFIGS
    assert base_of(config + PIN) == "project-direct-x3"
    assert levers_of(config + PIN)["pin"] is True
    assert levers_of(config)["pin"] is False
    assert ab_refusal([config, config + PIN], 4) is None


def test_the_host_fingerprint_counts_physical_cores() -> None:
    topo = cpu_topology()
    assert topo["usable_cpus"] == len(os.sched_getaffinity(0))
    assert 1 <= topo["physical_cores"] <= topo["usable_cpus"]


def test_a_bench_given_one_gpu_asks_nvidia_smi_about_that_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two levels side by side on a 2-GPU host (`scripts/h200.sh strict2`), one per GPU:
    nvidia-smi ignores CUDA_VISIBLE_DEVICES, so without `-i` the second level would read
    the first GPU's busy share."""
    from bench.capacity.host import gpu_select

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_select() == ["-i", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_select() == []  # several: the bench reads the first, as before
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_select() == []


async def test_an_aged_ab_phase_keeps_its_gpu_samples_paired_with_their_stamps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first aged A/B on the H200 lost its whole phase to "zip() argument 2 is longer
    than argument 1": the GPU samples of the ageing were dropped and their stamps kept.
    STAND-INS: the front ends' pipe side, and GPU samples (ageing 10 %, windows 80/90 %)."""
    monkeypatch.setattr("bench.capacity.orchestrate.WARM_S", 0.0)

    async def gpu(stop: asyncio.Event, out: list[float], stamps: list[float]) -> None:
        t = time.monotonic()
        for dt, u in ((0.0, 10.0), (0.05, 10.0), (0.5, 80.0), (1.5, 90.0)):
            out.append(u)
            stamps.append(t + dt)
        await stop.wait()

    monkeypatch.setattr("bench.capacity.orchestrate._gpu_util", gpu)

    def window(t0: float, fps: float, said: dict[str, Any]) -> dict[str, Any]:
        return {"t0": t0, "t1": t0 + 1.0, "fps": [fps, fps], "said": said,
                "front_end_us_per_chunk": 1.0, "engine_core_us_per_chunk": 2.0,
                "helpers_us_per_chunk": 0.5}

    class Front:
        async def phase(self, *_: Any, segments: Any = None, **__: Any) -> dict[str, Any]:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            return {"fps": [12.5, 12.5], "backlog_s": [0.1, 0.1], "aged_in_s": 0.3,
                    "front_end_us_per_chunk": 1.0, "engine_core_us_per_chunk": 2.0,
                    "helpers_us_per_chunk": 0.5,
                    "segments": [window(t + 0.4, 12.5, segments[0]),
                                 window(t + 1.4, 11.0, segments[1])]}

    fronts: Any = {1: Front(), 2: Front()}
    a, b = "project-direct-x2+melspec", "project-direct-x2+melspec+pin"
    row = await run_config(fronts, a, 4, 1.0, ab=[a, b], windows=2)
    assert row["ab"][a]["gpu_util_p50"] == 80.0 and row["ab"][b]["gpu_util_p50"] == 90.0
    assert row["ab"][a]["realtime_share"] == 1.0 and row["ab"][b]["realtime_share"] == 0.0
    assert row["gpu_util_p50"] == 85.0  # the ageing's 10 % samples are not the phase's


def test_a_stock_path_that_misses_the_first_level_still_gives_a_floor_for_the_ratio() -> None:
    """Stock held none of the first level: its knee is below it, so the project's ratio
    is more than knee / first level (the H200 runs: stock 0 % at 96, the project ≥ 128)."""
    ladder = [96, 128]
    found: dict[str, int | None] = {"stock": None, "project-direct-x2": 128, "project": None}
    assert knee_ratios_at_least(found, ladder) == {"project-direct-x2": 1.333,
                                                  "project": None}
    found = {"stock": 64, "project-direct-x2": 128}
    assert knee_ratios_at_least(found, [64, 96, 128]) == {"project-direct-x2": 2.0}
    # without stock in the run there is nothing to compare with
    assert knee_ratios_at_least({"project": 96}, [96]) == {"project": None}


def test_a_front_end_process_writes_nothing_to_the_benchs_stdout() -> None:
    """The bench's stdout is its JSON: a front end's logs (its own and its children's,
    such as vLLM's engine core) go to stderr."""
    code = ("import os; from bench.capacity.frontend import stdout_to_stderr; "
            "print('before'); stdout_to_stderr(); print('python log'); "
            "os.system('echo child process log')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before\n"
    assert "python log" in done.stderr and "child process log" in done.stderr


# ---- the in-phase A/B (--aged-ab) -------------------------------------------------------
def test_an_in_phase_ab_takes_configurations_that_differ_only_in_their_levers() -> None:
    keys, blocks = ("project-direct-x2+melspec+tokens+keys",
                    "project-direct-x2+melspec+tokens+trim")
    assert ab_refusal([keys, blocks], 4) is None
    assert ab_windows([keys, blocks], 4) == [
        {"melspec": True, "tokens": True, "trim": "keys", "gather": 0.0, "pin": False},
        {"melspec": True, "tokens": True, "trim": "blocks", "gather": 0.0, "pin": False}] * 2
    assert "differ only" in str(ab_refusal([keys, "project-x2+melspec+tokens+keys"], 4))
    assert "fewer than two" in str(ab_refusal([keys, blocks], 3))
    assert "two or more" in str(ab_refusal([keys], 4))


async def test_a_phase_with_windows_switches_before_each_and_measures_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST DOUBLE: each session decodes every frame as it is pushed (no engine), so every
    window reads ~12.5 frames/s; the levers' switch is a recorder. What is checked is the
    order: sync before the clock, a switch before each window, windows one after another."""
    monkeypatch.setattr("bench.capacity.phase.WARM_S", 0.2)
    monkeypatch.setattr("bench.capacity.phase.SWITCH_SLACK_S", 0.2)
    events: list[str] = []
    counts = [0, 0]

    async def start(i: int) -> Any:
        def push(_: Any, i: int = i) -> None:
            counts[i] += 1

        async def close() -> None:
            return None

        return push, (lambda i=i: counts[i]), close

    def switch(name: str) -> Any:
        async def go() -> str:
            events.append(name)
            return name
        return go

    async def sync() -> None:
        events.append("sync")

    audio = speech()[: 16000 * 5]
    result = await _phase(2, 0.8, audio, start, segments=[switch("A"), switch("B")] * 2,
                          sync=sync)
    assert events == ["sync", "A", "B", "A", "B"]
    windows = result["segments"]
    assert [w["said"] for w in windows] == ["A", "B", "A", "B"]
    assert all(a["t1"] <= b["t0"] for a, b in itertools.pairwise(windows))
    assert all(6.0 <= f <= 19.0 for w in windows for f in w["fps"]), windows  # ~12.5


async def test_windows_are_fed_until_the_last_one_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST DOUBLE as above. Switches slower than the slack planned for them: the feed goes
    on until the last window ends, so that window does not read sessions out of audio."""
    monkeypatch.setattr("bench.capacity.phase.WARM_S", 0.2)
    monkeypatch.setattr("bench.capacity.phase.SWITCH_SLACK_S", 0.0)
    counts = [0]

    async def start(i: int) -> Any:
        def push(_: Any) -> None:
            counts[0] += 1

        async def close() -> None:
            return None

        return push, (lambda: counts[0]), close

    async def slow_switch() -> str:
        await asyncio.sleep(0.4)
        return "A"

    audio = speech()[: 16000 * 5]
    result = await _phase(1, 0.8, audio, start, segments=[slow_switch] * 3)
    assert result["fed_past_plan_s"] >= 1.0  # three switches of 0.4 s past a 2.6 s plan
    last = result["segments"][-1]
    assert last["fps"][0] >= 10.0, result["segments"]  # fed through to its end: ~12.5


def test_ab_rows_give_each_configuration_its_own_windows() -> None:
    """Two front ends, four windows A B A B: A's figures come from windows 1 and 3 only."""
    def window(t0: float, fps: list[float], said: str) -> dict[str, Any]:
        return {"t0": t0, "t1": t0 + 10, "fps": fps, "said": said,
                "front_end_us_per_chunk": 100.0 if said == "A" else 200.0,
                "engine_core_us_per_chunk": 1.0, "helpers_us_per_chunk": 0.0}

    answers = [{"segments": [window(0, [12.5, 12.4], "A"), window(11, [10.0, 10.2], "B"),
                             window(22, [12.3, 12.5], "A"), window(33, [10.4, 10.0], "B")]},
               {"segments": [window(0.5, [12.6], "A"), window(11.5, [9.0], "B"),
                             window(22.5, [12.0], "A"), window(33.5, [9.2], "B")]}]
    util = [90.0, 70.0, 91.0, 71.0]
    stamps = [5.0, 16.0, 27.0, 38.0]
    rows = ab_rows(["A", "B"], answers, [2, 1], util, stamps)
    a, b = rows["A"], rows["B"]
    assert a["windows"] == [1, 3] and b["windows"] == [2, 4]
    assert a["realtime_share"] == 1.0 and b["realtime_share"] == 0.0
    assert a["frames_per_s_min"] == 12.3 and b["frames_per_s_min"] == 9.1  # (9.0 + 9.2) / 2
    assert a["gpu_util_p50"] == 90.5 and b["gpu_util_p50"] == 70.5
    assert a["front_end_us_per_chunk"] == 100.0 and b["front_end_us_per_chunk"] == 200.0
    assert a["levers"] == "A" and b["levers"] == "B"
    assert a["realtime_by_front_end"] == [2, 1] and b["realtime_by_front_end"] == [0, 0]
    assert b["frames_per_s_p50_by_front_end"] == [10.15, 9.1]
    assert "steps_per_s" not in a  # the windows counted no steps (stock, an old worker)


def test_ab_rows_say_how_each_configuration_batched_its_steps() -> None:
    """Each window carries its engine's step counts (`counted`); a configuration's row
    adds its windows' up: steps per second of the mean engine, requests per step and the
    gather's counts. Two engines, A (two steps a tick) and B (one)."""
    def window(t0: float, steps: int, sizes: dict[str, int], holds: int) -> dict[str, Any]:
        return {"t0": t0, "t1": t0 + 10, "fps": [12.5], "said": {},
                "front_end_us_per_chunk": 1.0, "engine_core_us_per_chunk": 1.0,
                "helpers_us_per_chunk": 0.0,
                "counted": {"steps": steps, "step_requests": 2500, "step_sizes": sizes,
                            "tick_gather": {"window_ms": 5.0 if holds else 0.0,
                                            "ticks": 125, "holds": holds}}}

    two, one = {"5": 125, "15": 125}, {"20": 125}
    answers = [{"segments": [window(0, 250, two, 0), window(11, 125, one, 300)]},
               {"segments": [window(0, 250, two, 0), window(11, 125, one, 280)]}]
    rows = ab_rows(["A", "B"], answers, [1, 1], [], [])
    a, b = rows["A"], rows["B"]
    assert a["steps_per_s"] == 25.0 and b["steps_per_s"] == 12.5
    assert a["requests_per_step"] == 10.0 and b["requests_per_step"] == 20.0
    assert (a["requests_per_step_p10"], a["requests_per_step_p90"]) == (5, 15)
    assert b["counted_in_windows"]["tick_gather"] == {"window_ms": 5.0, "ticks": 250,
                                                      "holds": 580}
    assert a["counted_in_windows"]["step_sizes"] == {"5": 250, "15": 250}


async def test_front_ends_of_an_ab_start_their_windows_together() -> None:
    """Real pipes; STAND-INS play the front-end processes' side (say ready, wait for go,
    answer). No front end gets go before all said ready; one that fails before its windows
    lets the others go."""
    import multiprocessing as mp
    import threading

    def front(conn: Any, delay: float, fail: bool, log: list[str], name: str) -> None:
        conn.recv()  # the phase command
        time.sleep(delay)
        if fail:
            conn.send({"error": "ageing stalled"})
            return
        log.append(f"{name} ready")
        conn.send({"ready": True})
        assert conn.recv() == {"op": "go"}
        log.append(f"{name} go")
        conn.send({"fps": [12.5]})

    async def run(delays: list[float], fails: list[bool]) -> tuple[list[Any], list[str]]:
        log: list[str] = []
        fronts, threads = [], []
        for i, (delay, fail) in enumerate(zip(delays, fails, strict=True)):
            ours, theirs = mp.Pipe()
            fe = object.__new__(FrontEnd)
            fe.conn, fe.index = ours, i
            fronts.append(fe)
            threads.append(threading.Thread(target=front, args=(theirs, delay, fail, log,
                                                                f"fe{i}"), daemon=True))
            threads[-1].start()
        barrier = asyncio.Barrier(len(fronts))
        answers = await asyncio.wait_for(asyncio.gather(*(
            fe.phase("direct", 1, 1.0, 0, barrier=barrier, segments=[{}]) for fe in fronts),
            return_exceptions=True), 10)
        return list(answers), log

    answers, log = await run([0.0, 0.5], [False, False])
    assert answers == [{"fps": [12.5]}, {"fps": [12.5]}]
    assert log.index("fe1 ready") < log.index("fe0 go")  # fe0 waited for fe1
    answers, log = await run([0.3, 0.0], [False, True])
    assert answers[0] == {"fps": [12.5]} and isinstance(answers[1], RuntimeError)
