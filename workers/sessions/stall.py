"""When a source counts as stalled: a threshold that learns how its transport delivers.

Live transports do not deliver audio evenly. MPEG-TS over SRT from ffmpeg 5.1
arrives in bursts ~0.39 s apart (measured here, 20 s of speech: 200 chunks,
median gap 16 ms, the five longest 0.38-0.39 s); an HLS source gets a segment
at a time; RTMP over a congested link comes in TCP bursts. With a fixed 0.2 s
threshold, 60 s of SRT speech gave 157 "stalls", 15.7 s of filler and 6.6 s of
real audio thrown away (issue 14). A gap between deliveries is a stall only
when it is longer than what this transport normally does:

    threshold = clamp(factor × longest gap of the last `window_s` + pad_s, floor_s, cap_s)

- `floor_s` is the threshold before anything is learned, and never less: it
  must cover the usual burst (MPEG-TS: ~0.4 s) so the first minute is safe too.
- Every gap up to `cap_s` is learned, also one that was taken for a stall: a
  source that was slow, not gone, must not be taken for gone again. Longer gaps
  are outages (an encoder down for 20 s) and teach nothing.
- The window forgets: a transport that turns smooth again gets the floor back
  after `window_s`.

Ingest (its audio clock) and the ASR side (the session manager's filler) both
keep one, with the same rule; the ASR side's has `pad_s` more, so a pause that
makes the ASR side fill noise has always moved ingest's clock past that noise
first, and real audio never lands on time already filled.
"""

from __future__ import annotations

from collections import deque


class StallThreshold:
    """Learns delivery gaps (`arrival`) and says how long a silence must be to be a stall."""

    def __init__(self, floor_s: float = 1.0, cap_s: float = 3.0, *, pad_s: float = 0.0,
                 factor: float = 1.5, window_s: float = 60.0) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor_s <= cap_s, got {floor_s} and {cap_s}")
        self.floor_s = floor_s
        self.cap_s = cap_s
        self.pad_s = pad_s
        self.factor = factor
        self.window_s = window_s
        self._last: float | None = None
        # (arrival time, gap) with gaps decreasing from left to right: the left end is
        # the longest gap of the window (a monotonic queue: O(1) per arrival).
        self._gaps: deque[tuple[float, float]] = deque()
        self.longest_gap_s = 0.0
        """The longest gap ever learned (for status and benchmarks)."""

    def arrival(self, now: float) -> float:
        """Audio arrived at `now`; returns the gap since the previous arrival (0 for the first)."""
        gap = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now
        if gap <= self.cap_s:
            while self._gaps and self._gaps[-1][1] <= gap:
                self._gaps.pop()
            self._gaps.append((now, gap))
            self.longest_gap_s = max(self.longest_gap_s, gap)
        return gap

    def threshold_s(self, now: float) -> float:
        """Silence longer than this (since the last arrival) is a stall."""
        while self._gaps and self._gaps[0][0] < now - self.window_s:
            self._gaps.popleft()
        learned = self._gaps[0][1] if self._gaps else 0.0
        return min(self.cap_s, max(self.floor_s, self.factor * learned + self.pad_s))

    def silent_s(self, now: float) -> float:
        """Seconds since the last arrival (0 before the first)."""
        return 0.0 if self._last is None else max(0.0, now - self._last)


INGEST_MARGIN_S = 0.25
"""How much sooner ingest's clock moves than the ASR side fills (see the module doc)."""


def ingest_threshold(asr_floor_s: float = 1.0, asr_cap_s: float = 3.0) -> StallThreshold:
    """Ingest's threshold for an ASR side with these settings: `INGEST_MARGIN_S` lower."""
    floor = max(0.05, asr_floor_s - INGEST_MARGIN_S)
    return StallThreshold(floor, max(floor, asr_cap_s - INGEST_MARGIN_S))


def asr_threshold(floor_s: float = 1.0, cap_s: float = 3.0) -> StallThreshold:
    """The session manager's threshold; its pad keeps it `INGEST_MARGIN_S` above ingest's."""
    return StallThreshold(floor_s, max(floor_s, cap_s), pad_s=INGEST_MARGIN_S)
