"""Line breaking for display: widths, scrolling, and where a line may end."""

from __future__ import annotations

import random

import pytest

from workers.captions.linebreak import (
    CEA608,
    PROFILES,
    WEB,
    YOUTUBE,
    LineProfile,
    break_lines,
    get_profile,
    pages,
    rules,
    wrap,
)

pytestmark = pytest.mark.unit

_VOCABULARY = (
    "a I of the to and we le la de house market tomorrow conference interoperability "
    "internationalisation well, yes. really? however; note: l'homme aujourd'hui "
    "rendez-vous Mr. Dr. broadcasting subtitles captions x"
).split()


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(n_words))


@pytest.mark.parametrize("profile", [WEB, CEA608], ids=lambda p: p.name)
@pytest.mark.parametrize("lang", ["en", "fr"])
def test_no_line_is_wider_than_the_profile(profile: LineProfile, lang: str) -> None:
    rng = random.Random(f"{profile.name}-{lang}")
    for _ in range(300):
        text = random_text(rng, rng.randint(1, 80))
        lines = wrap(text, profile.width, lang)
        too_wide = [line for line in lines if len(line) > profile.width]
        assert not too_wide, f"lines wider than {profile.width}: {too_wide!r}"


@pytest.mark.parametrize("profile", [WEB, CEA608], ids=lambda p: p.name)
def test_wrapping_keeps_every_word_in_order(profile: LineProfile) -> None:
    rng = random.Random(profile.name)
    for _ in range(300):
        text = random_text(rng, rng.randint(1, 80))
        lines = wrap(text, profile.width)
        assert " ".join(lines).split() == text.split()


def test_lines_have_no_leading_or_trailing_spaces() -> None:
    rng = random.Random(7)
    for _ in range(100):
        for line in wrap("  " + random_text(rng, 40) + "  ", 42):
            assert line == line.strip() and line


def test_text_that_fits_stays_on_one_line() -> None:
    assert wrap("Good morning, everyone.", 42) == ["Good morning, everyone."]
    assert break_lines("Good morning, everyone.", WEB) == ("Good morning, everyone.",)


def test_a_line_may_be_exactly_as_wide_as_the_profile() -> None:
    text = "x" * 20 + " " + "y" * 21  # 42 characters
    assert wrap(text, 42) == [text]


@pytest.mark.parametrize("profile", [WEB, CEA608], ids=lambda p: p.name)
def test_display_shows_only_the_last_lines(profile: LineProfile) -> None:
    text = " ".join(f"word{i:02d}" for i in range(60))  # many lines at any width
    lines = wrap(text, profile.width)
    assert len(lines) > profile.max_lines
    shown = break_lines(text, profile)
    assert shown == tuple(lines[-profile.max_lines :])
    assert len(shown) == profile.max_lines == 2
    assert shown[-1].endswith("word59")
    assert "word00" not in " ".join(shown)


def test_display_of_random_text_never_exceeds_two_lines_of_the_profile() -> None:
    rng = random.Random(42)
    for profile in (WEB, CEA608):
        for _ in range(200):
            shown = break_lines(random_text(rng, rng.randint(0, 60)), profile)
            assert len(shown) <= 2
            assert all(len(line) <= profile.width for line in shown)


def test_empty_text_has_no_lines() -> None:
    assert wrap("", 42) == []
    assert break_lines("", WEB) == ()
    assert break_lines("   ", CEA608) == ()


def test_break_after_punctuation_is_preferred() -> None:
    # Greedy filling would give "When the long meeting ended, everybody" | "walked out…".
    assert wrap("When the long meeting ended, everybody walked out into the rain", 42) == [
        "When the long meeting ended,",
        "everybody walked out into the rain",
    ]
    assert wrap("The speakers arrived early, so the session began before nine", 42) == [
        "The speakers arrived early,",
        "so the session began before nine",
    ]


def test_break_after_punctuation_is_not_taken_when_it_leaves_a_short_line() -> None:
    # "Yes," is far shorter than the line could be: a one-word line reads worse.
    lines = wrap("Yes, the speakers arrived early and the session began before nine", 42)
    assert lines[0] != "Yes,"
    assert all(len(line) <= 42 for line in lines)


@pytest.mark.parametrize(
    ("text", "lang", "expected"),
    [
        pytest.param(
            "Yesterday my sister finally repainted the kitchen walls",
            "en",
            ["Yesterday my sister finally repainted", "the kitchen walls"],
            id="en-the",
        ),
        pytest.param(
            "Last night my cousin from Boston adopted a puppy",
            "en",
            ["Last night my cousin from Boston adopted", "a puppy"],
            id="en-a",
        ),
        pytest.param(
            "Our neighbours planted twenty long rows of tomatoes",
            "en",
            ["Our neighbours planted twenty long rows", "of tomatoes"],
            id="en-of",
        ),
        pytest.param(
            "Hier après-midi mon petit frère a lavé le vélo rouge",
            "fr",
            ["Hier après-midi mon petit frère a lavé", "le vélo rouge"],
            id="fr-le",
        ),
        pytest.param(
            "Ce matin toute notre famille a visité la cathédrale",
            "fr",
            ["Ce matin toute notre famille a visité", "la cathédrale"],
            id="fr-la",
        ),
        pytest.param(
            "Nous avons longuement parlé hier soir de politique",
            "fr",
            ["Nous avons longuement parlé hier soir", "de politique"],
            id="fr-de",
        ),
    ],
)
def test_weak_word_is_not_left_at_a_line_end(text: str, lang: str, expected: list[str]) -> None:
    greedy_first_line = text[: text.rfind(" ", 0, 43)]
    weak = greedy_first_line.split()[-1]
    assert weak in {"the", "a", "of", "le", "la", "de"}, "the example must tempt the breaker"
    assert wrap(text, 42, lang) == expected


def test_weak_words_follow_the_language() -> None:
    # "de" is a weak word in French only; in English the line is filled as usual.
    text = "Nous avons longuement parlé hier soir de politique"
    assert wrap(text, 42, "en") == ["Nous avons longuement parlé hier soir de", "politique"]
    assert wrap(text, 42, "fr-CA") == ["Nous avons longuement parlé hier soir", "de politique"]


def test_single_over_long_word_is_cut_at_the_width() -> None:
    word = "a" * 50 + "b" * 50
    lines = wrap(word, 42)
    assert lines == [word[:42], word[42:84], word[84:]]
    assert "".join(lines) == word


def test_over_long_word_between_short_words_is_cut_and_its_neighbours_kept() -> None:
    long_word = "z" * 70
    lines = wrap(f"see {long_word} now", 32)
    assert all(len(line) <= 32 for line in lines)
    assert "".join(" ".join(lines).split()) == f"see{long_word}now"
    assert lines[0] == "see"


def test_cea608_profile_is_32_by_2_and_web_is_42_by_2() -> None:
    assert (WEB.width, WEB.max_lines) == (42, 2)
    assert (CEA608.width, CEA608.max_lines) == (32, 2)


# --- profiles per output, and rules added for the outputs ------------------------------


def test_each_output_has_a_profile_found_by_name() -> None:
    assert get_profile("web") is WEB and get_profile("cea608") is CEA608
    assert get_profile("youtube") is YOUTUBE
    assert (YOUTUBE.width, YOUTUBE.max_lines) == (32, 2)
    assert WEB.max_cps == 17.0, "the reading-speed hint of the web profile"
    assert set(PROFILES) == {"web", "cea608", "youtube"}


def test_unknown_profile_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown line-breaking profile 'tv'; known: "
                                         "cea608, web, youtube"):
        get_profile("tv")


def test_subject_pronoun_stays_with_its_verb() -> None:
    # Greedy filling ends the first line with "we" (39 characters).
    assert wrap("After the keynote on Tuesday morning we went out for lunch", 42) == [
        "After the keynote on Tuesday morning",
        "we went out for lunch",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("Pourquoi personne ne nous a prévenus hier ?",
                     ["Pourquoi personne ne nous a prévenus", "hier ?"], id="question-mark"),
        pytest.param("Le directeur a simplement répondu : « Non merci »",
                     ["Le directeur a simplement répondu :", "« Non merci »"], id="guillemets"),
    ],
)
def test_french_spaced_punctuation_never_starts_or_ends_a_line_alone(
    text: str, expected: list[str]
) -> None:
    lines = wrap(text, 42, "fr")
    assert lines == expected
    assert not any(line.startswith(("?", "!", ":", ";", "»")) for line in lines)
    assert not any(line.endswith("«") for line in lines)


def test_spaced_punctuation_is_not_glued_when_the_pair_would_not_fit() -> None:
    word = "x" * 32
    assert wrap(f"{word} ?", 32, "fr") == [word, "?"]


@pytest.mark.parametrize("profile", [WEB, CEA608, YOUTUBE], ids=lambda p: p.name)
def test_pages_show_all_of_a_text_in_screens_of_the_profile(profile: LineProfile) -> None:
    rng = random.Random(f"pages-{profile.name}")
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 80))
        screens = pages(text, profile, "fr")
        assert all(1 <= len(s) <= profile.max_lines for s in screens)
        assert [line for s in screens for line in s] == wrap(text, profile.width, "fr")
        assert " ".join(line for s in screens for line in s).split() == text.split()


def test_rules_for_the_browser_are_the_rules_used_here() -> None:
    data = rules()
    weak = data["weak"]
    assert isinstance(weak, dict)
    assert "the" in weak["en"] and "la" in weak["fr"]
    assert data["glueBack"] and data["glueForward"] == "«"
