"""Prometheus instruments of the gateway and orchestrator process.

Names follow `babelcast_<thing>_<unit>`, counters end in `_total`, and labels
are bounded (stream ids from the config, languages, component names): never
caption text or client ids.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

GATEWAY_CLIENTS = Gauge(
    "babelcast_gateway_clients", "Caption WebSocket clients connected", ["stream", "lang"]
)
GATEWAY_MESSAGES = Counter(
    "babelcast_gateway_messages_total", "Caption messages sent to clients", ["stream", "lang"]
)
GATEWAY_SLOW_DROPS = Counter(
    "babelcast_gateway_slow_client_drops_total",
    "Interim captions dropped because a client read too slowly (finals are never dropped)",
)
GATEWAY_CAPTION_DELIVERY = Histogram(
    "babelcast_gateway_caption_delivery_seconds",
    "Audio end of a caption (capture time) to its send by the gateway",
    ["stream", "final"],
    buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 20),
)
PUSH_FRAMES = Counter(
    "babelcast_push_audio_frames_total", "PCM16 frames received on push WebSockets", ["stream"]
)
PUSH_BAD_FRAMES = Counter(
    "babelcast_push_bad_frames_total", "Push frames rejected (odd length, wrong type)", ["stream"]
)
REDIS_ERRORS = Counter(
    "babelcast_redis_errors_total", "Redis operations that failed", ["component"]
)
UNDECODABLE = Counter(
    "babelcast_undecodable_messages_total", "Bus messages skipped as undecodable", ["component"]
)
STREAMS_PLACED = Gauge(
    "babelcast_streams_placed", "Streams pinned to each ASR actor", ["actor"]
)
STREAMS_UNPLACED = Gauge("babelcast_streams_unplaced", "Streams no ASR actor could take")
ARCHIVE_CUES = Counter(
    "babelcast_archive_cues_total", "Cues appended to WebVTT/SRT archives", ["stream", "lang"]
)
YOUTUBE_POSTS = Counter(
    "babelcast_youtube_posts_total",
    "YouTube caption POSTs by result (ok, retried, rejected, expired; dropped: finals "
    "dropped from a full backlog)",
    ["stream", "lang", "result"],
)
YOUTUBE_BACKLOG = Gauge(
    "babelcast_youtube_backlog_finals", "Finals waiting to be posted to YouTube",
    ["stream", "lang"],
)
OUTPUT_ERRORS = Counter(
    "babelcast_output_errors_total", "Failures of the caption outputs (archive, youtube, "
    "runner)", ["output"]
)
