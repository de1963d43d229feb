"""Where the session manager says its voice-activity frames end (`AudioChunk.speech_end`).

Silero's 512-sample frames run on across chunks, so the frames that complete in a chunk
end where the samples the VAD still holds begin, not at the chunk's end. An engine session
places each flag by that position (the embedded engine starts an utterance `lead_in_s`
before its first speech frame), so a wrong end moves every utterance's start by up to
511 samples, by how the audio happened to be chunked. Real Silero on real speech; the
engine is a TEST DOUBLE that only records what the manager feeds it.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine_doubles import IdleEngine
from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16
from workers.engines.base import (
    RecognizeSession,
    SessionInput,
    SessionOptions,
)
from workers.engines.vad import FRAME_SAMPLES, VoiceActivity
from workers.events import SAMPLE_RATE, AudioChunk
from workers.sessions.manager import SessionManager, SessionPolicy

pytestmark = pytest.mark.unit


class RecordingOnlyEngine(IdleEngine):
    """TEST DOUBLE: sessions that keep every chunk they get and say nothing."""

    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        chunks = self.chunks

        class Recording(RecognizeSession):
            async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
                while isinstance(item := await inputs.get(), AudioChunk):
                    chunks.append(item)

        session = Recording(options)
        session.start()
        return session


@pytest.mark.parametrize("chunk", [1600, 1000, 777])
def test_each_flag_ends_where_its_frame_ends_in_the_stream(chunk: int) -> None:
    pcm = decode_pcm16(AUDIO / f"{REFERENCE_FILES[0]}.flac")[: 6 * SAMPLE_RATE * 2]
    whole = VoiceActivity().feed_pcm16(pcm)  # the same frames, fed at once
    engine = RecordingOnlyEngine()

    async def run() -> None:
        manager = SessionManager(engine, SessionOptions("t", "en"), SessionPolicy())
        manager.start()

        async def drain() -> None:
            async for _ in manager:
                pass

        drainer = asyncio.create_task(drain())
        for pos in range(0, len(pcm) // 2, chunk):
            await manager.push(AudioChunk("t", pos, pcm[pos * 2 : (pos + chunk) * 2], 0.0))
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        await manager.end_input()
        await asyncio.wait_for(drainer, 30)

    asyncio.run(run())
    placed: list[tuple[int, bool]] = []
    for c in engine.chunks:
        assert c.speech is not None and c.speech_end is not None
        assert c.pos <= c.speech_end <= c.pos + c.samples
        assert c.pos + c.samples - c.speech_end < FRAME_SAMPLES
        n = len(c.speech)
        placed.extend((c.speech_end - (n - 1 - i) * FRAME_SAMPLES, f)
                      for i, f in enumerate(c.speech))
    assert len(placed) == len(whole) and any(whole) and not all(whole)
    assert placed == [((k + 1) * FRAME_SAMPLES, f) for k, f in enumerate(whole)]

