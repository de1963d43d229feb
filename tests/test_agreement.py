"""LocalAgreement-2: words commit when two consecutive hypotheses agree on them."""

from __future__ import annotations

import pytest

from workers.engines.agreement import LocalAgreement, norm
from workers.events import Word

pytestmark = pytest.mark.unit


def hyp(text: str, start: float = 0.0, step: float = 0.5) -> list[Word]:
    """A Whisper-style hypothesis: leading spaces, word i spans [start + i*step, +0.4]."""
    return [
        Word(f" {token}", start + i * step, start + i * step + 0.4)
        for i, token in enumerate(text.split())
    ]


def texts(words: list[Word]) -> list[str]:
    return [w.text.strip() for w in words]


def test_first_hypothesis_commits_nothing() -> None:
    agreement = LocalAgreement()
    assert agreement.insert(hyp("Hello world")) == []
    assert texts(agreement.tentative) == ["Hello", "world"]
    assert agreement.last_committed_end == 0.0


def test_word_is_committed_when_two_consecutive_hypotheses_agree() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("Hello world"))
    committed = agreement.insert(hyp("Hello world how"))
    assert texts(committed) == ["Hello", "world"]
    assert texts(agreement.tentative) == ["how"]
    assert agreement.last_committed_end == pytest.approx(0.9)


def test_agreement_stops_at_the_first_disagreement() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("one two three four"))
    # "two" changed: "three four" agree again, but not the prefix before them.
    committed = agreement.insert(hyp("one too three four"))
    assert texts(committed) == ["one"]
    assert texts(agreement.tentative) == ["too", "three", "four"]


def test_comparison_ignores_case_and_punctuation() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("hello, World"))
    committed = agreement.insert(hyp("Hello world. And"))
    assert texts(committed) == ["Hello", "world."], "the latest hypothesis' spelling is kept"
    assert norm(" Be.") == norm("be") == "be"
    assert norm("don't") == "don't"


def test_changed_mind_on_the_tail_is_not_committed() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("I like cats"))
    assert texts(agreement.insert(hyp("I like hats"))) == ["I", "like"]
    assert agreement.insert(hyp("I like bats too")) == []
    assert texts(agreement.tentative) == ["bats", "too"]
    assert texts(agreement.committed) == ["I", "like"]


def test_agreement_must_come_from_consecutive_hypotheses() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("Go north"))
    agreement.insert(hyp("Go south"))  # commits "Go"
    # "north" is back, but the hypothesis just before said "south".
    assert agreement.insert(hyp("Go north")) == []
    assert texts(agreement.insert(hyp("Go north now"))) == ["north"]


def test_committed_words_are_not_committed_again_while_the_window_holds_them() -> None:
    agreement = LocalAgreement()
    committed: list[Word] = []
    sentence = "the quick brown fox jumps over the lazy dog".split()
    # The window grows by one word per step and always restarts at the first word.
    for n in range(1, len(sentence) + 1):
        committed += agreement.insert(hyp(" ".join(sentence[:n])))
    committed += agreement.commit_all(hyp(" ".join(sentence)))
    assert texts(committed) == sentence
    assert texts(agreement.committed) == sentence


def test_repeated_ngram_at_the_window_start_is_dropped_despite_shifted_times() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("the quick brown fox"))
    agreement.insert(hyp("the quick brown fox"))
    assert texts(agreement.committed) == ["the", "quick", "brown", "fox"]
    end = agreement.last_committed_end  # 1.9
    # The window was trimmed; the model re-times "brown fox" later than before,
    # so the time filter alone keeps them.
    shifted = [
        Word(" brown", end - 0.05, end + 0.2),
        Word(" fox", end + 0.25, end + 0.5),
        Word(" jumps", end + 0.6, end + 0.9),
    ]
    assert agreement.insert(shifted) == []
    assert texts(agreement.tentative) == ["jumps"]
    again = [*shifted, Word(" over", end + 1.0, end + 1.3)]
    assert texts(agreement.insert(again)) == ["jumps"]
    assert texts(agreement.committed) == ["the", "quick", "brown", "fox", "jumps"]


def test_words_before_the_committed_end_are_ignored() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("alpha beta"))
    agreement.insert(hyp("alpha beta"))
    # A different reading of old audio (before last_committed_end) is not news.
    old_audio = [Word(" alfa", 0.0, 0.4), Word(" bet", 0.5, 0.9)]
    assert agreement.insert([*old_audio, *hyp("gamma", 1.0)]) == []
    assert texts(agreement.tentative) == ["gamma"]


def test_punctuation_only_tokens_are_neither_compared_nor_committed() -> None:
    agreement = LocalAgreement()
    agreement.insert([*hyp("yes"), Word(" -", 0.45, 0.5)])
    committed = agreement.commit_all([*hyp("yes"), Word(" -", 0.45, 0.5)])
    assert texts(committed) == ["yes"]


def test_commit_all_commits_the_rest_of_the_hypothesis() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("see you"))
    assert texts(agreement.insert(hyp("see you to"))) == ["see", "you"]
    rest = agreement.commit_all(hyp("see you tomorrow then"))
    assert texts(rest) == ["tomorrow", "then"]
    assert agreement.tentative == []
    assert agreement.last_committed_end == pytest.approx(1.9)
    assert texts(agreement.committed) == ["see", "you", "tomorrow", "then"]


def test_after_commit_all_the_next_window_starts_fresh() -> None:
    agreement = LocalAgreement()
    agreement.commit_all(hyp("first part"))
    agreement.insert(hyp("first part second", 0.0))
    committed = agreement.insert(hyp("first part second piece", 0.0))
    assert texts(committed) == ["second"]
    assert texts(agreement.committed) == ["first", "part", "second"]


def test_clear_tentative_forgets_the_previous_hypothesis() -> None:
    agreement = LocalAgreement()
    agreement.insert(hyp("maybe this"))
    agreement.clear_tentative()
    assert agreement.tentative == []
    assert agreement.insert(hyp("maybe this")) == []


def test_committed_history_is_bounded() -> None:
    agreement = LocalAgreement()
    many = " ".join(f"w{i}" for i in range(200))
    agreement.commit_all(hyp(many))
    assert 0 < len(agreement.committed) <= 64
    assert agreement.committed[-1].text == " w199"


def test_word_repeated_after_a_pause_is_committed_again() -> None:
    agreement = LocalAgreement()
    agreement.commit_all(hyp("Okay."))  # ends at 0.4 s
    after_pause = hyp("Okay, let us start", start=5.0)
    agreement.insert(after_pause)
    committed = agreement.insert(after_pause) + agreement.commit_all(after_pause)
    assert texts(committed) == ["Okay,", "let", "us", "start"]
