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
from tests.test_embedded_context import CHUNK, LoggedEngine, opts
from workers.engines.base import SessionOptions
from workers.events import SAMPLE_RATE, AudioChunk, TranscriptDelta

pytestmark = pytest.mark.integration

Commits = list[tuple[float, TranscriptDelta]]
"""(audio pushed when it came out, s; the delta), for every delta that commits words."""


async def play(pcm: bytes, **kw: Any) -> Commits:
    engine = LoggedEngine(opts(**kw))
    await engine.start()
    session = engine.open_session(SessionOptions("t", "en"))
    pushed = 0
    out: Commits = []
    emit = session._emit

    async def logged(delta: TranscriptDelta) -> None:
        if delta.committed:
            out.append((pushed / SAMPLE_RATE, delta))
        await emit(delta)

    session._emit = logged  # type: ignore[method-assign]

    async def consume() -> None:
        async for _ in session:
            pass

    reader = asyncio.create_task(consume())
    for i in range(0, len(pcm), CHUNK * 2):
        pushed = i // 2 + CHUNK
        await session.push(AudioChunk("t", i // 2, pcm[i : i + CHUNK * 2], 0.0))
        await asyncio.wait_for(session.decoded(), 60)
    await session.end_input()
    await asyncio.wait_for(reader, 120)
    await engine.aclose()
    return out


def part_lags(commits: Commits) -> list[float]:
    """For each part (a commit that is not an utterance's end): audio pushed when it came
    out, minus the end of its last word."""
    return [at - d.committed[-1].end_s for at, d in commits if not d.end_of_utterance]


def test_a_sentence_end_inside_speech_is_final_once_the_edge_has_passed_it() -> None:
    pause = bytes(2 * SAMPLE_RATE)
    pcm = pause + heldout_talks()[0].pcm + pause

    async def both() -> tuple[Commits, Commits]:
        return await play(pcm, part_on_time=False), await play(pcm, part_on_time=True)

    plain, on_time = asyncio.run(both())
    edge, step = opts().part_edge_s, opts().step_s
    assert opts().part_on_time, "the default"
    assert part_lags(plain), "no sentence end inside running speech: nothing to test"
    assert len(part_lags(on_time)) == len(part_lags(plain))
    # The control: waiting for the next interim step, a part came well past the edge.
    assert max(part_lags(plain)) > edge + step / 2
    # On time: the edge, a chunk, and the distance between where the interim and the
    # final pass put the sentence's last word (a few of Whisper's 20 ms steps).
    assert max(part_lags(on_time)) <= edge + CHUNK / SAMPLE_RATE + 0.1
    # (What it says may differ in a word or two: the final pass read the audio up to
    # another point. bench.accuracy measures what that does to WER.)
