"""The metric catalog is the one list of what Babelcast exports: the names follow the
convention, the gateway serves exactly its gateway metrics, and the runtime's Ray
sinks record exactly its actor-side metrics with the labels it lists."""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import REGISTRY

from orchestrator import metrics, ray_metrics
from orchestrator.metric_catalog import BY_EXPOSED, CATALOG, LABELS, MetricSpec, spec

pytestmark = pytest.mark.unit

NAME = re.compile(r"^babelcast_[a-z][a-z0-9_]*[a-z0-9]$")


def test_names_follow_babelcast_thing_unit_and_counters_end_in_total() -> None:
    assert len({m.name for m in CATALOG}) == len(CATALOG)
    assert len(BY_EXPOSED) == len(CATALOG)
    for m in CATALOG:
        assert NAME.match(m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.kind == "histogram":
            assert m.name.endswith("_seconds"), m.name
            assert list(m.buckets) == sorted(m.buckets) and m.buckets, m.name
        else:
            assert not m.buckets, m.name
        if m.source == "ray":
            assert m.exposed == f"ray_{m.name}"


def test_labels_are_bounded_and_help_texts_are_ascii() -> None:
    for m in CATALOG:
        assert set(m.labels) <= set(LABELS), f"{m.name}: unlisted label"
        assert len(set(m.labels)) == len(m.labels)
        assert m.help and m.help.isascii(), f"{m.name}: Ray refuses non-ASCII help"
    # Never caption text, client or session ids.
    assert not {"text", "client", "client_id", "session", "segment_id"} & set(LABELS)


def _registered() -> dict[str, Any]:
    """Families the gateway process registers, by the name they are scraped under."""
    out = {}
    for family in REGISTRY.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = family
    return out


def test_the_gateway_serves_exactly_the_catalogs_gateway_metrics() -> None:
    families = _registered()
    ours = {n for n in families if n.startswith("babelcast_")}
    want = {m.name for m in CATALOG if m.source == "gateway"}
    assert ours == want
    for name in want:
        m, family = spec(name), families[name]
        assert family.type == m.kind
        assert family.documentation == m.help
    instruments = [v for k, v in vars(metrics).items() if k.isupper()]
    # prometheus_client keeps the label names it was given on the instrument.
    declared = {(i._name + ("_total" if i._type == "counter" else "")): tuple(i._labelnames)
                for i in instruments}
    assert declared == {name: spec(name).labels for name in want}


class FakeInstrument:
    def __init__(self, m: MetricSpec, records: list[tuple[str, str, float, dict[str, str]]]):
        self.m = m
        self.records = records

    def _record(self, op: str, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.m.labels), (self.m.name, tags)
        self.records.append((self.m.name, op, value, tags))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self._record("inc", value, tags)

    def zero(self, tags: dict[str, str]) -> None:
        self._record("inc", 0.0, tags)

    def set(self, value: float, tags: dict[str, str]) -> None:
        self._record("set", value, tags)

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self._record("observe", value, tags)


Records = list[tuple[str, str, float, dict[str, str]]]


@pytest.fixture
def recorded() -> tuple[ray_metrics.CatalogInstruments, Records]:
    records: list[tuple[str, str, float, dict[str, str]]] = []

    def factory(m: MetricSpec) -> FakeInstrument:
        assert m.source == "ray", f"{m.name} is a gateway metric"
        return FakeInstrument(m, records)

    return ray_metrics.CatalogInstruments(factory, cache={}), records


_OPS = {"counter": "inc", "gauge": "set", "histogram": "observe"}


def test_ray_sinks_record_every_actor_metric_with_its_catalog_labels(
    recorded: tuple[ray_metrics.CatalogInstruments, Records],
) -> None:
    instruments, records = recorded
    asr = ray_metrics.RayMetricsSink("asr-0", instruments)
    asr.stream_update(
        "room-a",
        {"rollovers_rut": 1, "rut_recoveries": 1, "gaps": 2, "gap_fill_s": 0.5,
         "session_errors": 1, "asr_audio_s": 1.0, "sessions_opened": 3, "stalls": 1,
         "late_audio_dropped_s": 0.2, "skipped_s_replacement": 0.0},
        {"voiced_without_text_s": 2.0, "speech_without_caption_s": 4.0,
         "last_caption_at": 1.7e9, "active": 1.0, "source_silent_s": 3.0,
         "stall_threshold_s": 1.25, "caption_lag_s": 12.5})
    asr.caption_published("room-a", True, 1.2)
    asr.caption_published("room-a", False, 0.4)
    asr.caption_published("room-a", True, None)
    asr.actor_update("asr-0", {"engine_busy_s": 0.5, "engine_steps": 2, "engine_reanchors": 1,
                               "engine_reanchor_rotation_failures": 0},
                     {"engine_healthy": 1.0, "engine_reanchoring": 1.0})
    ingest = ray_metrics.RayMetricsSink("ingest-0", instruments)
    ingest.stream_update("room-a", {"source_audio_s": 1.0, "source_reconnects": 1,
                                    "source_gaps_source-error": 1, "source_refused": 1}, {})
    mt = ray_metrics.RayTranslationMetrics(instruments)
    mt.published("room-a", "pt", "bergamot", 0.4, error=False, final=True)
    mt.published("room-a", "es", "apertium", 0.2, error=True, final=False)
    mt.queue({"pending": 2, "lag": 5, "oldest_age_s": 1.5})
    mt.usage("bergamot", {"requests": 3, "chars_in": 120, "prompt_chars": 120})

    seen = {name for name, *_ in records}
    assert seen == {m.name for m in CATALOG if m.source == "ray"}, "actor metrics not recorded"
    for name, op, _, _ in records:
        assert op == _OPS[spec(name).kind], name
    by = {(n, tuple(sorted(t.items()))): v for n, op, v, t in records if op != "observe"}
    assert by[("babelcast_rollovers_total", (("reason", "rut"), ("stream", "room-a")))] == 1
    assert by[("babelcast_asr_stream_active", (("actor", "asr-0"), ("stream", "room-a")))] == 1
    assert by[("babelcast_caption_lag_seconds", (("stream", "room-a"),))] == 12.5
    assert by[("babelcast_audio_skipped_seconds_total",
               (("reason", "replacement"), ("stream", "room-a")))] == 0.0
    assert by[("babelcast_source_gaps_total",
               (("reason", "source-error"), ("stream", "room-a")))] == 1
    assert by[("babelcast_translation_queue_jobs", (("state", "waiting"),))] == 5
    # Translation lag is a final's figure; the live tail's is not mixed in.
    lags = [t["lang"] for n, _, _, t in records if n == "babelcast_translation_lag_seconds"]
    assert lags == ["pt"]
    latencies = [(t["kind"], v) for n, _, v, t in records
                 if n == "babelcast_caption_latency_seconds"]
    assert latencies == [("final", 1.2), ("partial", 0.4)]


def test_the_runtime_maps_worker_keys_onto_catalog_metrics_of_the_right_shape() -> None:
    for name in ray_metrics.STREAM_COUNTERS.values():
        assert spec(name).kind == "counter" and "stream" in spec(name).labels
    for name in ray_metrics.STREAM_COUNTER_PREFIXES.values():
        assert spec(name).kind == "counter" and set(spec(name).labels) == {"stream", "reason"}
    for name in ray_metrics.STREAM_GAUGES.values():
        assert spec(name).kind == "gauge" and "stream" in spec(name).labels
    for name in ray_metrics.ACTOR_COUNTERS.values():
        assert spec(name).kind == "counter" and spec(name).labels == ("actor",)


def test_a_record_with_the_wrong_labels_is_refused(
    recorded: tuple[ray_metrics.CatalogInstruments, Records],
) -> None:
    instruments, _ = recorded
    with pytest.raises(ValueError, match="takes labels"):
        instruments.inc("babelcast_rollovers_total", 1, stream="a")
    with pytest.raises(KeyError, match=r"not in orchestrator/metric_catalog\.py"):
        instruments.inc("babelcast_no_such_total", 1)


def test_a_zero_increment_creates_the_counter_series_at_zero(
    recorded: tuple[ray_metrics.CatalogInstruments, Records],
) -> None:
    instruments, records = recorded
    asr = ray_metrics.RayMetricsSink("asr-0", instruments)
    asr.stream_update("room-a", {"gaps": 0.0, "rollovers_rut": 0.0}, {})
    assert sorted((n, op, v) for n, op, v, _ in records) == [
        ("babelcast_audio_gaps_total", "inc", 0.0), ("babelcast_rollovers_total", "inc", 0.0)]
