"""How far ahead of real time one stream may get inside an ASR actor.

An ASR actor decodes all its streams in one process, so a stream that hands it audio
faster than real time (a publisher's burst, a backlog replayed) takes decode time from
its neighbours. Each stream gets a bucket of `max_backlog_s` audio seconds refilled at
real time; audio beyond it is skipped and counted, and the session sees the skip as a
gap. The gateway's pacing (1.5 × real time with a 10 s burst) keeps a well-behaved
publisher inside this bound; it is the last line for whatever gets past it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from workers.events import SAMPLE_RATE, AudioChunk

log = logging.getLogger(__name__)


class BacklogGuard:
    def __init__(self, max_backlog_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_backlog_s = max_backlog_s
        self._clock = clock
        self._tokens: dict[str, float] = {}
        self._at: dict[str, float] = {}
        self.skipped_s: dict[str, float] = {}

    def admit(self, stream: str, chunk: AudioChunk) -> bool:
        now = self._clock()
        tokens = self._tokens.get(stream, self.max_backlog_s)
        tokens = min(self.max_backlog_s, tokens + (now - self._at.get(stream, now)))
        self._at[stream] = now
        need = chunk.samples / SAMPLE_RATE
        if need > tokens:
            if stream not in self.skipped_s:
                log.warning("stream %s: more than %.0f s of audio ahead of real time; "
                            "skipping audio until it is back within bounds", stream,
                            self.max_backlog_s)
            self.skipped_s[stream] = self.skipped_s.get(stream, 0.0) + need
            self._tokens[stream] = tokens
            return False
        self._tokens[stream] = tokens - need
        return True
