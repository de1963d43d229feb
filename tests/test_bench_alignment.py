"""bench.alignment: errors are counted where they happen, not as whole-talk differences."""

from __future__ import annotations

import pytest

from bench.alignment import TimedToken, seam_errors

pytestmark = pytest.mark.unit

WORDS = [f"w{i}" for i in range(60)]  # one reference word per second


def timed(tokens: list[str], times: list[float]) -> list[TimedToken]:
    return [TimedToken(t, s) for t, s in zip(tokens, times, strict=True)]


def baseline_with_errors_far_from_the_seam() -> list[TimedToken]:
    """The run without rollovers: 5 words dropped and 2 extra words, all around 50 s."""
    tokens = [w for i, w in enumerate(WORDS) if not 45 <= i < 50]
    times = [float(WORDS.index(w)) for w in tokens]
    tokens[40:40] = ["um", "uh"]
    times[40:40] = [44.5, 44.6]
    return timed(tokens, times)


def test_a_loss_at_the_seam_is_not_cancelled_by_fewer_errors_elsewhere() -> None:
    # With rollovers: 3 words lost at the switch at 21 s and 2 doubled at the one at 35 s,
    # and none of the baseline's errors near 50 s. Whole-talk totals are 3 vs 5 deletions
    # and 2 vs 2 insertions, which a difference of totals clamped at 0 reported as 0 and 0.
    tokens = [w for i, w in enumerate(WORDS) if i not in (20, 21, 22)]
    times = [float(WORDS.index(w)) for w in tokens]
    at = tokens.index("w35")
    tokens[at:at] = ["w33", "w34"]  # the old session's last words again
    times[at:at] = [35.0, 35.0]
    seams = seam_errors(WORDS, timed(tokens, times), baseline_with_errors_far_from_the_seam(),
                        switches=[21.0, 35.0], window_s=3.0)
    assert seams["lost_words"] == 3
    assert seams["doubled_words"] == 2
    assert seams["seam_errors"] == 5


def test_figures_are_signed_when_the_baseline_did_worse_at_the_seam() -> None:
    clean = timed(WORDS, [float(i) for i in range(60)])
    seams = seam_errors(WORDS, clean, baseline_with_errors_far_from_the_seam(),
                        switches=[47.0], window_s=3.0)
    assert seams["lost_words"] < 0
    assert seams["doubled_words"] < 0


def test_errors_outside_every_window_do_not_count() -> None:
    clean = timed(WORDS, [float(i) for i in range(60)])
    seams = seam_errors(WORDS, baseline_with_errors_far_from_the_seam(), clean,
                        switches=[10.0, 30.0], window_s=3.0)
    assert seams == {**seams, "lost_words": 0, "doubled_words": 0}
