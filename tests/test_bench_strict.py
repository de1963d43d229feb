"""The strict capacity instrument (bench/capacity, issue 34): the keep-up rule fails what
it must (a session at 97 % or 12.05 frames/s over 5 minutes), the phase's sampling catches
a negative control for real, staggered ages spread over the re-anchor cycle, and the
tables in README.md and docs/benchmarks.md are the kept results, rendered.

The GPU part (engines, ageing, vLLM) runs on the H200 only (bench/results/capacity_h200)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.capacity import render, results, rule, strict
from bench.capacity.ageing import (
    ALIGN,
    ageing_frames,
    ageing_outputs,
    lead_frames,
    stagger_tail,
    step_frames,
    tail_steps,
)
from bench.capacity.feed import Handle
from bench.capacity.phase import _phase, backlog_series

pytestmark = pytest.mark.unit


def series(fps: float, seconds: float, lag_frames: float = 1.5,
           step: float = rule.SAMPLE_S) -> tuple[list[float], list[float]]:
    """A session decoding `fps` frames/s while a sender sends 12.5: its backlog samples."""
    times = [i * step for i in range(int(seconds / step) + 1)]
    return times, [(lag_frames + (12.5 - fps) * t) * rule.FRAME_S for t in times]


def test_rule_fails_sessions_a_frames_per_s_threshold_passed() -> None:
    # 12.05 frames/s over 10 s counted as real time under the old threshold (12.0); over
    # a 5-minute phase it falls 10.8 s behind, and the rule says so.
    for fps in (12.05, 12.1, 12.5 * 0.97):
        v = rule.session_verdict(*series(fps, 300.0))
        assert not v["keeps_up"], (fps, v)
        assert v["backlog_growth_s"] > rule.GROWTH_MAX_S
    # what it lets through: under 0.17 % slow over 5 minutes
    v = rule.session_verdict(*series(12.5 * 0.999, 300.0), decoded_frames=12.5 * 0.999 * 300)
    assert v["keeps_up"], v
    assert v["frames_per_s"] == pytest.approx(12.4875, abs=1e-3)


def test_rule_fails_a_session_that_keeps_pace_a_second_and_more_behind() -> None:
    times, backlog = series(12.5, 300.0, lag_frames=14)  # 1.12 s behind, not growing
    v = rule.session_verdict(times, backlog)
    assert v["backlog_growth_s"] == pytest.approx(0.0, abs=1e-9)
    assert v["backlog_p99_s"] > rule.P99_MAX_S and not v["keeps_up"]


def test_a_stall_is_placed_in_time_and_told_from_a_steady_deficit() -> None:
    # what the engine carrying 34 of 100 did on 2026-12-04: on pace, then 8 s behind for a
    # while, then caught up; the verdict says when and for how long, a steady deficit not
    times, backlog = series(12.5, 300.0)
    stall = [b + (8.0 if 120.0 <= t < 130.0 else 0.0) for t, b in zip(times, backlog, strict=True)]
    v = rule.session_verdict(times, stall)
    assert not v["keeps_up"]
    assert v["backlog_max_s"] == pytest.approx(8.12, abs=0.01)
    assert 120.0 <= v["backlog_max_at_s"] < 130.0
    assert v["backlog_over_bound_s"] == pytest.approx(10.0, abs=rule.SAMPLE_S)
    slow = rule.session_verdict(*series(12.1, 300.0))
    assert slow["backlog_max_at_s"] == pytest.approx(300.0)  # worst at the end
    assert slow["backlog_over_bound_s"] > 200.0
    ok = rule.session_verdict(*series(12.5, 300.0))
    assert ok["backlog_over_bound_s"] == 0.0


def test_phase_verdict_knee_and_controls() -> None:
    ok = rule.session_verdict(*series(12.5, 300.0))
    slow = rule.session_verdict(*series(12.1, 300.0))
    caught = rule.phase_verdict([ok] * 99 + [slow], 300.0, [slow])
    assert caught["passes"] and caught["instrument_ok"] and caught["keep_up"] == 99
    two_slow = rule.phase_verdict([ok] * 98 + [slow] * 2, 300.0, [slow])
    assert not two_slow["passes"]  # 98 % < 99 %
    short = rule.phase_verdict([ok] * 10, 120.0, [slow])
    assert not short["passes"] and not short["phase_long_enough"]
    blind = rule.phase_verdict([ok] * 10, 300.0, [ok])  # the control passed: no figure
    assert blind["instrument_ok"] is False
    assert rule.knee({48: caught, 64: caught, 96: two_slow, 128: caught}) == 64
    assert rule.knee({48: blind, 64: caught}) is None
    assert rule.knee({48: two_slow}) is None


def test_staggered_ages_spread_over_the_reanchor_cycle() -> None:
    tails = [stagger_tail(i, 110, 4096) for i in range(110)]
    assert min(tails) == 0 and max(tails) == 4096 - ALIGN
    assert len(set(tails)) == 4096 // ALIGN  # every 128-position place of the cycle
    counts = [tails.count(t) for t in set(tails)]
    assert max(counts) - min(counts) <= 1  # evenly
    assert all(t % ALIGN == 0 for t in tails)
    assert stagger_tail(110, 110, 4096) == 0  # beyond the total: wraps
    # negative control: same age for all (the old ageing) is one place
    assert len({stagger_tail(i, 110, 0) for i in range(110)}) == 1


@pytest.mark.parametrize("steps,tail", [(0, 0), (5, 0), (5, 384), (0, 256), (2, 3968)])
def test_ageing_steps_add_up(steps: int, tail: int) -> None:
    bulk = 768
    lead = lead_frames() if steps or tail else 0
    outputs = ageing_outputs(steps, tail=tail)
    plan = [bulk] * steps + tail_steps(tail, bulk)
    assert all(size <= bulk for size in plan)
    sizes = [step_frames(k, lead, plan) for k in range(1, outputs)]
    # the first prompt's 8 look-ahead frames, the steps up to the last large one, settle
    assert 8 + sum(sizes) + 2 == ageing_frames(steps, bulk, tail=tail)
    if steps or tail:  # every large step starts on the re-anchor unit
        start = 39 + lead
        for size in sizes[lead:]:
            assert start % ALIGN == 0
            start += size


class RateDecoder:
    """TEST DOUBLE for an engine session (no GPU here): it decodes every frame pushed to
    it, one output per frame, after `delay_s`. The instrument under test is the phase's
    sampling and the rule, not the engine."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.outputs = 0
        self.delay_s = delay_s
        self.tasks: list[asyncio.Task[None]] = []

    def push(self, frame: np.ndarray) -> None:
        assert frame.dtype == np.int16 and frame.size == 1280
        self.tasks.append(asyncio.ensure_future(self._decode()))

    async def _decode(self) -> None:
        await asyncio.sleep(self.delay_s)
        self.outputs += 1

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()


@pytest.mark.parametrize("arrivals", ["lockstep", "spread"])
def test_phase_catches_a_slow_control_session_for_real(arrivals: str) -> None:
    audio = (np.arange(16000 * 4) % 200).astype(np.int16)
    decoders: list[RateDecoder] = []

    async def start(i: int) -> Handle:
        d = RateDecoder()
        decoders.append(d)
        return d.push, (lambda: d.outputs), d.close

    async def counters() -> dict[str, object]:
        return {"reanchors": 3 * len(decoders), "shift_by_request": {}}

    result = asyncio.run(_phase(2, 7.0, audio, start, controls=1,
                                         control_speed=0.8, counters=counters, warm_s=1.0,
                                         arrivals=arrivals))
    assert result["arrivals"] == arrivals
    assert [s["session"] for s in result["sessions"]] == [0, 1]
    for s in result["sessions"]:
        assert s["keeps_up"], s
        assert s["frames_per_s"] == pytest.approx(12.5, abs=0.5)
    (control,) = result["controls"]
    assert not control["keeps_up"], control  # 80 % of real time: ~1.2 s behind by the end
    assert control["backlog_growth_s"] > rule.GROWTH_MAX_S
    assert control["frames_per_s"] == pytest.approx(10.0, abs=0.5)
    assert result["reanchors_in_phase"]["reanchors"] == 0  # the same before and after
    # the measured sessions' backlog through the window, every 5 s: both keep up
    series = result["backlog_series"]
    assert [p[0] for p in series] == pytest.approx([0.0, 5.0], abs=0.3)
    assert all(0 <= mean <= top < 0.5 for _, mean, top in series), series


def test_gpu_util_series_starts_at_the_window() -> None:
    stamps = [100.0 + k for k in range(20)]
    util = [50.0] * 10 + [90.0, 100.0] * 5
    # the window opens at 108: 8 samples before it are left out
    assert strict.util_series(util, stamps, 108.0) == [[0.0, 76.0], [5.0, 96.0], [10.0, 95.0]]


def test_backlog_series_shows_when_sessions_fell_behind() -> None:
    """Two sessions over 20 s sampled every 0.25 s: the second stops decoding at 15 s.
    The series (mean, max every 5 s) is flat until then and shows the fall after."""
    window = []
    for k in range(81):
        t = k * 0.25
        sent = int(t / 0.08)
        window.append((100.0 + t, [sent, sent], [sent, min(sent, int(15 / 0.08))]))
    series = backlog_series(window, 100.0, [0, 0], 2)
    assert [p[0] for p in series] == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert [p[2] for p in series[:4]] == [0.0, 0.0, 0.0, 0.0]
    assert series[4][2] == pytest.approx(5.0, abs=0.1)  # 5 s of audio not decoded
    assert series[4][1] == pytest.approx(2.5, abs=0.1)  # the mean of the two


def test_phase_cut_to_its_deadline() -> None:
    import time

    audio = (np.arange(16000 * 4) % 200).astype(np.int16)

    async def start(i: int) -> Handle:
        d = RateDecoder()
        return d.push, (lambda: d.outputs), d.close

    t = time.time()
    result = asyncio.run(_phase(1, 600.0, audio, start, warm_s=0.5,
                                         deadline=time.time() - 100))
    assert result["seconds_planned"] == 600.0 and result["seconds_fed"] == 5.5
    assert time.time() - t < 15


def strict_result(keep: int, n: int, control_caught: bool = True) -> dict[str, object]:
    ok = rule.session_verdict(*series(12.5, 300.0), decoded_frames=3750)
    slow = rule.session_verdict(*series(12.1, 300.0), decoded_frames=3630)
    control = slow if control_caught else ok
    return results.stamp({
        "kind": "capacity_strict", "config": "project-direct-x3+melspec+tokens+keys",
        "streams": n, "stock": False, "age_min": 12.0,
        "stagger": {"every": 4096}, "verdict": rule.phase_verdict(
            [ok] * keep + [slow] * (n - keep), 300.0, [control]),
        "reanchors_in_phase": {"reanchors": 104, "requests_reanchored": 100},
        "gpu_util_p50": 97.0}, command="python -m bench.capacity.strict --streams 110")


def test_results_carry_their_provenance() -> None:
    r = strict_result(110, 110)
    assert r["command"].startswith("python -m bench.capacity.strict")
    assert r["date"].endswith("Z") and r["commit"]  # git here; COMMIT on the device


def test_tables_are_the_kept_results(tmp_path: Path) -> None:
    # The real tables: README.md and docs/benchmarks.md agree with bench/results.
    assert render.check() == []
    # A table rendered from a folder, then a result changed: the check fails.
    folder = tmp_path / "capacity_h200"
    results.save(strict_result(110, 110), folder / "a.json")
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{render.START}\n{render.END}\noutro\n")
    doc.write_text(render.rendered(doc.read_text(), render.ROOT, folder))
    text = doc.read_text()
    # a result that does not say how its chunks arrived was fed in lockstep
    assert "| 110 | 12 min, staggered | lockstep | 300 s | 110/110 **pass** |" in text
    assert "104 (100 sessions)" in text and "1/1 caught" in text
    changed = json.loads((folder / "a.json").read_text())
    changed["verdict"]["keep_up"] = 109
    (folder / "a.json").write_text(json.dumps(changed))
    assert render.rendered(text, render.ROOT, folder) != text
    spread = {**strict_result(110, 110), "arrivals": "spread", "aligned_feed_ms": 80}
    results.save(spread, folder / "s.json")
    assert "| spread, fed on a 80 ms tick |" in render.table(render.ROOT, folder)
    results.save(strict_result(110, 110, control_caught=False), folder / "b.json")
    assert "**instrument failed**" in render.table(render.ROOT, folder)


def test_render_refuses_a_page_without_markers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="markers"):
        render.rendered("no table here", render.ROOT, tmp_path)


def test_the_strict_bench_parses_its_device_command() -> None:
    from bench.capacity import strict

    a = strict.parse(["--model", "/tmp/voxtral", "--config", "stock-x3", "--streams", "74"])
    assert strict.is_stock(a.config) and a.seconds == rule.MIN_PHASE_S
    assert a.load_format == "babelcast_scaled" and a.kv_cache_dtype == "fp8"
    assert strict.shares(110, 3) == [37, 37, 36]
    assert not strict.is_stock("project-direct-x3+melspec+tokens+keys")
    opts = strict.engine_options(a, 3, 25)
    assert opts.reanchor == "off" and opts.direct_input == "off"
    assert opts.gpu_memory_utilization == pytest.approx(0.3)
    assert opts.kv_cache_memory_bytes is None
    sized = strict.engine_options(strict.parse(
        ["--model", "m", "--config", "project-direct-x3", "--streams", "9",
         "--kv-cache-gib", "30"]), 3, 3)
    assert sized.kv_cache_memory_bytes == 30 * 2**30 and sized.reanchor == "auto"
    from workers.engines.vllm.options import engine_kwargs

    assert engine_kwargs(sized, {"kv_cache_memory_bytes", "model"})[
        "kv_cache_memory_bytes"] == 30 * 2**30
    assert "kv_cache_memory_bytes" not in engine_kwargs(opts, {"kv_cache_memory_bytes"})
    assert shutil.which("python3")
    # unprofiled by default; --profile-dir names one py-spy file per front end, and only
    # --gpu-profile gives the engine core a torch profiler folder
    assert strict.profile_path(a, 1) is None and strict.profiling(a, []) == {"profiled": None}
    spied = strict.parse(["--model", "m", "--config", "project-direct-x3+melspec", "--streams",
                          "75", "--profile-dir", "/tmp/p"])
    assert strict.profile_path(spied, 2) == "/tmp/p/project-direct-x3_melspec-75-fe2.txt"
    assert strict.engine_options(spied, 3, 25, 2).torch_profiler_dir is None
    both = strict.parse(["--model", "m", "--config", "project-direct-x3", "--streams", "75",
                         "--profile-dir", "/tmp/p", "--gpu-profile"])
    assert strict.engine_options(both, 3, 25, 3).torch_profiler_dir == "/tmp/p/torch-fe3"
    # arrivals spread over the cycle unless asked otherwise; the aligned feed is a project
    # engine option, never stock's
    assert a.arrivals == "spread" and a.aligned_feed_ms == 0
    ticked = strict.parse(["--model", "m", "--config", "project-direct-x3", "--streams", "9",
                           "--aligned-feed-ms", "80", "--arrivals", "lockstep"])
    assert strict.engine_options(ticked, 3, 3).aligned_feed_ms == 80
    assert strict.engine_options(strict.parse(
        ["--model", "m", "--config", "stock-x3", "--streams", "9", "--aligned-feed-ms", "80"]),
        3, 3).aligned_feed_ms == 0


def test_spread_arrivals_cover_the_cycle_and_lockstep_does_not() -> None:
    from bench.capacity.phase import arrival_offset_s

    spread = sorted(arrival_offset_s(i, "spread") for i in range(25))
    assert all(0 <= x < 0.08 for x in spread)
    assert max(b - a for a, b in itertools.pairwise(spread)) < 0.08 / 25 * 2.5  # evenly
    assert {arrival_offset_s(i, "lockstep") for i in range(25)} == {0.0}
    with pytest.raises(ValueError, match="arrivals"):
        arrival_offset_s(0, "random")


class _Stuck:
    """A front end whose stop never answers (an engine that hangs on shutdown), holding
    a real child process."""

    def __init__(self) -> None:
        import multiprocessing

        self.proc = multiprocessing.get_context("spawn").Process(target=_sleep_long)
        self.proc.start()

    async def stop(self) -> None:
        await asyncio.sleep(3600)


def _sleep_long() -> None:
    import time

    time.sleep(3600)


async def test_engines_stop_side_by_side_and_a_hung_one_is_killed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2026-12-04 device call was killed while three engines stopped one after the
    other, before it wrote its result: stops now run side by side, each bounded."""
    import time

    from bench.capacity import strict

    monkeypatch.setattr(strict, "STOP_S", 0.5)
    fronts = {1: _Stuck(), 2: _Stuck(), 3: _Stuck()}
    t0 = time.monotonic()
    await strict.stop_all(fronts)
    took = time.monotonic() - t0
    for fe in fronts.values():
        fe.proc.join(5)
        assert not fe.proc.is_alive(), "a hung front end's process is killed"
    assert took < 3 * 0.5, f"stops ran one after another ({took:.1f} s)"


def test_steps_per_second_and_their_batch_come_from_the_workers_counts() -> None:
    from bench.capacity import strict
    from bench.capacity.phase import _counter_diff

    before = {"reanchors": 1, "steps": 1000, "step_requests": 20000}
    after = {"reanchors": 3, "steps": 4000, "step_requests": 95000}
    counted = _counter_diff(before, after)
    assert counted["steps"] == 3000 and counted["step_requests"] == 75000
    assert strict.step_rate(counted, 300.0) == {"steps_per_s": 10.0, "requests_per_step": 25.0}
    # stock: no plugin worker, no counts
    assert strict.step_rate({}, 300.0) == {"steps_per_s": None, "requests_per_step": None}
    # A mean of 12.5 per step from steps of 20 and 5, not of 12 and 13: the sizes say so.
    before = {"steps": 10, "step_requests": 125, "step_sizes": {"5": 5, "20": 5},
              "step_gaps_ms": {"10": 5, "70": 4}}
    after = {"steps": 3010, "step_requests": 37625,
             "step_sizes": {"5": 1505, "12": 0, "20": 1505},
             "step_gaps_ms": {"10": 1505, "70": 1504}}
    counted = _counter_diff(before, after)
    assert counted["step_sizes"] == {"5": 1500, "20": 1500}
    assert counted["step_gaps_ms"] == {"10": 1500, "70": 1500}
    assert strict.step_rate(counted, 300.0) == {
        "steps_per_s": 10.0, "requests_per_step": 12.5, "requests_per_step_p10": 5,
        "requests_per_step_p50": 5, "requests_per_step_p90": 20}


def test_the_phase_summary_adds_the_engines_histograms_key_by_key() -> None:
    """Each engine's counts in the phase carry histograms (`step_sizes`, `step_gaps_ms`)
    and the tick gather's counts beside plain numbers: the summary adds them up key by
    key. (Summed as numbers, the first run with histograms would have failed after its
    five-minute phase, before writing its result.)"""
    def answer(sizes: dict[str, int], holds: int) -> dict[str, object]:
        sessions = [{"session": i, "keeps_up": True, "frames_per_s": 12.5,
                     "backlog_p99_s": 0.2, "backlog_growth_s": 0.0, "backlog_start_s": 0.1,
                     "backlog_end_s": 0.1} for i in range(2)]
        return {"sessions": sessions, "controls": [], "window_s": 300.0,
                "engine_core_us_per_chunk": 2000.0, "front_end_us_per_chunk": 1400.0,
                "helpers_us_per_chunk": 700.0,
                "reanchors_in_phase": {"reanchors": 2, "steps": sum(sizes.values()),
                                       "step_requests": 7500, "step_sizes": sizes,
                                       "step_gaps_ms": {"40": 3000},
                                       "tick_gather": {"window_ms": 5.0, "holds": holds}}}

    out = strict.summarize("project-direct-x2", 4,
                           [answer({"1": 1500, "24": 1500}, 0), answer({"25": 3000}, 9)],
                           [60.0], 0)
    counted = out["reanchors_in_phase"]
    assert counted["reanchors"] == 4 and counted["steps"] == 6000
    assert counted["step_sizes"] == {"1": 1500, "24": 1500, "25": 3000}
    assert counted["step_gaps_ms"] == {"40": 6000}
    assert counted["tick_gather"] == {"window_ms": 5.0, "holds": 9}
    first, second = out["by_front_end"]
    assert (first["requests_per_step_p10"], first["requests_per_step_p90"]) == (1, 24)
    assert second["requests_per_step_p50"] == 25


def test_the_gather_window_is_the_configurations_unless_given() -> None:
    """`--gather-ms` sets the tick gather's window of a `+gather` run (the 5 ms default ran
    out in 99.7 % of ticks at 48 aged sessions on one H100 engine); it is refused without
    `+gather` and outside (0, 40] ms, the range the engine core's switch takes."""
    from bench.capacity import configs, strict

    base = ["--model", "m", "--streams", "48"]
    plain = strict.parse([*base, "--config", "project-direct+melspec+tokens+keys+gather"])
    assert strict.levers_for(plain)["gather"] == configs.GATHER_MS
    wide = strict.parse([*base, "--config", "project-direct+melspec+tokens+keys+gather",
                         "--gather-ms", "20"])
    assert strict.levers_for(wide)["gather"] == 20.0
    off = strict.parse([*base, "--config", "project-direct+melspec+tokens+keys"])
    assert strict.levers_for(off)["gather"] == 0.0
    for bad in (["--config", "project-direct+melspec+tokens+keys", "--gather-ms", "20"],
                ["--config", "project-direct+melspec+tokens+keys+gather", "--gather-ms", "0"],
                ["--config", "project-direct+melspec+tokens+keys+gather", "--gather-ms", "41"]):
        with pytest.raises(SystemExit):
            strict.parse([*base, *bad])


def test_the_table_names_each_runs_gpu_and_reads_every_folder(tmp_path: Path) -> None:
    assert render.gpu_of({"host": {"gpu": "NVIDIA H100 80GB HBM3, 81559 MiB"}}) == "H100"
    assert render.gpu_of({"host": {"gpu": "NVIDIA H200, 143771 MiB"}}) == "H200"
    assert render.gpu_of({"host": {}}) == "—"
    h200, h100 = tmp_path / "capacity_h200", tmp_path / "capacity_h100"
    results.save({**strict_result(75, 75), "host": {"gpu": "NVIDIA H200, 143771 MiB"}},
                 h200 / "a.json")
    results.save({**strict_result(48, 48), "host": {"gpu": "NVIDIA H100 80GB HBM3"}},
                 h100 / "b.json")
    text = render.table(render.ROOT, (h200, h100))
    lines = [line for line in text.splitlines() if line.startswith("| 20")]
    assert len(lines) == 2 and " H200 (" in lines[0] and " H100 (" in lines[1]


def test_the_tick_arrivals_are_read_over_the_window_and_as_window_shares() -> None:
    """`tick_arrivals` (gather.py) over the window: counts and histograms diffed key by
    key, then the share of chunks seen within 5/10/20/40 ms of their tick's first, which
    is what a gather window of that length would hold for (at 48 aged sessions on one H100
    engine the 5 ms window ran out in 99.7 % of ticks)."""
    from bench.capacity import strict
    from bench.capacity.phase import _counter_diff

    before = {"steps": 10, "step_requests": 100,
              "tick_arrivals": {"ticks": 5, "chunks": 50, "offset_ms": {"0": 20, "12": 30},
                                "spread_ms": {"12": 5}}}
    after = {"steps": 1010, "step_requests": 48100,
             "tick_arrivals": {"ticks": 1005, "chunks": 48050,
                               "offset_ms": {"0": 10020, "3": 8000, "12": 20030, "30": 10000},
                               "spread_ms": {"12": 5, "30": 1000}}}
    counted = _counter_diff(before, after)
    assert counted["tick_arrivals"] == {
        "ticks": 1000, "chunks": 48000,
        "offset_ms": {"0": 10000, "3": 8000, "12": 20000, "30": 10000},
        "spread_ms": {"30": 1000}}
    assert strict.step_rate(counted, 80.0)["tick_arrivals_within_ms"] == {
        "5": 0.375, "10": 0.375, "20": 0.792, "40": 1.0}
    assert strict.arrival_shares({}) == {}
