"""How far behind a stream's captions are: the session manager's `caption_lag_s` gauge.

The audio seconds from the oldest speech the current session has been fed but not yet
heard to the newest audio: 0 for a session that keeps up (or a silent room, which has
nothing to caption), growing by a second each second for a stuck or overloaded one. The
manager (`workers.sessions.manager`) leaves the gauge out for engines that do not say how
far they have heard (the host then uses its latest caption's latency), and sheds on it
(`SessionPolicy.shed_after_s`).
"""

from __future__ import annotations

from collections import deque

from workers.engines.vad import FRAME_SAMPLES
from workers.events import SAMPLE_RATE
from workers.sessions.watchdog import BACKLOG_S


class SpeechRuns:
    """Runs of speech (start, end, stream samples) in the last `BACKLOG_S` of audio;
    unlike the watchdog's, kept across rollovers (a replacement re-reads them)."""

    def __init__(self) -> None:
        self._runs: deque[list[int]] = deque()

    def add(self, frame_pos: int) -> None:
        """The VAD frame that starts at `frame_pos` is speech."""
        runs = self._runs
        if runs and runs[-1][1] == frame_pos:
            runs[-1][1] = frame_pos + FRAME_SAMPLES
        else:
            runs.append([frame_pos, frame_pos + FRAME_SAMPLES])

    def forget(self, newest: int) -> None:
        """Drop the runs that ended more than `BACKLOG_S` before `newest`."""
        oldest = newest - int(BACKLOG_S * SAMPLE_RATE)
        while self._runs and self._runs[0][1] < oldest:
            self._runs.popleft()

    def lag_s(self, heard: int, newest: int) -> float:
        """Seconds from the oldest speech not heard by `heard` to `newest`."""
        unheard = next((max(a, heard) for a, b in self._runs if b > heard), None)
        return 0.0 if unheard is None else max(0, newest - unheard) / SAMPLE_RATE
