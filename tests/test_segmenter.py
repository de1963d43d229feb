"""Transcript deltas → caption segments: partials, finals, seq, revisions, lines."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest

from workers.bus import caption_from_json, caption_to_json
from workers.captions.segmenter import Segmenter
from workers.events import CaptionSegment, TranscriptDelta, Word

pytestmark = pytest.mark.unit

NOW = 1_700_000_000.0


def words(text: str, start: float = 0.0, step: float = 0.5) -> tuple[Word, ...]:
    """Whisper-style words: each text carries its leading space (" Hello")."""
    return tuple(
        Word(f" {token}", start + i * step, start + i * step + 0.4)
        for i, token in enumerate(text.split())
    )


def delta(
    committed: str = "",
    tentative: str = "",
    *,
    at: float = 0.0,
    end_of_utterance: bool = False,
) -> TranscriptDelta:
    done = words(committed, at)
    return TranscriptDelta(
        committed=done,
        tentative=words(tentative, at + 0.5 * len(done)),
        end_of_utterance=end_of_utterance,
    )


def segmenter(**kwargs: object) -> Segmenter:
    kwargs.setdefault("clock", lambda: NOW)
    return Segmenter("hall-a", "en", **kwargs)  # type: ignore[arg-type]


def feed_all(seg: Segmenter, deltas: Iterable[TranscriptDelta]) -> list[CaptionSegment]:
    out: list[CaptionSegment] = []
    for d in deltas:
        out.extend(seg.feed(d))
    return out


def conversation() -> list[TranscriptDelta]:
    """A few sentences arriving as an engine would send them."""
    return [
        delta(tentative="Good"),
        delta("Good", "morning", at=0.0),
        delta("morning", "every", at=0.5),
        delta("everyone.", "Today", at=1.0),
        delta("Today we", "talk", at=1.5),
        delta("talk about", "Mr. Smith", at=2.5),
        delta("Mr. Smith", "and his", at=3.5),
        delta("and his work", "", at=4.5, end_of_utterance=True),
        delta(tentative="Any questions", at=7.0),
        delta("Any questions?", "Yes", at=7.0),
        delta("Yes", at=8.0, end_of_utterance=True),
    ]


def test_seq_starts_at_next_seq_and_grows_by_one_per_publication() -> None:
    published = feed_all(segmenter(next_seq=100), conversation())
    assert len(published) > 5
    assert [s.seq for s in published] == list(range(100, 100 + len(published)))


def test_partials_of_one_segment_share_segment_id_and_count_revisions() -> None:
    seg = segmenter(next_segment_id=7)
    published = feed_all(
        seg,
        [
            delta(tentative="Hello"),
            delta("Hello", "big"),
            delta("big", "world", at=0.5),
        ],
    )
    assert [s.is_final for s in published] == [False, False, False]
    assert [s.segment_id for s in published] == [7, 7, 7]
    assert [s.revision for s in published] == [1, 2, 3]
    assert [s.text for s in published] == ["Hello", "Hello big", "Hello big world"]


def test_final_continues_the_revisions_of_its_partials() -> None:
    published = feed_all(segmenter(), [delta(tentative="Hi"), delta("Hi there.")])
    assert [(s.segment_id, s.revision, s.is_final) for s in published] == [
        (1, 1, False),
        (1, 2, True),
    ]


def test_committed_sentence_end_closes_the_segment_as_final() -> None:
    published = segmenter(next_segment_id=3).feed(delta("Good morning everyone."))
    assert len(published) == 1
    final = published[0]
    assert final.is_final
    assert final.segment_id == 3
    assert final.text == "Good morning everyone."


def test_word_after_a_final_opens_a_new_segment() -> None:
    seg = segmenter(next_segment_id=3)
    published = seg.feed(delta("It works. Next", "one"))
    assert [(s.segment_id, s.is_final, s.revision, s.text) for s in published] == [
        (3, True, 1, "It works."),
        (4, False, 1, "Next one"),
    ]
    later = seg.feed(delta("one", "more", at=1.5))
    assert [(s.segment_id, s.revision) for s in later] == [(4, 2)]


@pytest.mark.parametrize("ending", ["?", "!", "…", '."', ".)"])
def test_other_sentence_endings_close_the_segment(ending: str) -> None:
    published = segmenter().feed(delta(f"Really{ending}"))
    assert [s.is_final for s in published] == [True]


@pytest.mark.parametrize("title", ["Mr.", "Mrs.", "Dr.", "Ms."])
def test_title_abbreviation_does_not_close_a_sentence(title: str) -> None:
    seg = segmenter()
    published = seg.feed(delta(f"We met {title}"))
    assert [s.is_final for s in published] == [False]
    published = seg.feed(delta("Smith today.", at=1.5))
    assert [(s.is_final, s.text) for s in published] == [(True, f"We met {title} Smith today.")]


def test_end_of_utterance_finalizes_the_open_segment() -> None:
    seg = segmenter()
    assert [s.is_final for s in seg.feed(delta("So that is", "it"))] == [False]
    published = seg.feed(delta("it", at=1.5, end_of_utterance=True))
    assert [(s.is_final, s.text, s.segment_id) for s in published] == [(True, "So that is it", 1)]


def test_end_of_utterance_with_nothing_open_publishes_nothing() -> None:
    assert segmenter().feed(delta(end_of_utterance=True)) == []


def test_a_partial_that_is_never_confirmed_is_withdrawn_not_finalised_empty() -> None:
    seg = segmenter(next_segment_id=5)
    partial = seg.feed(delta(tentative="Hmm", at=3.0))
    withdrawn = seg.feed(delta(end_of_utterance=True))
    assert [(s.segment_id, s.withdrawn, s.is_final, s.text, s.lines) for s in withdrawn] == [
        (5, True, False, "", ())]
    assert withdrawn[0].seq == partial[0].seq + 1
    # It names the audio the partial was for, not 0/0.
    assert (withdrawn[0].audio_start_s, withdrawn[0].audio_end_s) == (
        partial[0].audio_start_s, partial[0].audio_end_s)
    assert seg.feed(delta(end_of_utterance=True)) == []
    # The withdrawn segment's id is closed: the next words open a new one.
    assert [s.segment_id for s in seg.feed(delta(tentative="Next"))] == [6]


def test_no_final_is_empty_or_untimed() -> None:
    seg = segmenter()
    published = feed_all(seg, [
        *conversation(),
        delta(tentative="and", at=9.0),
        delta(end_of_utterance=True),  # an unconfirmed partial, then the session ends
        TranscriptDelta(committed=(Word(" ", 10.0, 10.2),), end_of_utterance=True),
        TranscriptDelta(committed=(Word(" Ok.", 11.0, 11.0),)),  # a zero-length stamp
    ])
    finals = [s for s in published if s.is_final]
    assert finals and all(s.text and 0 < s.audio_end_s and s.audio_start_s < s.audio_end_s
                          for s in finals)
    assert [s.withdrawn for s in published].count(True) == 1


def test_length_cap_closes_the_segment() -> None:
    seg = segmenter(max_chars=20)
    published = seg.feed(delta("one two three four five six seven eight"))
    finals = [s for s in published if s.is_final]
    assert finals, "a segment past max_chars must close"
    first = finals[0]
    assert first.text == "one two three four five"  # the first word that reaches 20 chars
    assert len(first.text) >= 20
    assert all(len(s.text) < 20 + len(" eight") for s in finals)
    rest = [s for s in published if s.segment_id != first.segment_id]
    assert rest and all(s.segment_id > first.segment_id for s in rest)


def test_final_caption_is_never_revised() -> None:
    published = feed_all(segmenter(), conversation())
    finals = [s for s in published if s.is_final]
    assert len(finals) >= 4
    for i, s in enumerate(published):
        if s.is_final:
            later = [p.seq for p in published[i + 1 :] if p.segment_id == s.segment_id]
            assert not later, f"final segment {s.segment_id} republished at seq {later}"


def test_segment_ids_grow_and_each_segment_has_exactly_one_final() -> None:
    published = feed_all(segmenter(next_segment_id=10), conversation())
    ids = [s.segment_id for s in published]
    assert ids == sorted(ids)
    finals = [s.segment_id for s in published if s.is_final]
    assert finals == sorted(set(ids))


def test_tentative_words_appear_in_partials_but_not_in_finals() -> None:
    seg = segmenter()
    partial = seg.feed(delta("The", "cat"))
    assert partial[0].text == "The cat"
    # The engine changed its mind: "cat" never becomes committed.
    final = seg.feed(delta("dog.", "And", at=0.5))
    assert final[0].is_final and final[0].text == "The dog."
    assert final[1].text == "And" and not final[1].is_final


def test_tentative_words_are_dropped_when_the_utterance_ends() -> None:
    published = segmenter().feed(delta("Hello", "wor", end_of_utterance=True))
    assert [(s.is_final, s.text) for s in published] == [(True, "Hello")]


def test_identical_consecutive_partial_is_not_republished() -> None:
    seg = segmenter()
    assert len(seg.feed(delta("Hello", "world"))) == 1
    assert seg.feed(delta(tentative="world", at=0.5)) == []
    # The tentative word becoming committed does not change what is shown.
    assert seg.feed(delta("world", at=0.5)) == []
    assert [s.text for s in seg.feed(delta(tentative="again", at=1.0))] == ["Hello world again"]


def test_partial_text_may_return_after_it_changed() -> None:
    seg = segmenter()
    seg.feed(delta("Hello", "world"))
    assert [s.text for s in seg.feed(delta(tentative="word", at=0.5))] == ["Hello word"]
    assert [s.text for s in seg.feed(delta(tentative="world", at=0.5))] == ["Hello world"]


def test_lines_fit_the_web_profile() -> None:
    long_sentence = " ".join(f"word{i}" for i in range(40))
    seg = segmenter(max_chars=400)
    published = feed_all(
        seg,
        [
            delta(tentative=long_sentence),
            delta(long_sentence, "tail"),
            delta("tail.", at=20.0),
        ],
    )
    assert published
    for s in published:
        assert 1 <= len(s.lines) <= 2
        assert all(len(line) <= 42 for line in s.lines), s.lines
        assert s.text.endswith(s.lines[-1])


def test_audio_start_and_end_come_from_the_words() -> None:
    seg = segmenter()
    partial = seg.feed(
        TranscriptDelta(
            committed=(Word(" Hello", 12.0, 12.4),),
            tentative=(Word(" world", 12.5, 13.1),),
        )
    )
    assert (partial[0].audio_start_s, partial[0].audio_end_s) == (12.0, 13.1)
    final = seg.feed(TranscriptDelta(committed=(Word(" there.", 12.5, 12.9),)))
    assert (final[0].audio_start_s, final[0].audio_end_s) == (12.0, 12.9)


def test_audio_end_wall_maps_the_audio_end_through_wall_of() -> None:
    seg = segmenter(wall_of=lambda t: 5000.0 + t, clock=lambda: NOW)
    published = seg.feed(
        TranscriptDelta(committed=(Word(" Hi", 3.0, 3.25),), tentative=(Word(" you", 3.5, 3.75),))
    )
    assert published[0].audio_end_wall == 5003.75
    assert published[0].emit_time == NOW


def test_audio_end_wall_defaults_to_the_clock() -> None:
    published = segmenter(clock=lambda: NOW).feed(delta("Hi."))
    assert published[0].audio_end_wall == NOW
    assert published[0].emit_time == NOW


def test_stable_prefix_len_is_the_length_of_the_committed_text_in_partials() -> None:
    seg = segmenter()
    only_tentative = seg.feed(delta(tentative="Hello"))[0]
    assert only_tentative.stable_prefix_len == 0
    partial = seg.feed(delta("Hello big", "world"))[0]
    assert partial.text == "Hello big world"
    assert partial.stable_prefix_len == len("Hello big")
    assert partial.text[: partial.stable_prefix_len] == "Hello big"


def test_stable_prefix_of_a_final_is_its_whole_text() -> None:
    final = segmenter().feed(delta("All done.", "ignored"))[0]
    assert final.is_final
    assert final.stable_prefix_len == len(final.text) == len("All done.")


def test_segments_carry_the_stream_and_language() -> None:
    for s in feed_all(segmenter(), conversation()):
        assert (s.stream, s.lang) == ("hall-a", "en")


def test_a_withdraw_travels_as_its_own_message_type() -> None:
    seg = segmenter()
    seg.feed(delta(tentative="Hmm"))
    [withdraw] = seg.feed(delta(end_of_utterance=True))
    wire = json.loads(caption_to_json(withdraw))
    assert wire["type"] == "withdraw" and "withdrawn" not in wire
    assert caption_from_json(caption_to_json(withdraw)) == withdraw
    [shown] = segmenter().feed(delta(tentative="Hmm"))
    assert json.loads(caption_to_json(shown))["type"] == "caption"
    assert caption_from_json(caption_to_json(shown)) == shown


def test_a_resumed_caption_that_is_not_heard_again_is_withdrawn_not_finalised_empty() -> None:
    """After a SIGKILL the new owner goes on with the caption left open (its audio is
    read again). If that audio yields no word for it, the caption is withdrawn under
    its own segment id: it came back as an empty final before (issue 36)."""
    [shown] = segmenter(next_segment_id=7).feed(delta(tentative="Had he married", at=40.0))
    seg = segmenter(next_seq=shown.seq + 1, next_segment_id=8)
    seg.resume(shown)
    [withdrawn] = seg.feed(delta(end_of_utterance=True))
    assert (withdrawn.segment_id, withdrawn.withdrawn, withdrawn.is_final) == (7, True, False)
    assert withdrawn.audio_start_s == shown.audio_start_s
    # Heard again, it goes on and is made final once, with its text and times.
    seg = segmenter(next_seq=shown.seq + 1, next_segment_id=8)
    seg.resume(shown)
    [final] = seg.feed(delta("Had he married.", at=40.0, end_of_utterance=True))
    assert (final.segment_id, final.is_final, final.text) == (7, True, "Had he married.")
    assert 40.0 <= final.audio_start_s < final.audio_end_s


def test_skipped_audio_is_a_gap_event_after_the_open_caption_is_closed() -> None:
    seg = segmenter(next_segment_id=3)
    seg.feed(delta("So we", "went", at=10.0))
    closed = seg.feed(delta(end_of_utterance=True))
    [gap] = seg.feed(TranscriptDelta(skipped=(11.0, 31.5)))
    assert [c.is_final for c in closed] == [True]
    assert (gap.segment_id, gap.gap_s, gap.is_final, gap.text) == (4, 20.5, False, "")
    assert (gap.audio_start_s, gap.audio_end_s) == (11.0, 31.5)
    assert gap.seq == closed[-1].seq + 1
    wire = json.loads(caption_to_json(gap))
    assert wire["type"] == "gap" and wire["gap_s"] == 20.5
    assert caption_from_json(caption_to_json(gap)) == gap
    assert "gap_s" not in json.loads(caption_to_json(closed[0]))
