"""Every metric Babelcast exports: name, type, help text, labels and where it comes from.

The single source of truth: `orchestrator.metrics` builds the gateway's
`prometheus_client` instruments from it, the runtime's Ray sinks build their
`ray.util.metrics` instruments from it, and the dashboard and alert tests check
every query against it.

Names follow `babelcast_<thing>_<unit>`, counters end in `_total`, labels are
bounded (see `LABELS`). Two sources:

- `gateway`: the `babelcast run` process (gateway and orchestrator), exported by
  `prometheus_client` on the gateway's `/metrics` under the name given here, summed
  over the gateway's worker processes (`orchestrator.gateway.metrics_merge`).
- `ray`: actors (ASR, ingest, translators) through `ray.util.metrics`; each node's
  Ray metrics agent exports them with Ray's namespace prefix, so Prometheus stores
  `ray_babelcast_...` (see `MetricSpec.exposed`) with Ray's own labels added
  (`RAY_ADDED_LABELS`). Their help texts must be ASCII: Ray fails to create an
  actor whose metric description is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Source = Literal["gateway", "ray"]

RAY_PREFIX = "ray_"
"""Ray's metrics agent exports custom metrics under its namespace: `ray_<name>`
(ray/_private/telemetry/open_telemetry_metric_recorder.py, NAMESPACE)."""

RAY_ADDED_LABELS = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId")
"""Labels Ray's exporter puts on every actor-side series."""

TARGET_LABELS = ("instance", "job")
"""Labels Prometheus adds to every scraped series."""

LABELS: dict[str, str] = {
    "stream": "stream id from the event file",
    "lang": "language code of a stream or one of its targets",
    "actor": "actor id: asr-N, ingest-N, translator-N",
    "role": "what an actor does: asr, ingest, translator",
    "kind": "partial or final (captions); source or prompt (translation characters)",
    "reason": "rollover reason (budget, rut, engine_error, gap, shed) or gap reason "
              "(late, source-error, source-crash, ingest-restart; what a source said: "
              "rtmp-waiting, rtmp-disconnect, rtmp-takeover, srt-waiting, srt-disconnect, "
              "hls-missing, hls-stalled, hls-skipped, hls-restart, hls-discontinuity, "
              "hls-bad-segment) or why audio was skipped (replacement, queue_full, shed)",
    "backend": "translation backend name (bergamot, apertium, openai-chat, vllm, none)",
    "state": "translation job state: waiting (not yet read) or pending (being worked on)",
    "component": "process part that saw the error: gateway",
    "output": "caption output: archive, youtube, runner",
    "result": "YouTube POST result: ok, retried, rejected, expired, dropped",
    "refusal": "why the gateway refused or closed a client: unauthorized, forbidden, origin, "
               "rate, size, cap, slow_client, precommit, unavailable",
}
"""Every label any metric may carry, with the bounded set of values it takes."""

LATENCY_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 30.0)
LAG_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    source: Source
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> str:
        """The name Prometheus stores (and dashboards and alerts query)."""
        return RAY_PREFIX + self.name if self.source == "ray" else self.name

    @property
    def series(self) -> tuple[str, ...]:
        """Exposed series names: a histogram's `_bucket`, `_count` and `_sum`."""
        if self.kind == "histogram":
            return tuple(f"{self.exposed}{s}" for s in ("_bucket", "_count", "_sum"))
        return (self.exposed,)


def _ray(name: str, kind: Kind, help: str, *labels: str,
         buckets: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, "ray", buckets)


def _gw(name: str, kind: Kind, help: str, *labels: str,
        buckets: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, "gateway", buckets)


CATALOG: tuple[MetricSpec, ...] = (
    # ---- ASR actors (workers/asr/ through the runtime's RayMetricsSink) ----
    _ray("babelcast_caption_latency_seconds", "histogram",
         "Speech to caption: capture time of a caption's last word to its publication "
         "(kind: partial or final)", "stream", "kind", buckets=LATENCY_BUCKETS),
    _ray("babelcast_captions_published_total", "counter",
         "Captions the ASR actors published in the stream's own language", "stream", "kind"),
    _ray("babelcast_last_caption_timestamp_seconds", "gauge",
         "Unix time of the stream's last published caption with text", "stream"),
    _ray("babelcast_speech_without_caption_seconds", "gauge",
         "Seconds of detected speech since the stream's last caption (grows while a room "
         "speaks and nothing is captioned)", "stream"),
    _ray("babelcast_voiced_without_text_seconds", "gauge",
         "Speech seconds since the stream's current engine session last emitted text "
         "(the rut watchdog's view; resets on rollover)", "stream"),
    _ray("babelcast_caption_lag_seconds", "gauge",
         "How far behind real time the stream's captions are: audio seconds from the "
         "oldest speech fed to its session and not yet recognised to the newest audio "
         "(0 while it keeps up)", "stream"),
    _ray("babelcast_audio_skipped_seconds_total", "counter",
         "Seconds of speech never captioned because a policy skipped them (reason: "
         "replacement, a stuck session's audio older than the replay ring or stuck twice; "
         "queue_full, a session's input queue overflowed; shed, skipped to the live edge)",
         "stream", "reason"),
    _ray("babelcast_rollovers_total", "counter",
         "Engine session rollovers by reason (budget, rut, engine_error, gap, shed)",
         "stream", "reason"),
    _ray("babelcast_rut_recoveries_total", "counter",
         "Stuck sessions that captioned again after a rut rollover", "stream"),
    _ray("babelcast_audio_gaps_total", "counter",
         "Holes in a stream's audio seen by its session manager", "stream"),
    _ray("babelcast_audio_gap_fill_seconds_total", "counter",
         "Seconds of dithered noise fed for stalled or missing audio", "stream"),
    _ray("babelcast_audio_stalls_total", "counter",
         "Times the stream's source went silent past the stall threshold (filler began)",
         "stream"),
    _ray("babelcast_late_audio_dropped_seconds_total", "counter",
         "Seconds of real audio thrown away because they came after filler had taken "
         "their time (should stay 0: the stall threshold learns the transport)", "stream"),
    _ray("babelcast_source_silent_seconds", "gauge",
         "Seconds the stream has been fed only filler (0 while real audio flows): above 0 "
         "the room's source is lost", "stream"),
    _ray("babelcast_stall_threshold_seconds", "gauge",
         "The stream's current stall threshold, learned from how its transport delivers",
         "stream"),
    _ray("babelcast_session_errors_total", "counter",
         "Stream sessions that failed and were reopened by the ASR host", "stream"),
    _ray("babelcast_asr_audio_seconds_total", "counter",
         "Seconds of audio handed to the stream's engine session", "stream", "actor"),
    _ray("babelcast_asr_stream_active", "gauge",
         "1 while the stream runs on this ASR actor", "stream", "actor"),
    _ray("babelcast_engine_busy_seconds_total", "counter",
         "Seconds the actor's engine spent decoding (engines that measure it: embedded); "
         "rate() is the engine's load, 1 = saturated", "actor"),
    _ray("babelcast_engine_steps_total", "counter",
         "Decode steps the actor's engine ran (busy seconds / steps = step time)", "actor"),
    _ray("babelcast_engine_healthy", "gauge",
         "1 while the actor's engine can serve sessions, 0 once it is dead (the "
         "supervisor then replaces the actor)", "actor"),
    _ray("babelcast_engine_reanchoring", "gauge",
         "vllm engine mode: 1 = sessions re-anchor (never roll over for length), "
         "0 = warm rollovers before max_model_len", "actor"),
    _ray("babelcast_engine_reanchors_total", "counter",
         "Session re-anchors the actor's vllm engine applied (positions lowered, cached "
         "keys re-rotated)", "actor"),
    _ray("babelcast_engine_reanchor_rotation_failures_total", "counter",
         "Re-anchors whose rotation of a session's cached keys raised in the actor's vllm "
         "engine core; each ended its request and the session was replaced (alert "
         "AsrReanchorRotationFailed)", "actor"),
    # ---- ingest actors (workers/ingest.py) ----
    _ray("babelcast_source_audio_seconds_total", "counter",
         "Seconds of audio decoded from the stream's source and written to Redis", "stream"),
    _ray("babelcast_source_reconnects_total", "counter",
         "Source reconnect attempts after a source error or crash", "stream"),
    _ray("babelcast_source_gaps_total", "counter",
         "Holes in a source's audio recorded by ingest, by reason", "stream", "reason"),
    _ray("babelcast_source_refused_total", "counter",
         "Encoders a listener turned away (wrong stream key or passphrase, wrong application, "
         "unsupported codec)", "stream"),
    # ---- translator actors (translation/host.py through RayTranslationMetrics) ----
    _ray("babelcast_translation_lag_seconds", "histogram",
         "Source final published to its translation published", "stream", "lang", "backend",
         buckets=LAG_BUCKETS),
    _ray("babelcast_translations_total", "counter",
         "Translated captions published (kind: final, or partial for the live tail)",
         "stream", "lang", "backend", "kind"),
    _ray("babelcast_translation_errors_total", "counter",
         "Translations published with an error marker (the backend failed or timed out)",
         "stream", "lang", "backend"),
    _ray("babelcast_translation_queue_jobs", "gauge",
         "Translation jobs waiting (not yet read) or pending (read, not yet done)", "state"),
    _ray("babelcast_translation_queue_oldest_age_seconds", "gauge",
         "Age of the oldest translation job not yet done"),
    _ray("babelcast_translation_chars_total", "counter",
         "Characters handed to translation backends: source (what metered APIs bill) and "
         "prompt (sent, context and instructions included)", "backend", "kind"),
    _ray("babelcast_translation_requests_total", "counter",
         "Sentences sent to each translation backend", "backend"),
    # ---- gateway (orchestrator/gateway) ----
    _gw("babelcast_gateway_clients", "gauge",
        "Caption WebSocket clients connected", "stream", "lang"),
    _gw("babelcast_gateway_messages_total", "counter",
        "Caption messages sent to clients", "stream", "lang"),
    _gw("babelcast_gateway_slow_client_drops_total", "counter",
        "Interim captions dropped because a client read too slowly (finals are never "
        "dropped)"),
    _gw("babelcast_gateway_caption_delivery_seconds", "histogram",
        "Audio end of a caption (capture time) to its send by the gateway", "stream", "kind",
        buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 20)),
    _gw("babelcast_push_audio_frames_total", "counter",
        "PCM16 frames received on push WebSockets", "stream"),
    _gw("babelcast_push_bad_frames_total", "counter",
        "Push frames rejected (odd length, wrong type)", "stream"),
    _gw("babelcast_redis_errors_total", "counter", "Redis operations that failed", "component"),
    _gw("babelcast_redis_restarts_total", "counter",
        "Times the local redis-server child died and was started again"),
    _gw("babelcast_gateway_refusals_total", "counter",
        "Requests and WebSockets the gateway refused or closed, by why", "refusal"),
    _gw("babelcast_undecodable_messages_total", "counter",
        "Bus messages skipped as undecodable", "component"),
    _gw("babelcast_gateway_workers", "gauge",
        "Gateway processes that serve the port (gateway.workers)"),
    _gw("babelcast_gateway_workers_scraped", "gauge",
        "Gateway processes whose figures this scrape holds; below babelcast_gateway_workers "
        "while one restarts or did not answer in time (its counters stay at their last "
        "values, its gauges are left out)"),
    # ---- orchestrator (orchestrator/runtime.py) ----
    _gw("babelcast_streams_placed", "gauge", "Streams pinned to each ASR actor", "actor"),
    _gw("babelcast_streams_budget", "gauge",
        "Streams each ASR actor may take (engine.streams_per_actor)", "actor"),
    _gw("babelcast_streams_unplaced", "gauge", "Streams no ASR actor could take"),
    _gw("babelcast_stream_unplaced", "gauge",
        "1 for a stream no ASR actor could take, 0 once placed", "stream"),
    _gw("babelcast_actor_up", "gauge",
        "1 when the actor answered the supervisor's last check, 0 when it did not",
        "actor", "role"),
    _gw("babelcast_stream_readds_total", "counter",
        "Streams the supervisor added again to an actor that had lost them (it restarted)",
        "actor"),
    _gw("babelcast_stream_moves_total", "counter",
        "Streams the supervisor moved to this actor from one out of reach for "
        "engine.failover_after_s (or dead for good), or from one whose captions stayed "
        "behind real time (engine.move_after_lag_s)", "actor"),
    _gw("babelcast_engine_replacements_total", "counter",
        "ASR actors the supervisor replaced because their engine was dead", "actor"),
    _gw("babelcast_asr_lease_lapses_total", "counter",
        "ASR actors whose lease in Redis lapsed (node lost or frozen, process gone, engine "
        "dead): their streams moved at once (engine.lease_ttl_s)", "actor"),
    # ---- outputs (orchestrator/outputs) ----
    _gw("babelcast_archive_cues_total", "counter",
        "Cues appended to WebVTT/SRT archives", "stream", "lang"),
    _gw("babelcast_youtube_posts_total", "counter",
        "YouTube caption POSTs by result (ok, retried, rejected, expired; dropped: finals "
        "dropped from a full backlog)", "stream", "lang", "result"),
    _gw("babelcast_youtube_backlog_finals", "gauge",
        "Finals waiting to be posted to YouTube", "stream", "lang"),
    _gw("babelcast_output_errors_total", "counter",
        "Failures of the caption outputs (archive, youtube, runner)", "output"),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}
BY_EXPOSED: dict[str, MetricSpec] = {m.exposed: m for m in CATALOG}


def spec(name: str) -> MetricSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in orchestrator/metric_catalog.py") from None


def series_labels(exposed_series: str) -> tuple[MetricSpec, tuple[str, ...]] | None:
    """The metric behind an exposed series name and the labels that series may carry
    (its own, `le` on buckets, Ray's on actor-side series, Prometheus' target labels);
    None for a name outside the catalog."""
    for m in CATALOG:
        if exposed_series in m.series:
            extra = ("le",) if exposed_series.endswith("_bucket") else ()
            ray = RAY_ADDED_LABELS if m.source == "ray" else ()
            return m, (*m.labels, *extra, *ray, *TARGET_LABELS)
    return None
