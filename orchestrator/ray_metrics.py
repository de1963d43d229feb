"""Metrics from inside Ray actors: the catalog's instruments as `ray.util.metrics` (the
actors' processes export them on Ray's metrics port), and the file that tells Prometheus
where those ports are."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from orchestrator import metric_catalog
from orchestrator.metric_catalog import MetricSpec

log = logging.getLogger(__name__)


class _RayCounter:
    """A Ray counter that can also be created at zero. `Counter.inc` refuses 0 ("value
    must be >0"), yet a series that first appears at its first event reads "No data" on
    a dashboard until then and a `rate()` alert misses that first increment; recording 0
    through the counter's own record path makes the series exist at 0."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.counter.inc(value, tags=tags)

    def zero(self, tags: dict[str, str]) -> None:
        self.counter._record(0.0, tags=tags)


def _ray_instrument(m: MetricSpec) -> Any:
    from ray.util import metrics as rm

    if m.kind == "counter":
        return _RayCounter(rm.Counter(m.name, m.help, tag_keys=m.labels))
    if m.kind == "gauge":
        return rm.Gauge(m.name, m.help, tag_keys=m.labels)
    return rm.Histogram(m.name, m.help, boundaries=list(m.buckets), tag_keys=m.labels)


InstrumentFactory = Callable[[MetricSpec], Any]

# One instrument per metric and process (an actor's process may hold several sinks).
_RAY_INSTRUMENTS: dict[str, Any] = {}


class CatalogInstruments:
    """Instruments of the metric catalog, made on first use; every record names
    exactly the labels the catalog lists for that metric (Ray refuses missing ones)."""

    def __init__(self, factory: InstrumentFactory = _ray_instrument,
                 cache: dict[str, Any] | None = None) -> None:
        self._factory = factory
        self._made = _RAY_INSTRUMENTS if cache is None else cache

    def _get(self, name: str, labels: dict[str, str]) -> tuple[Any, dict[str, str]]:
        m = metric_catalog.spec(name)
        if set(labels) != set(m.labels):
            raise ValueError(f"{name} takes labels {m.labels}, got {sorted(labels)}")
        inst = self._made.get(name)
        if inst is None:
            inst = self._made[name] = self._factory(m)
        return inst, labels

    def inc(self, name: str, value: float, **labels: str) -> None:
        """Add `value`; an increment of exactly 0 creates the series at zero."""
        if value > 0:
            inst, tags = self._get(name, labels)
            inst.inc(value, tags=tags)
        elif value == 0:
            inst, tags = self._get(name, labels)
            inst.zero(tags=tags)

    def set(self, name: str, value: float, **labels: str) -> None:
        inst, tags = self._get(name, labels)
        inst.set(value, tags=tags)

    def observe(self, name: str, value: float, **labels: str) -> None:
        inst, tags = self._get(name, labels)
        inst.observe(value, tags=tags)


STREAM_COUNTERS: dict[str, str] = {
    "rut_recoveries": "babelcast_rut_recoveries_total",
    "gaps": "babelcast_audio_gaps_total",
    "gap_fill_s": "babelcast_audio_gap_fill_seconds_total",
    "session_errors": "babelcast_session_errors_total",
    "asr_audio_s": "babelcast_asr_audio_seconds_total",
    "source_audio_s": "babelcast_source_audio_seconds_total",
    "source_reconnects": "babelcast_source_reconnects_total",
    "source_refused": "babelcast_source_refused_total",
    "stalls": "babelcast_audio_stalls_total",
    "late_audio_dropped_s": "babelcast_late_audio_dropped_seconds_total",
}
"""Worker counter keys (`workers.telemetry`) → catalog metrics labelled by stream."""
STREAM_COUNTER_PREFIXES: dict[str, str] = {
    "rollovers_": "babelcast_rollovers_total",
    "source_gaps_": "babelcast_source_gaps_total",
    "skipped_s_": "babelcast_audio_skipped_seconds_total",
}
"""Keys `<prefix><reason>` → metrics labelled by stream and reason."""
STREAM_GAUGES: dict[str, str] = {
    "voiced_without_text_s": "babelcast_voiced_without_text_seconds",
    "speech_without_caption_s": "babelcast_speech_without_caption_seconds",
    "last_caption_at": "babelcast_last_caption_timestamp_seconds",
    "active": "babelcast_asr_stream_active",
    "source_silent_s": "babelcast_source_silent_seconds",
    "stall_threshold_s": "babelcast_stall_threshold_seconds",
    "caption_lag_s": "babelcast_caption_lag_seconds",
}
ACTOR_COUNTERS: dict[str, str] = {
    "engine_busy_s": "babelcast_engine_busy_seconds_total",
    "engine_steps": "babelcast_engine_steps_total",
    "engine_reanchors": "babelcast_engine_reanchors_total",
    "engine_reanchor_rotation_failures": "babelcast_engine_reanchor_rotation_failures_total",
}
ACTOR_GAUGES: dict[str, str] = {
    "engine_healthy": "babelcast_engine_healthy",
    "engine_reanchoring": "babelcast_engine_reanchoring",
}
STATUS_ONLY = frozenset({
    "sessions_opened", "seam_words_deduped", "rollover_failures", "session_open_failures",
    "ruts_detected", "forced_switches", "source_gaps",
})
"""Session-manager counters that stay in the stream's status hash only."""


class RayMetricsSink:
    """Worker figures (`workers.telemetry.MetricsSink`) as `ray.util.metrics`
    instruments, so Ray's metrics agent exports them from every node (one scrape
    covers the cluster). `actor` labels the metrics that carry it."""

    def __init__(self, actor: str, instruments: CatalogInstruments | None = None) -> None:
        self.actor = actor
        self.m = instruments or CatalogInstruments()

    def _labels(self, name: str, **labels: str) -> dict[str, str]:
        if "actor" in metric_catalog.spec(name).labels:
            labels["actor"] = self.actor
        return labels

    def stream_update(self, stream: str, counters: dict[str, float],
                      gauges: dict[str, float]) -> None:
        for key, value in counters.items():
            name = STREAM_COUNTERS.get(key)
            if name is not None:
                self.m.inc(name, value, **self._labels(name, stream=stream))
                continue
            for prefix, name in STREAM_COUNTER_PREFIXES.items():
                if key.startswith(prefix):
                    self.m.inc(name, value, stream=stream, reason=key.removeprefix(prefix))
        for key, value in gauges.items():
            name = STREAM_GAUGES.get(key)
            if name is not None:
                self.m.set(name, value, **self._labels(name, stream=stream))

    def caption_published(self, stream: str, is_final: bool, latency_s: float | None) -> None:
        kind = "final" if is_final else "partial"
        self.m.inc("babelcast_captions_published_total", 1, stream=stream, kind=kind)
        if latency_s is not None:
            self.m.observe("babelcast_caption_latency_seconds", max(0.0, latency_s),
                           stream=stream, kind=kind)

    def actor_update(self, actor: str, counters: dict[str, float],
                     gauges: dict[str, float]) -> None:
        for key, value in counters.items():
            name = ACTOR_COUNTERS.get(key)
            if name is not None:
                self.m.inc(name, value, actor=actor)
        for key, value in gauges.items():
            name = ACTOR_GAUGES.get(key)
            if name is not None:
                self.m.set(name, value, actor=actor)


class RayTranslationMetrics:
    """Translator figures (`translation.host.TranslationMetrics`) as `ray.util.metrics`."""

    def __init__(self, instruments: CatalogInstruments | None = None) -> None:
        self.m = instruments or CatalogInstruments()

    def published(self, stream: str, lang: str, backend: str, lag_s: float, error: bool,
                  final: bool) -> None:
        tags = {"stream": stream, "lang": lang, "backend": backend}
        self.m.inc("babelcast_translations_total", 1, **tags,
                   kind="final" if final else "partial")
        if final:
            self.m.observe("babelcast_translation_lag_seconds", max(0.0, lag_s), **tags)
        # 0 when it went well: the errors series exists from the first translation.
        self.m.inc("babelcast_translation_errors_total", 1 if error else 0, **tags)

    def queue(self, depth: dict[str, float]) -> None:
        self.m.set("babelcast_translation_queue_jobs", depth.get("pending", 0), state="pending")
        self.m.set("babelcast_translation_queue_jobs", depth.get("lag", 0), state="waiting")
        self.m.set("babelcast_translation_queue_oldest_age_seconds",
                   depth.get("oldest_age_s", 0.0))

    def usage(self, backend: str, counters: dict[str, float]) -> None:
        self.m.inc("babelcast_translation_requests_total", counters.get("requests", 0),
                   backend=backend)
        self.m.inc("babelcast_translation_chars_total", counters.get("chars_in", 0),
                   backend=backend, kind="source")
        self.m.inc("babelcast_translation_chars_total", counters.get("prompt_chars", 0),
                   backend=backend, kind="prompt")


RAY_SD_FILE = "prom_metrics_service_discovery.json"


def write_ray_metrics_targets() -> list[tuple[Path, str]]:
    """Ray's Prometheus service-discovery file, for a local Ray started without its
    dashboard: Ray's dashboard (its reporter module) writes it otherwise, so a
    Prometheus `file_sd_configs` entry for `/tmp/ray/prom_metrics_service_discovery.json`
    works either way. Same name, format and places as Ray's writer: the session
    folder and the Ray temp folder (`/tmp/ray`, or `$RAY_TMPDIR/ray`). Returns the
    files written with their content."""
    from ray._private import worker  # Ray's own writer reads the same node object

    node = worker._global_node
    if node is None:
        return []
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
               for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    content = json.dumps([{"labels": {"job": "ray"}, "targets": targets}])
    written: list[tuple[Path, str]] = []
    for folder in (node.get_session_dir_path(), node.get_temp_dir_path()):
        path = Path(folder) / RAY_SD_FILE
        tmp = path.with_name(f"tmp_babelcast_{RAY_SD_FILE}")
        try:
            tmp.write_text(content)
            os.replace(tmp, path)  # atomic: Prometheus never reads half a file
        except OSError as exc:
            log.warning("cannot write Ray's metrics targets to %s: %s", path, exc)
            continue
        written.append((path, content))
    return written
