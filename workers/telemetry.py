"""The metrics seam of the worker floor.

Workers count things in plain dicts; a `MetricsSink` turns them into metrics.
The orchestrator's runtime injects one backed by `ray.util.metrics` (so one
scrape of the Ray nodes covers every actor); tests inject a recording one.
"""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def stream_update(
        self, stream: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        """`counters`: increments since the last call; `gauges`: current values."""


class RecordingSink:
    """Keeps every update in memory (tests, benchmarks)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], float] = {}
        self.gauges: dict[tuple[str, str], float] = {}

    def stream_update(
        self, stream: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        for name, value in counters.items():
            self.counters[(stream, name)] = self.counters.get((stream, name), 0.0) + value
        for name, value in gauges.items():
            self.gauges[(stream, name)] = value
