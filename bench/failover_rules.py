"""The rules bench.failover judges failover by (tests/test_bench_failover_rules.py):
silence after a fault, seq numbers, finals made twice, percentiles, and words lost or
doubled against the control round."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any


def longest_silence(times: Iterable[float], start: float, end: float) -> float:
    """The longest stretch in [start, end] without a caption time: from the fault to the
    first caption after it, between captions, and from the last one to `end` (the end of
    the speech: a stream that never captions again is silent all the way)."""
    inside = sorted(t for t in times if start < t <= end)
    marks = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(marks))


def seq_contiguous(seqs: Sequence[int]) -> bool:
    """Seq numbers as published: 1, 2, ..., n, no gap and no repeat."""
    return list(seqs) == list(range(1, len(seqs) + 1))


def finals_doubled(final_segment_ids: Sequence[int]) -> int:
    return len(final_segment_ids) - len(set(final_segment_ids))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def against_control(row: dict[str, Any], control: dict[str, Any]) -> None:
    """Words lost/doubled: each stream's deletions/insertions beyond those of the control
    stream with the same index (same audio, same place in the round)."""
    lost = [p["deletions"] - c["deletions"]
            for p, c in zip(row["_per_stream"], control["_per_stream"], strict=True)]
    doubled = [p["insertions"] - c["insertions"]
               for p, c in zip(row["_per_stream"], control["_per_stream"], strict=True)]
    row["words_lost_vs_control"] = sum(lost)
    row["words_lost_vs_control_max_stream"] = max(lost)
    row["words_doubled_vs_control"] = sum(doubled)
    row["words_doubled_vs_control_max_stream"] = max(doubled)
