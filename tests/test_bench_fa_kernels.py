"""bench.fa_kernels off the GPU: its summary of rows, and its refusal without CUDA/vLLM.
The kernel timings themselves need an H200 (scripts/h200.sh fa)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.fa_kernels import summarize

pytestmark = pytest.mark.unit


def row(splits: int, us: float, context: int = 8192, kv: str = "fp8") -> dict[str, object]:
    return {"part": "decoder", "kv": kv, "batch": 14, "context": context, "q_len": 1,
            "splits": splits, "us_per_call": us}


def test_summary_picks_the_fastest_splits_per_shape_against_the_heuristic() -> None:
    best = summarize([row(0, 100.0), row(1, 120.0), row(8, 80.0),
                      row(0, 50.0, context=512), row(4, 60.0, context=512),
                      row(2, 90.0, kv="bf16")])
    assert best["decoder fp8 b14 ctx8192 q1"] == {
        "splits": 8, "us_per_call": 80.0, "heuristic_us": 100.0, "speedup_vs_heuristic": 1.25}
    assert best["decoder fp8 b14 ctx512 q1"]["splits"] == 0
    assert best["decoder fp8 b14 ctx512 q1"]["speedup_vs_heuristic"] == 1.0
    # a shape measured without the heuristic has nothing to compare with
    assert best["decoder bf16 b14 ctx8192 q1"]["speedup_vs_heuristic"] is None


def test_without_cuda_and_vllm_it_says_so_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.fa_kernels"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "needs" in json.loads(done.stdout)["error"]


def test_trim_summary_sets_vllms_call_against_the_trimmed_one_per_shape() -> None:
    from bench.fa_kernels import trim_summary

    rows = [{**row(0, 180.0, context=12288), "variant": "full", "max_err_vs_fp32": 0.004},
            {**row(0, 120.0, context=12288), "variant": "trimmed", "max_err_vs_fp32": 0.005},
            {**row(0, 99.0), "variant": "full"},  # no trimmed twin: no line
            row(0, 50.0)]  # a plain row (no variant) is not part of the A/B
    assert trim_summary(rows) == {"decoder fp8 b14 ctx12288 q1": {
        "full_us": 180.0, "trimmed_us": 120.0, "speedup": 1.5, "err_full": 0.004,
        "err_trimmed": 0.005}}
