"""The rut watchdog: tells a stuck session from a slow one.

Fed with voice-activity frames and with the text an engine session emits, both
stamped with the stream's audio position, and with how far the session's
recognition has got (`heard`: the stream position its decoding has reached).

A session is **stuck** when
- it heard speech and wrote (almost) no text: some suffix of the recent past
  (`window_s`) holds at least `speech_s` seconds of speech the session has heard and
  fewer than `chars_per_speech_s` characters of text per speech second (`in_rut`).
  Suffixes, so text from before the rut does not hide it for a whole window; silence
  has no speech seconds, so a quiet room never triggers it; or
- it stopped hearing: `max_lag_s` seconds of speech were fed to it while its
  recognition did not move on at all (`deaf`).

A session that is merely **slow** (a busy engine: its input backlog grows, its
output keeps coming) is neither: only speech it has heard is judged, however far
behind the newest audio that is, and its recognition keeps moving. Judging the
unheard backlog replaced healthy sessions under load and lost their words (issue 36:
a room 30 s behind lost 10 s of speech at each replacement, because the lag alone
made it count as stuck; earlier, on a 2-core host with six sessions, the first
utterance of each).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import islice

from workers.events import SAMPLE_RATE

BACKLOG_S = 65.0
"""Audio a session may hold behind the newest (its input queue: ~60 s), and so what the
watchdog keeps and what a replacement can re-read (`SessionManager`'s ring)."""


@dataclass(frozen=True, slots=True)
class RutPolicy:
    window_s: float = 15.0
    speech_s: float = 6.0
    chars_per_speech_s: float = 1.0
    max_lag_s: float = 30.0
    """Speech seconds fed to a session whose recognition does not move on at all: then it
    has stopped hearing. Not a bound on lag: a slow session moves on, however late."""


class RutWatchdog:
    def __init__(self, policy: RutPolicy) -> None:
        self.policy = policy
        self._speech: deque[tuple[int, int]] = deque()  # (pos, samples) of speech frames
        self._ordered = True  # each frame kept starts at or after the one before ends
        self._text: deque[tuple[int, int]] = deque()  # (pos, chars)
        self._since_text = 0  # speech samples since the last text
        self.voiced_without_text_s = 0.0
        self._heard: int | None = None
        self._speech_unheard = 0  # speech samples fed since `heard` last moved on

    def speech(self, pos: int, samples: int) -> None:
        if self._speech and pos < sum(self._speech[-1]):
            self._ordered = False
        self._speech.append((pos, samples))
        self._since_text += samples
        self._speech_unheard += samples
        self.voiced_without_text_s = self._since_text / SAMPLE_RATE
        self._trim(pos)

    def text(self, pos: int, chars: int) -> None:
        if chars <= 0:
            return
        self._text.append((pos, chars))
        self._since_text = 0
        self.voiced_without_text_s = 0.0

    def reset(self) -> None:
        self._speech.clear()
        self._ordered = True
        self._text.clear()
        self._since_text = 0
        self.voiced_without_text_s = 0.0
        self._heard = None
        self._speech_unheard = 0

    def speech_between(self, start: int, end: int) -> float:
        """Seconds of speech fed in stream positions [start, end) (as far as kept)."""
        n = sum(min(pos + k, end) - max(pos, start) for pos, k in self._speech
                if pos < end and pos + k > start)
        return n / SAMPLE_RATE

    def deaf(self, heard: int | None) -> bool:
        """Whether the session stopped hearing: `max_lag_s` of speech fed to it since its
        recognition last moved on (`heard` grows with every decode step of a session that
        works, however slowly). None: the session does not say; never deaf then."""
        if heard is None:
            return False
        if self._heard is None or heard > self._heard:
            self._heard = heard
            self._speech_unheard = 0
            return False
        return self._speech_unheard >= self.policy.max_lag_s * SAMPLE_RATE

    def _trim(self, now: int) -> None:
        # Speech heard long after it was fed is judged then: keep as much as the input
        # queue of a session can hold behind the newest audio (INPUT_QUEUE_MAX, ~60 s).
        start = now - int((self.policy.window_s + BACKLOG_S) * SAMPLE_RATE)
        while self._speech and self._speech[0][0] < start:
            self._speech.popleft()
        if not self._speech:
            self._ordered = True
        while self._text and self._text[0][0] < start:
            self._text.popleft()

    def in_rut(self, heard: int | None = None) -> bool:
        """`heard`: the stream position the session's recognition has reached (None: all
        the speech fed is judged). Speech not heard yet is never judged, however long
        it has waited: that is a slow session, not a stuck one (see `deaf`).

        Called for every chunk of every stream, so it walks no further than it must: it
        starts at the newest heard frame (frames past `heard` are skipped in C, not
        judged), and it stops once the suffix holds so much text that no longer suffix of
        the window can be short of it. A suffix has at most `window_s` seconds of speech,
        so `chars_per_speech_s * window_s` characters settle it; a room whose session
        writes stops after a second or two of frames instead of walking the whole window
        (the walk was a quarter of the vllm front end's own CPU per chunk at 25 streams).
        Frames fed out of order (never, from the manager) are walked in full as before."""
        frames = self._speech
        if not frames:
            return False
        p = self.policy
        last_pos, last_samples = frames[-1]
        newest = last_pos + last_samples  # the end of the newest speech frame
        horizon = newest if heard is None else min(newest, heard)
        start = horizon - int(p.window_s * SAMPLE_RATE)
        need = p.speech_s * SAMPLE_RATE
        rate = p.chars_per_speech_s
        # No suffix has more than window_s of speech (the frames do not overlap), so
        # with this much text none can be short of it; +1: integer chars, float rate.
        settled = rate * p.window_s + 1 if self._ordered else float("inf")
        walk = reversed(frames)
        if self._ordered and horizon < newest:
            # the frames that end past `heard` are the newest ones (ends ascend)
            heard_frames = bisect_right(frames, horizon, key=lambda f: f[0] + f[1])
            walk = islice(walk, len(frames) - heard_frames, None)
        speech = 0
        chars = 0
        texts = reversed(self._text)
        text = next(texts, None)
        # Walk back from the newest heard speech frame, growing the suffix.
        for pos, samples in walk:
            if pos + samples > horizon:
                continue
            if pos < start:
                break
            speech += samples
            while text is not None and text[0] >= pos:
                chars += text[1]
                text = next(texts, None)
            if speech >= need and chars < rate * speech / SAMPLE_RATE:
                return True
            if chars >= settled:
                return False
        return False

