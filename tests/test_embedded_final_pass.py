"""The embedded engine's finals on real speech (tiny.en, the reference utterances).

Finals come from one decode of the whole utterance when the speaker pauses (the default
`final_pass: utterance`); LocalAgreement only drives the partials. Speech longer than
`max_utterance_s` is finalised in parts. Voice activity comes with the audio from the
session manager, so the session runs no Silero of its own. The final pass runs with beam 2
here and the interims with beam 1, so a test can tell which decode a word came from.
Audio is fed at real time, six sessions at once on two cores: partials, parts and early
commits need a session that keeps up (at 3x real time a slower host lagged so far that a
whole utterance arrived before the session's first interim). One more session gets all its
audio at once, as a backlog delivered in a burst.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16
from workers.captions.segmenter import Segmenter, ends_sentence
from workers.engines.base import RecognizeSession, SessionOptions
from workers.engines.embedded import (
    EmbeddedEngineOptions,
    EmbeddedWhisperEngine,
    EmbeddedWhisperSession,
)
from workers.events import SAMPLE_RATE, AudioChunk, CaptionSegment, TranscriptDelta, Word
from workers.sessions.manager import SessionManager, SessionPolicy

pytestmark = pytest.mark.integration

CHUNK = SAMPLE_RATE // 10
FINAL_BEAM = 2
SPEED = 1.0


class LoggedEngine(EmbeddedWhisperEngine):
    """Test tool: the real engine, keeping what each decode returned and every session."""

    def __init__(self, options: EmbeddedEngineOptions) -> None:
        super().__init__(options)
        self.decodes: list[tuple[int, tuple[Word, ...]]] = []
        self.encode_frames: list[tuple[int, int]] = []
        self.sessions: list[EmbeddedWhisperSession] = []

    def _decode_sync(self, audio: Any, offset_s: float, language: str | None, beam: int,
                     min_encode_frames: int = 1000, prompt: str | None = None,
                     ) -> tuple[list[Word], list[float], str | None]:
        out = super()._decode_sync(audio, offset_s, language, beam, min_encode_frames, prompt)
        self.decodes.append((beam, tuple(out[0])))
        self.encode_frames.append((beam, min_encode_frames))
        return out

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = super().open_session(options)
        assert isinstance(session, EmbeddedWhisperSession)
        self.sessions.append(session)
        return session


@dataclass
class Played:
    engine: LoggedEngine
    session: RecognizeSession
    deltas: list[TranscriptDelta] = field(default_factory=list)
    captions: list[CaptionSegment] = field(default_factory=list)


async def play(options: EmbeddedEngineOptions, pcm: bytes, *, manager: bool = True,
               batch: int = 1, burst: bool = False) -> Played:
    engine = LoggedEngine(options)
    await engine.start()
    session: RecognizeSession
    if manager:
        session = SessionManager(engine, SessionOptions("t", "en"), SessionPolicy())
        session.start()
    else:
        session = engine.open_session(SessionOptions("t", "en"))
    out = Played(engine, session)

    async def feed() -> None:
        for n, i in enumerate(range(0, len(pcm), CHUNK * 2)):
            await session.push(AudioChunk("t", i // 2, pcm[i : i + CHUNK * 2], 0.0))
            if burst:
                await asyncio.sleep(0)  # the manager takes each chunk; no pacing
            elif (n + 1) % batch == 0:  # `batch` chunks arrive at once
                await asyncio.sleep(batch * CHUNK / SAMPLE_RATE / SPEED)
        await session.end_input()

    async def consume() -> None:
        seg = Segmenter("t", "en")
        async for delta in session:
            out.deltas.append(delta)
            out.captions.extend(seg.feed(delta))

    await asyncio.wait_for(asyncio.gather(feed(), consume()), 180)
    await engine.aclose()
    return out


def talk() -> bytes:
    pause = bytes(2 * SAMPLE_RATE)
    return pause + b"".join(decode_pcm16(AUDIO / f"{n}.flac") + pause for n in REFERENCE_FILES)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    def opts(**kw: Any) -> EmbeddedEngineOptions:
        return EmbeddedEngineOptions(model="tiny.en", cpu_threads=2,
                                     final_beam_size=FINAL_BEAM, **kw)

    async def run_all() -> dict[str, Any]:
        pcm = talk()
        # Only pauses end utterances here (no sentence parts: when a part is tried depends
        # on the interims, which do depend on the batching).
        pauses_only = opts(part_edge_s=1e6)
        utterance, agreement, parts, alone, steady, bursts, backlog = await asyncio.gather(
            play(opts(), pcm),
            play(opts(final_pass="agreement"), pcm),
            play(opts(max_utterance_s=6.0), pcm),
            play(opts(), pcm[: 8 * SAMPLE_RATE * 2], manager=False),
            play(pauses_only, pcm),
            play(pauses_only, pcm, batch=7),
            play(opts(), pcm, burst=True),
        )
        return {"utterance": utterance, "agreement": agreement, "parts": parts,
                "alone": alone, "steady": steady, "bursts": bursts, "backlog": backlog}

    return asyncio.run(run_all())


def committed(played: Played) -> list[Word]:
    return [w for d in played.deltas for w in d.committed]


def test_final_caption_is_never_revised(runs: dict[str, Any]) -> None:
    for name in ("utterance", "agreement", "parts"):
        finals: set[int] = set()
        for cap in runs[name].captions:
            assert cap.segment_id not in finals, f"{name}: segment {cap.segment_id} revised"
            if cap.is_final:
                finals.add(cap.segment_id)
        assert finals, name


def test_final_text_comes_from_the_whole_utterance_pass_not_from_agreement(
        runs: dict[str, Any]) -> None:
    played: Played = runs["utterance"]
    final_pass = {w for beam, words in played.engine.decodes if beam == FINAL_BEAM
                  for w in words}
    words = committed(played)
    assert len(words) >= 40
    assert all(w in final_pass for w in words), "a committed word no final pass decoded"
    # Agreement only shows partials: before the pause, only whole sentences are committed
    # (by a final pass, once the sentence's end is well behind the newest audio).
    for d in played.deltas:
        if d.committed and not d.end_of_utterance:
            assert ends_sentence(d.committed[-1].text)
    assert any(d.tentative for d in played.deltas), "no partials while speaking"
    # The final pass reads Whisper's full 30 s input; interims the 10 s shortcut.
    assert {f for beam, f in played.engine.encode_frames if beam == FINAL_BEAM} == {3000}
    assert {f for beam, f in played.engine.encode_frames if beam != FINAL_BEAM} == {1000}


def test_every_word_is_finalised_once_in_order(runs: dict[str, Any]) -> None:
    played: Played = runs["utterance"]
    closing = [d for d in played.deltas if d.end_of_utterance and d.committed]
    assert len(closing) >= 2
    # Words are committed once each, in order: no overlap between utterances or parts.
    words = committed(played)
    assert all(b.start_s >= a.start_s for a, b in itertools.pairwise(words))
    assert len({(w.text, w.start_s) for w in words}) == len(words)


def test_agreement_mode_commits_while_the_speaker_talks(runs: dict[str, Any]) -> None:
    played: Played = runs["agreement"]
    early = [d for d in played.deltas if d.committed and not d.end_of_utterance]
    assert early, "agreement committed nothing before a pause"


def test_speech_past_max_utterance_is_finalised_in_parts_away_from_the_edge(
        runs: dict[str, Any]) -> None:
    played: Played = runs["parts"]
    parts = [d for d in played.deltas if d.committed and not d.end_of_utterance]
    assert parts, "room-a (18 s without a long pause) was not finalised in parts"
    final_pass = {w for beam, words in played.engine.decodes if beam == FINAL_BEAM
                  for w in words}
    assert all(w in final_pass for w in committed(played))
    words = committed(played)
    assert len({(w.text, w.start_s) for w in words}) == len(words), "a word committed twice"


def test_silero_runs_once_per_stream(runs: dict[str, Any]) -> None:
    managed = runs["utterance"].engine.sessions
    assert managed and all(s.own_vad_frames == 0 for s in managed), \
        "the session ran Silero again behind the session manager"
    alone = runs["alone"].engine.sessions
    assert alone[0].own_vad_frames > 0, "a session on its own has no voice activity"
    assert committed(runs["alone"]), "a session on its own captions nothing"


def test_what_a_final_says_does_not_depend_on_how_the_audio_was_batched(
        runs: dict[str, Any]) -> None:
    # Each utterance starts lead_in_s before its first speech frame, however many chunks
    # came in the batch that held the onset: the final passes see the same audio.
    def finals(played: Played) -> list[tuple[str, float]]:
        return [(w.text, round(w.start_s, 2)) for w in committed(played)]

    assert finals(runs["steady"])
    assert finals(runs["bursts"]) == finals(runs["steady"])


def test_a_session_behind_its_audio_is_not_taken_for_a_rut(runs: dict[str, Any]) -> None:
    """32 s of speech reach the session manager at once: the engine session is many
    seconds behind, with no text yet for most of it. That is a backlog, not a rut: the
    rut watchdog judges only the speech the session has decoded. (It used to judge all
    of it, replaced the session mid-decode and lost those words.)"""
    played: Played = runs["backlog"]
    session = played.session
    assert isinstance(session, SessionManager)
    assert session.counters["ruts_detected"] == 0
    reference = committed(runs["steady"])
    words = committed(played)
    assert len(words) >= len(reference) - 2
    assert words[0].start_s < 1.5, "the first utterance was lost"


@pytest.mark.parametrize("per_batch", [1, 7])
def test_an_utterance_starts_where_its_first_speech_frame_says_however_the_chunks_came(
        per_batch: int) -> None:
    """The onset frame here (512 samples, frame 53: samples 27,136-27,647) straddles the
    edge of a 100 ms chunk (27,200). Fed chunk by chunk, the session used to keep only the
    lead-in of the chunk before it, so the utterance began at 27,200 - 0.3 s, not 27,136 -
    0.3 s, and its final pass read other audio than a session that got the chunks seven at
    a time (a flaky whole-suite failure: the same talk finalised "John." against "John
    Dashwood had then…"). The flags are given with the chunks (as the session manager
    gives Silero's), so the onset is where the test puts it."""
    onset_frame, frames_speech, frame = 53, 200, 512
    pcm = decode_pcm16(AUDIO / f"{REFERENCE_FILES[0]}.flac")
    speech_pcm = pcm[: frames_speech * frame * 2]
    audio = bytes(onset_frame * frame * 2) + speech_pcm + bytes(SAMPLE_RATE * 2)
    n_frames = len(audio) // 2 // frame
    flags = [onset_frame <= k < onset_frame + frames_speech for k in range(n_frames)]
    options = EmbeddedEngineOptions(model="tiny.en", cpu_threads=2, final_beam_size=FINAL_BEAM)
    size = CHUNK * per_batch

    async def run() -> list[tuple[float, int]]:
        engine = LoggedEngine(options)
        await engine.start()
        starts: list[tuple[float, int]] = []
        original = engine._decode_sync

        def decode(audio_: Any, offset_s: float, *args: Any, **kw: Any) -> Any:
            if args[1] == FINAL_BEAM:  # (language, beam, …)
                starts.append((round(offset_s, 4), len(audio_)))
            return original(audio_, offset_s, *args, **kw)

        engine._decode_sync = decode  # type: ignore[method-assign]
        session = engine.open_session(SessionOptions("t", "en"))

        async def drain() -> None:
            async for _ in session:
                pass

        drainer = asyncio.create_task(drain())
        for pos in range(0, len(audio) // 2, size):
            chunk = audio[pos * 2 : (pos + size) * 2]
            end = pos + len(chunk) // 2  # frames k ending in (pos, end]: 512 (k + 1)
            mine = tuple(flags[pos // frame : end // frame])
            await session.push(AudioChunk("t", pos, chunk, 0.0, speech=mine,
                                          speech_end=end // frame * frame))
            await asyncio.sleep(0.02)  # each chunk is its own batch in the session
        await session.end_input()
        await asyncio.wait_for(drainer, 120)
        await engine.aclose()
        return starts

    starts = asyncio.run(run())
    expected = (onset_frame * frame - round(0.3 * SAMPLE_RATE)) / SAMPLE_RATE
    assert starts and starts[0][0] == round(expected, 4), (starts, expected)
