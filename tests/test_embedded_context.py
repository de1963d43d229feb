"""Finals with context (issue 37): the embedded engine's final pass on real speech.

Each lever is an `EmbeddedEngineOptions` field, off by default, and a named option of
`bench.accuracy`, which measures what it does to WER and latency; these tests pin down
what each one does:

- `final_prompt_words`: the final pass is prompted with the words committed before it;
- `final_context_s`: the final pass also reads the audio before the utterance, and what it
  hears there is not committed again;
- `unfinished_pause_s`: a short pause ends an utterance only at a sentence end;
- `final_beam_max_busy`: the final pass uses its beam only while the decode thread has
  headroom.

Whisper tiny.en on the reference utterances, fed in lock step (each 100 ms chunk once the
session has decoded the one before: what a session does then does not depend on how busy
the host is).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize, reference_text
from workers.captions.segmenter import ends_sentence
from workers.engines.base import SessionOptions
from workers.engines.embedded import (
    MIN_ENCODE_FRAMES,
    BusyLog,
    EmbeddedEngineOptions,
    EmbeddedWhisperEngine,
    EmbeddedWhisperSession,
)
from workers.engines.models import load_whisper
from workers.events import SAMPLE_RATE, AudioChunk, TranscriptDelta, Word

pytestmark = pytest.mark.integration

CHUNK = SAMPLE_RATE // 10
PROMPT_WORDS = 12


@dataclass(frozen=True)
class Decode:
    offset_s: float
    seconds: float
    beam: int
    final: bool
    prompt: str | None
    words: tuple[Word, ...]


class LoggedEngine(EmbeddedWhisperEngine):
    """Test tool: the real engine, keeping every decode's inputs and words."""

    def __init__(self, options: EmbeddedEngineOptions) -> None:
        super().__init__(options)
        self.decodes: list[Decode] = []

    def _decode_sync(self, audio: Any, offset_s: float, language: str | None, beam: int,
                     min_encode_frames: int = MIN_ENCODE_FRAMES, prompt: str | None = None,
                     ) -> tuple[list[Word], list[float], str | None]:
        out = super()._decode_sync(audio, offset_s, language, beam, min_encode_frames, prompt)
        self.decodes.append(Decode(offset_s, audio.size / SAMPLE_RATE, beam,
                                   min_encode_frames != MIN_ENCODE_FRAMES, prompt,
                                   tuple(out[0])))
        return out


@dataclass
class Played:
    engine: LoggedEngine
    session: EmbeddedWhisperSession
    deltas: list[TranscriptDelta] = field(default_factory=list)
    pushed_s: list[float] = field(default_factory=list)
    """Audio pushed (s) when each of `deltas` came out: in lock step, how far past its
    words a caption came, independent of the host's speed."""

    @property
    def committed(self) -> list[Word]:
        return [w for d in self.deltas for w in d.committed]

    @property
    def finals(self) -> list[Decode]:
        return [d for d in self.engine.decodes if d.final]


async def play(options: EmbeddedEngineOptions, pcm: bytes) -> Played:
    engine = LoggedEngine(options)
    await engine.start()
    session = engine.open_session(SessionOptions("t", "en"))
    assert isinstance(session, EmbeddedWhisperSession)
    out = Played(engine, session)
    pushed = 0
    emit = session._emit

    async def logged(delta: TranscriptDelta) -> None:
        # at emission, not when read: the reader may run after the next chunk's push
        out.pushed_s.append(pushed / SAMPLE_RATE)
        await emit(delta)

    session._emit = logged  # type: ignore[method-assign]

    async def consume() -> None:
        async for delta in session:
            out.deltas.append(delta)

    reader = asyncio.create_task(consume())
    for i in range(0, len(pcm), CHUNK * 2):
        pushed = i // 2 + CHUNK
        await session.push(AudioChunk("t", i // 2, pcm[i : i + CHUNK * 2], 0.0))
        await asyncio.wait_for(session.decoded(), 60)
    await session.end_input()
    await asyncio.wait_for(reader, 120)
    await engine.aclose()
    return out


def talk() -> bytes:
    pause = bytes(2 * SAMPLE_RATE)
    return pause + b"".join(decode_pcm16(AUDIO / f"{n}.flac") + pause for n in REFERENCE_FILES)


def opts(**kw: Any) -> EmbeddedEngineOptions:
    return EmbeddedEngineOptions(model="tiny.en", cpu_threads=2, **kw)


def wer(words: list[Word]) -> float:
    import jiwer

    return float(jiwer.wer(normalize(reference_text()), normalize("".join(w.text for w in words))))


def seams(played: Played) -> list[tuple[list[str], list[str]]]:
    """(the last words of one commit, the first of the next), for every commit."""
    commits = [[normalize(w.text) for w in d.committed] for d in played.deltas if d.committed]
    return [(a[-3:], b[:3]) for a, b in itertools.pairwise(commits)]


@pytest.fixture(scope="module")
def runs() -> dict[str, Played]:
    async def run_all() -> dict[str, Played]:
        pcm = talk()
        return {
            "plain": await play(opts(), pcm),
            "prompt": await play(opts(final_prompt_words=PROMPT_WORDS), pcm),
            "context": await play(opts(final_context_s=4.0), pcm),
        }

    return asyncio.run(run_all())


def test_the_final_pass_is_prompted_with_the_words_committed_before_its_audio(
        runs: dict[str, Played]) -> None:
    played = runs["prompt"]
    words = played.committed
    prompted = [d for d in played.finals if d.prompt]
    assert len(prompted) >= 3, "later finals carry no prompt"
    assert played.finals[0].prompt is None, "the first final has nothing said before it"
    for d in played.finals:
        before = [w for w in words if w.end_s <= d.offset_s + 0.05][-PROMPT_WORDS:]
        assert d.prompt == ("".join(w.text for w in before).strip() or None)
    # Interims stay unprompted: on windows this short Whisper repeats a prompt.
    assert all(d.prompt is None for d in played.engine.decodes if not d.final)
    assert all(d.prompt is None for d in runs["plain"].engine.decodes)
    # A prompt is context, never text: no commit begins by saying its prompt again.
    for d in prompted:
        assert d.prompt is not None
        tail = normalize(d.prompt).split()[-3:]
        assert [normalize(w.text) for w in d.words[:3]] != tail
    assert wer(words) <= wer(runs["plain"].committed) + 0.05


def test_context_audio_is_read_but_what_it_says_is_not_committed_again(
        runs: dict[str, Played]) -> None:
    played = runs["context"]
    words = played.committed
    committed = set(words)
    # The final passes read up to 4 s before their utterance (which begins a lead-in
    # before its first word), and hear words there: the end of the utterance before.
    heard_before = 0
    for d in played.finals:
        mine = [w for w in d.words if w in committed]
        if not mine:
            continue
        assert d.offset_s >= mine[0].start_s - 4.0 - 1.0
        heard_before += any(w.end_s <= mine[0].start_s for w in d.words if w not in committed)
    assert heard_before >= 2, "no final pass heard the words before its utterance"
    # ... and those words are not committed twice: times go forward, no word twice, and
    # no commit opens with the words the one before it closed with.
    assert all(b.start_s >= a.start_s for a, b in itertools.pairwise(words))
    assert len({(w.text, w.start_s) for w in words}) == len(words)
    for end, start in seams(played):
        assert end[-2:] != start[:2], (end, start)
    assert abs(len(words) - len(runs["plain"].committed)) <= 3
    assert wer(words) <= wer(runs["plain"].committed) + 0.05


def _split_point(pcm: bytes) -> int:
    """A sample between two words of room-a's first sentence where Whisper (tiny.en), read
    up to there and a pause, does not write a sentence end (it often does: a pause after
    any word looks like one), and not within its first three words."""
    model = load_whisper("tiny.en", cpu_threads=2)
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    segments, _ = model.transcribe(audio, language="en", word_timestamps=True,
                                   condition_on_previous_text=False, vad_filter=False)
    words = [w for s in segments for w in (s.words or [])]
    pause = np.zeros(int(0.8 * SAMPLE_RATE), dtype=np.float32)
    for a, b in itertools.pairwise(words[3:12]):
        if ends_sentence(a.word):
            break
        cut = int((a.end + b.start) / 2 * SAMPLE_RATE)
        segs, _ = model.transcribe(np.concatenate([audio[:cut], pause]), language="en",
                                   condition_on_previous_text=False, vad_filter=False,
                                   temperature=0.0)
        text = "".join(s.text for s in segs).strip()
        if text and not ends_sentence(text.split()[-1]):
            return cut
    raise AssertionError("Whisper wrote a sentence end at every pause tried")


def test_context_is_not_read_across_a_long_silence() -> None:
    """Two utterances 4 s apart: the second's final pass starts at its own buffer, not 4 s
    earlier in the silence and the first's words (`CONTEXT_GAP_MAX_S`: whisper-base once
    heard only those and lost a 20 s utterance). Across the reference talk's 1 s pauses
    the context is read (the test above)."""
    first = decode_pcm16(AUDIO / f"{REFERENCE_FILES[0]}.flac")
    second = decode_pcm16(AUDIO / f"{REFERENCE_FILES[1]}.flac")
    lead, silence = bytes(2 * SAMPLE_RATE), bytes(2 * 4 * SAMPLE_RATE)
    pcm = lead + first + silence + second + lead
    second_at = (len(lead) + len(first) + len(silence)) / 2 / SAMPLE_RATE
    played = asyncio.run(play(opts(final_context_s=4.0), pcm))
    later = [w for w in played.committed if w.start_s >= second_at - 0.5]
    assert len(later) >= 5, "the second utterance was not captioned"
    reads = [d for d in played.finals if later[0] in d.words]
    assert reads, "no final pass committed the second utterance's first word"
    # its buffer begins a lead-in (0.3 s) before its first speech frame
    assert all(d.offset_s >= second_at - 1.0 for d in reads), [d.offset_s for d in reads]
    assert played.session.context_retries == 0


class ContextDeafEngine(LoggedEngine):
    """STAND-IN for Whisper ending its transcript inside the context (whisper-base did on
    held-out speech, 2026-12-05): a final pass that read audio before its session's
    buffer returns only the words it heard there. Everything else is the real engine."""

    session: EmbeddedWhisperSession | None = None
    deaf = 0

    def _decode_sync(self, audio: Any, offset_s: float, language: str | None, beam: int,
                     min_encode_frames: int = MIN_ENCODE_FRAMES, prompt: str | None = None,
                     ) -> tuple[list[Word], list[float], str | None]:
        words, probs, lang = super()._decode_sync(audio, offset_s, language, beam,
                                                  min_encode_frames, prompt)
        buf_s = self.session._buf_pos / SAMPLE_RATE if self.session else 0.0
        if min_encode_frames != MIN_ENCODE_FRAMES and offset_s < buf_s - 0.01:
            self.deaf += 1
            kept = [i for i, w in enumerate(words) if w.start_s < buf_s]
            return [words[i] for i in kept], [probs[i] for i in kept], lang
        return words, probs, lang


def test_a_final_pass_that_hears_only_its_context_is_read_again_without_it(
        runs: dict[str, Played]) -> None:
    async def deaf_run() -> tuple[ContextDeafEngine, list[Word], int]:
        engine = ContextDeafEngine(opts(final_context_s=4.0))
        await engine.start()
        session = engine.open_session(SessionOptions("t", "en"))
        assert isinstance(session, EmbeddedWhisperSession)
        engine.session = session
        words: list[Word] = []

        async def consume() -> None:
            async for delta in session:
                words.extend(delta.committed)

        reader = asyncio.create_task(consume())
        pcm = talk()
        for i in range(0, len(pcm), CHUNK * 2):
            await session.push(AudioChunk("t", i // 2, pcm[i : i + CHUNK * 2], 0.0))
            await asyncio.wait_for(session.decoded(), 60)
        await session.end_input()
        await asyncio.wait_for(reader, 120)
        await engine.aclose()
        return engine, words, session.context_retries

    engine, words, retries = asyncio.run(deaf_run())
    assert engine.deaf >= 2, "no final pass read context: the stand-in tested nothing"
    assert retries == engine.deaf, (retries, engine.deaf)
    # Every utterance still captioned, as without context.
    assert wer(words) <= wer(runs["plain"].committed) + 0.05, (wer(words), len(words))


def test_a_pause_inside_a_sentence_ends_the_utterance_only_when_asked_to() -> None:
    """A second of silence put between two words of one sentence (where Whisper does not
    write a sentence end): by default (`pause_s` 0.6) the final ends there; with
    `unfinished_pause_s` 2.0 the utterance runs on over it and one final holds the words
    on both sides."""
    first = decode_pcm16(AUDIO / f"{REFERENCE_FILES[0]}.flac")
    cut = _split_point(first)
    lead, gap = bytes(2 * SAMPLE_RATE), bytes(2 * SAMPLE_RATE)
    pcm = lead + first[: cut * 2] + bytes(2 * SAMPLE_RATE) + first[cut * 2 :] + gap
    at_s = (len(lead) // 2 + cut) / SAMPLE_RATE

    async def both() -> tuple[Played, Played]:
        return (await play(opts(), pcm), await play(opts(unfinished_pause_s=2.0), pcm))

    split, held = asyncio.run(both())

    def final_across(played: Played) -> bool:
        return any(d.end_of_utterance and d.committed and d.committed[0].end_s < at_s
                   < d.committed[-1].start_s for d in played.deltas)

    assert not final_across(split), "the control: a 1 s pause ends the utterance"
    assert final_across(held), "the pause inside the sentence ended the utterance"


def test_the_final_beam_is_used_only_with_headroom() -> None:
    engine = EmbeddedWhisperEngine(opts(final_beam_size=5, final_beam_max_busy=0.5))
    assert engine.final_beam() == 5, "an idle engine has the headroom"
    busy = engine._busy
    now = busy_now = 1000.0
    busy.add(busy_now - 15.0, busy_now - 2.0)  # 13 s of the last 20 s
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("workers.engines.embedded.time.monotonic", lambda: now)
        assert engine.final_beam() == 1
        now = busy_now + 10.0  # 8 s of the last 20
        assert engine.final_beam() == 5
    stats = engine.stats()
    assert (stats["final_beam_calls"], stats["final_greedy_calls"]) == (2, 1)
    always = EmbeddedWhisperEngine(opts(final_beam_size=5))
    always._busy.add(0.0, 1e9)
    assert always.final_beam() == 5, "without final_beam_max_busy the beam is always used"


def test_busy_log_counts_only_the_window() -> None:
    log = BusyLog(window_s=10.0)
    log.add(0.0, 4.0)
    log.add(8.0, 9.0)
    assert log.fraction(now=9.0) == pytest.approx(0.5)
    assert log.fraction(now=12.0) == pytest.approx(0.3)  # 2-4 and 8-9
    assert log.fraction(now=30.0) == 0.0
