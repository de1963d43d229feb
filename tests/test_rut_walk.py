"""The rut watchdog's bounded walk (`RutWatchdog.in_rut`) says what the full walk says.

`in_rut` runs for every chunk of every stream. It used to walk every heard speech frame
of the window (15 s: ~470 frames) at every chunk; it now skips the frames past `heard`
by position and stops once the text it has counted settles the answer. The full walk is
kept here, unchanged, as the reference, and both are asked the same question after every
event of random streams: speech and silence, text early, late and past `heard`, sessions
ahead of, at and far behind their audio, policies of different shapes, and frames fed out
of order (which the bounded walk must notice and walk in full).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from workers.events import SAMPLE_RATE
from workers.sessions.watchdog import RutPolicy, RutWatchdog

pytestmark = pytest.mark.unit

FRAME = 512


def full_walk(w: RutWatchdog, heard: int | None) -> bool:
    """The walk as it was before it was bounded (4361bc1), over the same state."""
    if not w._speech:
        return False
    p = w.policy
    newest = sum(w._speech[-1])
    horizon = newest if heard is None else min(newest, heard)
    start = horizon - int(p.window_s * SAMPLE_RATE)
    need = p.speech_s * SAMPLE_RATE
    speech = 0
    chars = 0
    texts = list(w._text)
    ti = len(texts) - 1
    for pos, samples in reversed(w._speech):
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


POLICIES = [RutPolicy(), RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1),
            RutPolicy(window_s=4, speech_s=1.5, chars_per_speech_s=3),
            RutPolicy(window_s=30, speech_s=2, chars_per_speech_s=0.2)]


def stream(rng: random.Random, steps: int, out_of_order: bool) -> list[tuple[Any, ...]]:
    """Events of one random stream: ("speech", pos) frames, ("text", pos, chars),
    ("silence", samples) gaps and ("ask", heard) questions. The talker changes often
    between writing a lot, a little in small pieces, or nothing, so the window holds
    recent text after a long stretch without (the suffix that settles a walk early is
    not the one that finds the rut)."""
    events: list[tuple[Any, ...]] = []
    pos = 0

    def talker() -> tuple[float, int]:  # (text events per second, characters each)
        return rng.choice([0.0, 0.2, 0.6, 2.0, 12.0]), rng.choice([1, 2, 5, 12])

    rate, size = talker()
    lag = rng.choice([0, 8000, 160000, 1200000])  # how far behind the session hears
    rewound_to = None
    for _ in range(steps):
        if rng.random() < 0.01:
            rate, size = talker()
        if rng.random() < 0.1:
            gap = FRAME * rng.randint(1, 200)
            events.append(("silence", gap))
            pos += gap
        else:
            if out_of_order and rng.random() < 0.03:
                rewound_to = pos = max(0, pos - FRAME * rng.randint(1, 300))  # a rewind
            events.append(("speech", pos))
            pos += FRAME
        if rng.random() < rate * FRAME / SAMPLE_RATE:
            # text is stamped at the heard position; now and then at the newest audio
            at = pos if rng.random() < 0.2 else max(0, pos - lag - rng.randint(0, 32000))
            events.append(("text", at, rng.randint(1, size)))
        if rng.random() < 0.5:
            heard = rng.choice([None, pos, pos - lag, pos - rng.randint(0, 400000),
                                pos + 5000,
                                None if rewound_to is None else rewound_to + FRAME * 20])
            events.append(("ask", heard))
    return events


def replay(policy: RutPolicy, events: list[tuple[Any, ...]]) -> tuple[int, int]:
    """Both walks after every question; returns (questions, ruts) and fails on the first
    disagreement, naming it."""
    w = RutWatchdog(policy)
    asked = ruts = 0
    for i, event in enumerate(events):
        if event[0] == "speech":
            w.speech(event[1], FRAME)
        elif event[0] == "text":
            w.text(event[1], event[2])
        elif event[0] == "ask":
            heard = event[1]
            want = full_walk(w, heard)
            assert w.in_rut(heard) == want, (policy, i, event, len(w._speech))
            asked += 1
            ruts += want
    return asked, ruts


@pytest.mark.parametrize("out_of_order", [False, True])
def test_the_bounded_walk_answers_as_the_full_walk_does(out_of_order: bool) -> None:
    rng = random.Random(20261205 + out_of_order)
    asked = ruts = 0
    for k in range(24):
        a, r = replay(POLICIES[k % len(POLICIES)], stream(rng, 3000, out_of_order))
        asked += a
        ruts += r
    # both answers were asked for often (the comparison is not all "no rut")
    assert asked > 20000 and 0.05 < ruts / asked < 0.95, (asked, ruts)


def test_recent_text_does_not_settle_a_rut_the_window_still_holds() -> None:
    """14 s of speech with no text, then 14 characters in the last second: the suffix of
    the newest second is full of text, the whole window is not (14 characters for 15 s
    of speech). The walk may stop only past what any suffix of the window could need."""
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1))
    for k in range(int(15 * SAMPLE_RATE / FRAME)):
        w.speech(k * FRAME, FRAME)
    w.text(int(14.5 * SAMPLE_RATE), 14)
    assert full_walk(w, None)
    assert w.in_rut(None)
    w.text(int(14.6 * SAMPLE_RATE), 2)  # 16 characters for under 15 s: no rut anywhere
    assert not full_walk(w, None)
    assert not w.in_rut(None)


def test_frames_fed_out_of_order_are_walked_in_full_until_they_are_gone() -> None:
    """Overlapping frames (never from the manager) can hold more speech than the window
    is long, so the text that settles an ordered walk does not settle theirs."""
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1))
    frames = int(14.9 * SAMPLE_RATE / FRAME)
    for k in range(frames):
        w.speech(k * FRAME, FRAME)
    assert w._ordered
    for k in range(frames):  # the same 15 s again: a rewind
        w.speech(k * FRAME, FRAME)
    assert not w._ordered
    w.text(int(14.5 * SAMPLE_RATE), 17)  # 17 characters, ~30 s of (overlapping) speech
    assert full_walk(w, None)
    assert w.in_rut(None)
    w.reset()
    assert w._ordered


def test_a_talker_whose_session_writes_is_settled_after_a_few_frames() -> None:
    """The point of the bound: 15 s of speech with text throughout is judged from the
    newest frames, not the whole window (counted through the frames the walk reads)."""
    w = RutWatchdog(RutPolicy())
    read = 0

    class Counting(list):  # type: ignore[type-arg]
        def __reversed__(self) -> Any:
            nonlocal read
            for item in super().__reversed__():
                read += 1
                yield item

    for k in range(int(15 * SAMPLE_RATE / FRAME)):
        w.speech(k * FRAME, FRAME)
        if k % 3 == 0:
            w.text(k * FRAME, 4)
    assert not full_walk(w, None)
    w._speech = Counting(w._speech)  # type: ignore[assignment]
    assert not w.in_rut(None)
    assert read <= 20, read  # 16 characters settle it: 4 text events, ~12 frames
