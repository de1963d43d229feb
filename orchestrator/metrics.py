"""Prometheus instruments of the gateway and orchestrator process.

Built from `orchestrator.metric_catalog` (names, help texts, labels, buckets), so
what `/metrics` serves is exactly what the catalog, the dashboards and the alert
rules say. Actor-side metrics are not here: the runtime's Ray sinks make them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from orchestrator.metric_catalog import spec

# No `<name>_created` series next to each counter and histogram: nothing reads them,
# and every series name on /metrics is then one the catalog lists.
disable_created_metrics()  # type: ignore[no-untyped-call]


def _make(name: str) -> Any:
    m = spec(name)
    assert m.source == "gateway", f"{name} is exported by the actors, not the gateway"
    if m.kind == "counter":
        # prometheus_client appends `_total` to a counter's name itself.
        return Counter(m.name.removesuffix("_total"), m.help, list(m.labels))
    if m.kind == "gauge":
        return Gauge(m.name, m.help, list(m.labels))
    return Histogram(m.name, m.help, list(m.labels), buckets=m.buckets)


GATEWAY_CLIENTS: Gauge = _make("babelcast_gateway_clients")
GATEWAY_MESSAGES: Counter = _make("babelcast_gateway_messages_total")
GATEWAY_SLOW_DROPS: Counter = _make("babelcast_gateway_slow_client_drops_total")
GATEWAY_CAPTION_DELIVERY: Histogram = _make("babelcast_gateway_caption_delivery_seconds")
PUSH_FRAMES: Counter = _make("babelcast_push_audio_frames_total")
PUSH_BAD_FRAMES: Counter = _make("babelcast_push_bad_frames_total")
REDIS_ERRORS: Counter = _make("babelcast_redis_errors_total")
REDIS_RESTARTS: Counter = _make("babelcast_redis_restarts_total")
GATEWAY_REFUSALS: Counter = _make("babelcast_gateway_refusals_total")
UNDECODABLE: Counter = _make("babelcast_undecodable_messages_total")
GATEWAY_WORKERS: Gauge = _make("babelcast_gateway_workers")
GATEWAY_WORKERS_SCRAPED: Gauge = _make("babelcast_gateway_workers_scraped")
STREAMS_PLACED: Gauge = _make("babelcast_streams_placed")
STREAMS_BUDGET: Gauge = _make("babelcast_streams_budget")
STREAMS_UNPLACED: Gauge = _make("babelcast_streams_unplaced")
STREAM_UNPLACED: Gauge = _make("babelcast_stream_unplaced")
ACTOR_UP: Gauge = _make("babelcast_actor_up")
STREAM_READDS: Counter = _make("babelcast_stream_readds_total")
STREAM_MOVES: Counter = _make("babelcast_stream_moves_total")
ENGINE_REPLACEMENTS: Counter = _make("babelcast_engine_replacements_total")
LEASE_LAPSES: Counter = _make("babelcast_asr_lease_lapses_total")
ARCHIVE_CUES: Counter = _make("babelcast_archive_cues_total")
YOUTUBE_POSTS: Counter = _make("babelcast_youtube_posts_total")
YOUTUBE_BACKLOG: Gauge = _make("babelcast_youtube_backlog_finals")
OUTPUT_ERRORS: Counter = _make("babelcast_output_errors_total")

# Every series a panel or an alert reads exists from the start, at 0: one that first
# appears at its first event reads "No data" and a rate() alert misses that increment.
# Labels with a fixed set of values are made here; those labelled by stream when the
# gateway learns its streams (`zero_stream_series`).
for _component in ("gateway", "outputs"):
    REDIS_ERRORS.labels(component=_component)
    UNDECODABLE.labels(component=_component)
for _output in ("archive", "youtube", "runner"):
    OUTPUT_ERRORS.labels(output=_output)


def zero_stream_series(stream: str, langs: Iterable[str], *, push: bool = False) -> None:
    """The gateway's per-stream series of `stream`, at 0 (clients, messages, delivery;
    push frames for a push stream)."""
    for lang in langs:
        GATEWAY_CLIENTS.labels(stream=stream, lang=lang)
        GATEWAY_MESSAGES.labels(stream=stream, lang=lang)
    for kind in ("partial", "final"):
        GATEWAY_CAPTION_DELIVERY.labels(stream=stream, kind=kind)
    if push:
        PUSH_FRAMES.labels(stream=stream)
        PUSH_BAD_FRAMES.labels(stream=stream)
