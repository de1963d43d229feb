"""The figures bench.delivery computes from its raw samples: milliseconds and
percentiles, the latency trend, a counter read from /metrics, medians over runs."""

from __future__ import annotations

import array
import statistics
from typing import Any

from bench.system import pct


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _pct_ms(seconds: list[float] | array.array[float], q: float) -> float | None:
    """The q-quantile of values in seconds, in ms (`pct` rounds to 1e-3 of its unit)."""
    return pct([v * 1000 for v in seconds], q)


def _trend_ms_per_s(emitted: array.array[float], lat: array.array[float],
                    start: float) -> float | None:
    """Slope of the per-second median latency over the load: about 0 when the gateway keeps
    up, about 1000 × (1 − delivered/offered) when a backlog grows."""
    import numpy as np

    if len(lat) < 2:
        return None
    t = np.frombuffer(emitted, dtype=np.float64) - start
    v = np.frombuffer(lat, dtype=np.float64) * 1000
    bins = np.floor(t).astype(int)
    xs = np.unique(bins)
    if xs.size < 2:
        return None
    ys = [float(np.median(v[bins == x])) for x in xs]
    return round(float(np.polyfit(xs, ys, 1)[0]), 2)


def _read_counter(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, bool) or not isinstance(value, int | float | dict):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        elif all(r[key] is not None for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = None
    return out
