"""Bounds on what one client may take: audio pace, sockets per address and per stream,
one publisher per push stream.

Pushed audio is paced against the wall clock with a token bucket: it refills at
`rate` audio seconds per second (1.5 × real time by default) and holds `burst_s` audio
seconds, so a publisher that reconnects may send what it buffered during the outage at
once, while a client that sends faster than that for more than a few seconds is cut off.
Without it one push client sent 4,855 × real time and the ASR actor shared with other
rooms fell 60 s behind on all of them.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.events import SAMPLE_RATE

BYTES_PER_S = SAMPLE_RATE * 2  # PCM16 mono


class AudioPacer:
    """Token bucket over audio seconds. `admit(nbytes)` is False once a client is past
    its allowance; `credit(s)` gives back time the gateway itself spent blocked (a Redis
    outage), so a publisher is not blamed for a backlog the gateway made."""

    def __init__(self, rate: float, burst_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst_s = burst_s
        self._clock = clock
        self._tokens = burst_s
        self._at = clock()

    def admit(self, nbytes: int) -> bool:
        now = self._clock()
        if self._tokens < self.burst_s:  # credit above the burst is kept until spent
            self._tokens = min(self.burst_s, self._tokens + (now - self._at) * self.rate)
        self._at = now
        need = nbytes / BYTES_PER_S
        if need > self._tokens:
            return False
        self._tokens -= need
        return True

    def credit(self, seconds: float) -> None:
        self._tokens += seconds * self.rate


class RateLimited(Exception):
    """A publisher past its pace: it is closed with 1008."""


class CapExceeded(Exception):
    """Past a connection cap: `code` for the error event; the socket closes with 1013."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ConnectionCaps:
    """Counts of open WebSockets: per client address, caption viewers per stream, and the
    one publisher each push stream may have. Per gateway process: with `gateway.workers:
    N` the port holds up to N times each cap (the one-publisher rule also holds across
    processes, through a lease in Redis: `publishers`)."""

    max_per_ip: int
    max_viewers_per_stream: int

    def __post_init__(self) -> None:
        self.per_ip: collections.Counter[str] = collections.Counter()
        self.viewers: collections.Counter[str] = collections.Counter()
        self.publishers: set[str] = set()

    def open_socket(self, ip: str) -> None:
        if self.per_ip[ip] >= self.max_per_ip:
            raise CapExceeded("too_many_connections",
                              f"this address holds {self.max_per_ip} WebSockets already "
                              "(gateway.limits.max_ws_per_ip); close some and retry")
        self.per_ip[ip] += 1

    def close_socket(self, ip: str) -> None:
        self.per_ip[ip] -= 1
        if self.per_ip[ip] <= 0:
            del self.per_ip[ip]

    def add_viewer(self, stream: str) -> None:
        if self.viewers[stream] >= self.max_viewers_per_stream:
            raise CapExceeded("too_many_viewers",
                              f"stream {stream!r} has {self.max_viewers_per_stream} caption "
                              "clients (gateway.limits.max_viewers_per_stream); retry later")
        self.viewers[stream] += 1

    def remove_viewer(self, stream: str) -> None:
        self.viewers[stream] -= 1
        if self.viewers[stream] <= 0:
            del self.viewers[stream]

    def claim_publisher(self, stream: str) -> None:
        if stream in self.publishers:
            raise CapExceeded("publisher_busy",
                              f"stream {stream!r} already has a publisher; one connection "
                              "pushes a stream at a time (a dropped one frees its place "
                              "within the ping timeout)")
        self.publishers.add(stream)

    def release_publisher(self, stream: str) -> None:
        self.publishers.discard(stream)
