"""The early final pass (`final_early_s`, issue 37): the final decode starts before the
pause that ends the utterance is whole, so the decode time overlaps the rest of the pause.

Whisper tiny.en on the reference utterances, fed in lock step (`test_embedded_context.play`):
what the session decides does not depend on how busy the host is. The latency it saves is
measured in `bench.e2e` / `bench.peer` (real time), not here.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16
from tests.test_embedded_context import Played, _split_point, opts, play, talk
from workers.engines.vad import FRAME_SAMPLES
from workers.events import SAMPLE_RATE

pytestmark = pytest.mark.integration

EARLY_S = 0.3


def finals_text(played: Played) -> list[str]:
    return ["".join(w.text for w in d.committed) for d in played.deltas if d.end_of_utterance]


def final_ends(played: Played) -> list[float]:
    return [d.offset_s + d.seconds for d in played.finals]


def test_finals_start_early_and_say_what_the_whole_pause_would() -> None:
    async def both() -> tuple[Played, Played]:
        pcm = talk()
        return await play(opts(final_early_s=0), pcm), await play(opts(final_early_s=EARLY_S),
                                                                   pcm)

    plain, early = asyncio.run(both())
    assert opts().final_early_s == EARLY_S, "the default"
    # The same words on this talk (their times may move by a few of Whisper's 20 ms
    # steps: it read less silence after them). Not so on every talk: with less silence
    # after it Whisper may write a word otherwise ("coldhearted" / "cold-hearted", seen
    # in the test below); bench.accuracy measures what that does to WER.
    assert finals_text(early) == finals_text(plain)
    assert len(early.finals) == len(plain.finals) >= 4
    # Each final pass read the utterance up to EARLY_S (to a Silero frame) before the
    # point where the plain one did: the rest of the pause, which it did not wait for.
    for a, b in zip(final_ends(plain), final_ends(early), strict=True):
        assert a - b == pytest.approx(EARLY_S, abs=FRAME_SAMPLES / SAMPLE_RATE)
    stats = early.engine.stats()
    assert stats["final_early_used"] == len(plain.finals)
    assert plain.engine.stats()["final_early_used"] == 0


def test_speech_that_comes_back_before_the_pause_is_whole_drops_the_early_pass() -> None:
    """0.42 s of silence put between two words of one sentence (with the words' own gap,
    past `pause_s - final_early_s`, short of `pause_s`): the early pass starts, speech comes
    back, the pass is dropped and the utterance runs on, so one final holds the words on
    both sides, as without the lever."""
    first = decode_pcm16(AUDIO / f"{REFERENCE_FILES[0]}.flac")
    cut = _split_point(first)
    lead, gap = bytes(2 * SAMPLE_RATE), bytes(2 * SAMPLE_RATE)
    pcm = lead + first[: cut * 2] + bytes(2 * int(0.42 * SAMPLE_RATE)) + first[cut * 2 :] + gap
    at_s = (len(lead) // 2 + cut) / SAMPLE_RATE

    async def both() -> tuple[Played, Played]:
        return await play(opts(final_early_s=0), pcm), await play(opts(final_early_s=EARLY_S),
                                                                   pcm)

    plain, early = asyncio.run(both())

    def across(played: Played) -> bool:
        return any(d.end_of_utterance and d.committed and d.committed[0].end_s < at_s
                   < d.committed[-1].start_s for d in played.deltas)

    assert across(plain), "the control: this pause does not end the utterance"
    assert across(early), "the early pass was committed though speech came back"
    stats = early.engine.stats()
    assert stats["final_early_dropped"] >= 1, "the pause was too short to start one"
