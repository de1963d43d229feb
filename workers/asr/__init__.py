"""The ASR host: one speech engine, one session per pinned stream.

A plain class (the orchestrator's runtime wraps it in a Ray actor). One reader
task pulls audio for all pinned streams from Redis with a single blocking
XREAD and hands each item to its stream's session; one task per stream turns
the session's deltas into caption segments and publishes them. A stream whose
session fails gets a new session after a backoff, its open caption is closed,
and no other stream notices.

`host`: the host (streams added, moved and drained, the reader, health and reports);
`stream`: one stream's runner (its session, captions, cursor and translation jobs);
`options`: what the runtime tells a host.
"""

from workers.asr.host import FINISH_S, LAG_BEHIND_S, AsrHost
from workers.asr.options import AsrHostOptions
from workers.asr.stream import ZERO_AT_START, Fenced, WallMap, _StreamRunner

__all__ = [
    "FINISH_S",
    "LAG_BEHIND_S",
    "ZERO_AT_START",
    "AsrHost",
    "AsrHostOptions",
    "Fenced",
    "WallMap",
    "_StreamRunner",
]
