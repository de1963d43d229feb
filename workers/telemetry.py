"""The metrics seam of the worker floor.

Workers count things in plain dicts; a `MetricsSink` turns them into metrics.
The orchestrator's runtime injects one backed by `ray.util.metrics` (so one
scrape of the Ray nodes covers every actor) that maps these keys onto the
metric catalog (`orchestrator/metric_catalog.py`); tests inject a recording one.

Keys a worker reports through `stream_update` (per stream):
- ASR host: the session manager's counters and gauges (`rollovers_<reason>`,
  `rut_recoveries`, `gaps`, `gap_fill_s`, ..., `voiced_without_text_s`), plus
  `session_errors`, `asr_audio_s` (counters) and `speech_without_caption_s`,
  `last_caption_at`, `active` (gauges).
- Ingest host: `source_audio_s`, `source_reconnects`, `source_gaps_<reason>` (counters).

Through `actor_update` (per actor): `engine_busy_s`, `engine_steps` (counters).
"""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def stream_update(
        self, stream: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        """`counters`: increments since the last call; `gauges`: current values."""

    def caption_published(self, stream: str, is_final: bool, latency_s: float | None) -> None:
        """One caption published; `latency_s`: capture time of its last word to its
        publication (None for a caption without text)."""

    def actor_update(
        self, actor: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        """Figures of the whole actor (its engine), like `stream_update`."""


class RecordingSink:
    """Keeps every update in memory (tests, benchmarks)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], float] = {}
        self.gauges: dict[tuple[str, str], float] = {}
        self.captions: list[tuple[str, bool, float | None]] = []
        self.actor_counters: dict[tuple[str, str], float] = {}
        self.actor_gauges: dict[tuple[str, str], float] = {}

    def stream_update(
        self, stream: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        for name, value in counters.items():
            self.counters[(stream, name)] = self.counters.get((stream, name), 0.0) + value
        for name, value in gauges.items():
            self.gauges[(stream, name)] = value

    def caption_published(self, stream: str, is_final: bool, latency_s: float | None) -> None:
        self.captions.append((stream, is_final, latency_s))

    def actor_update(
        self, actor: str, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        for name, value in counters.items():
            key = (actor, name)
            self.actor_counters[key] = self.actor_counters.get(key, 0.0) + value
        for name, value in gauges.items():
            self.actor_gauges[(actor, name)] = value
