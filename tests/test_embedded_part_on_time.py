"""`part_on_time` (issue 37): a sentence end inside running speech is finalised as soon as
the audio is `part_edge_s` past it, not at the interim step after that.

Whisper tiny.en on the held-out sonnet (a sentence ends inside its running speech), fed in
lock step and logged with how much audio had been pushed when each commit came out, so
the lag is in audio seconds and does not depend on how busy the host is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.speech import heldout_talks
from tests.test_embedded_context import CHUNK, opts, play
from workers.events import SAMPLE_RATE, TranscriptDelta

pytestmark = pytest.mark.integration

EDGE = 1.0
"""The edge this tests the timing at. English's default is 0.75 s (`PART_EDGE_S`); at 0.75 s
no part is taken on this sonnet in lock step (seen: the sentence is final at the pause
instead), so there would be nothing to time."""

Commits = list[tuple[float, TranscriptDelta]]
"""(audio pushed when it came out, s; the delta), for every delta that commits words."""


async def commits(pcm: bytes, **kw: Any) -> Commits:
    played = await play(opts(**kw), pcm)
    return [(at, d) for at, d in zip(played.pushed_s, played.deltas, strict=True)
            if d.committed]


def part_lags(logged: Commits) -> list[float]:
    """For each part (a commit that is not an utterance's end): audio pushed when it came
    out, minus the end of its last word."""
    return [at - d.committed[-1].end_s for at, d in logged if not d.end_of_utterance]


def test_a_sentence_end_inside_speech_is_final_once_the_edge_has_passed_it() -> None:
    pause = bytes(2 * SAMPLE_RATE)
    pcm = pause + heldout_talks()[0].pcm + pause

    async def both() -> tuple[Commits, Commits]:
        return (await commits(pcm, part_on_time=False, part_edge_s=EDGE),
                await commits(pcm, part_on_time=True, part_edge_s=EDGE))

    plain, on_time = asyncio.run(both())
    step = opts().step_s
    assert opts().part_on_time, "the default"
    assert part_lags(plain), "no sentence end inside running speech: nothing to test"
    assert len(part_lags(on_time)) == len(part_lags(plain))
    # The control: waiting for the next interim step, a part came well past the edge.
    assert max(part_lags(plain)) > EDGE + step / 2
    # On time: the edge, a chunk, and the distance between where the interim and the
    # final pass put the sentence's last word (a few of Whisper's 20 ms steps).
    assert max(part_lags(on_time)) <= EDGE + CHUNK / SAMPLE_RATE + 0.1
    # (What it says may differ in a word or two: the final pass read the audio up to
    # another point. bench.accuracy measures what that does to WER.)
