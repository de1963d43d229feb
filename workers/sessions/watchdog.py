"""The rut watchdog: sustained speech with (almost) no text means a stuck session.

Fed with voice-activity frames and with the text an engine session emits, both
stamped with the stream's audio position. It looks at the recent past only
(`window_s`) and at every suffix of it: if some suffix holds at least
`speech_s` seconds of speech and fewer than `chars_per_speech_s` characters of
text per speech second, the session is in a rut. Looking at suffixes means text
from before the rut does not hide it for a whole window. Silence has no speech
seconds, so a quiet room never triggers it.

Only speech the session has heard is judged (`in_rut(heard)`: the stream position
its recognition has reached). A session behind a busy engine has not written the
text for audio it has not decoded yet; judging that audio replaced healthy sessions
under load, cancelled their final decodes and lost those words (seen on a 2-core
host: six embedded sessions, the first utterance of each gone). Past `max_lag_s`
behind the newest audio, speech is judged anyway: a session that stopped hearing
altogether is stuck too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from workers.events import SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class RutPolicy:
    window_s: float = 15.0
    speech_s: float = 6.0
    chars_per_speech_s: float = 1.0
    max_lag_s: float = 30.0


class RutWatchdog:
    def __init__(self, policy: RutPolicy) -> None:
        self.policy = policy
        self._speech: deque[tuple[int, int]] = deque()  # (pos, samples) of speech frames
        self._text: deque[tuple[int, int]] = deque()  # (pos, chars)
        self._since_text = 0  # speech samples since the last text
        self.voiced_without_text_s = 0.0

    def speech(self, pos: int, samples: int) -> None:
        self._speech.append((pos, samples))
        self._since_text += samples
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
        self._text.clear()
        self._since_text = 0
        self.voiced_without_text_s = 0.0

    def _trim(self, now: int) -> None:
        start = now - int((self.policy.window_s + self.policy.max_lag_s) * SAMPLE_RATE)
        while self._speech and self._speech[0][0] < start:
            self._speech.popleft()
        while self._text and self._text[0][0] < start:
            self._text.popleft()

    def in_rut(self, heard: int | None = None) -> bool:
        """`heard`: the stream position the session's recognition has reached (None: all
        the speech fed is judged)."""
        if not self._speech:
            return False
        p = self.policy
        newest = sum(self._speech[-1])  # the end of the newest speech frame
        horizon = newest
        if heard is not None:
            horizon = min(horizon, max(heard, newest - int(p.max_lag_s * SAMPLE_RATE)))
        start = horizon - int(p.window_s * SAMPLE_RATE)
        need = p.speech_s * SAMPLE_RATE
        speech = 0
        chars = 0
        texts = list(self._text)
        ti = len(texts) - 1
        # Walk back from the newest heard speech frame, growing the suffix.
        for pos, samples in reversed(self._speech):
            if pos + samples > horizon:
                continue
            if pos < start:
                break
            speech += samples
            while ti >= 0 and texts[ti][0] >= pos:
                chars += texts[ti][1]
                ti -= 1
            if speech >= need and chars < p.chars_per_speech_s * speech / SAMPLE_RATE:
                return True
        return False
