"""The stall threshold on its own (virtual time): it learns bursts, forgets, ignores outages."""

from __future__ import annotations

import pytest

from workers.sessions.stall import INGEST_MARGIN_S, StallThreshold, asr_threshold, ingest_threshold

pytestmark = pytest.mark.unit


def deliver(t: StallThreshold, start: float, gaps: list[float]) -> float:
    """Arrivals separated by `gaps`, from `start`; returns the last arrival time."""
    now = start
    t.arrival(now)
    for gap in gaps:
        now += gap
        t.arrival(now)
    return now


def test_before_anything_is_learned_the_floor_holds() -> None:
    t = StallThreshold(1.0, 3.0)
    assert t.threshold_s(0.0) == 1.0
    assert t.silent_s(5.0) == 0.0  # nothing arrived yet: not silent, not started


def test_even_delivery_keeps_the_floor() -> None:
    t = StallThreshold(1.0, 3.0)
    now = deliver(t, 0.0, [0.1] * 100)
    assert t.threshold_s(now) == 1.0


def test_bursts_longer_than_the_floor_raise_the_threshold_above_them() -> None:
    t = StallThreshold(0.5, 3.0)
    # MPEG-TS-like: a few chunks at once, then ~0.4 s of nothing, and one 0.9 s hiccup.
    now = deliver(t, 0.0, [0.0, 0.0, 0.0, 0.4] * 10 + [0.9] + [0.0, 0.4] * 5)
    assert t.threshold_s(now) == pytest.approx(1.5 * 0.9)
    assert t.longest_gap_s == pytest.approx(0.9)


def test_a_learned_burst_is_forgotten_after_the_window() -> None:
    t = StallThreshold(1.0, 3.0, window_s=60.0)
    now = deliver(t, 0.0, [1.6])
    assert t.threshold_s(now) == pytest.approx(2.4)
    now = deliver(t, now + 0.1, [0.1] * 700)  # 70 s of even delivery
    assert t.threshold_s(now) == 1.0


def test_an_outage_longer_than_the_cap_teaches_nothing() -> None:
    t = StallThreshold(1.0, 3.0)
    now = deliver(t, 0.0, [0.1] * 10 + [20.0] + [0.1] * 10)
    assert t.threshold_s(now) == 1.0
    assert t.longest_gap_s == pytest.approx(0.1)


def test_the_threshold_never_exceeds_the_cap() -> None:
    t = StallThreshold(1.0, 3.0)
    now = deliver(t, 0.0, [2.9])
    assert t.threshold_s(now) == 3.0


def test_silence_is_counted_from_the_last_arrival() -> None:
    t = StallThreshold(1.0, 3.0)
    t.arrival(10.0)
    assert t.silent_s(12.5) == pytest.approx(2.5)


def test_ingest_moves_its_clock_before_the_asr_side_fills() -> None:
    """For every learned history the ASR side's threshold is at least the margin above
    ingest's (a gap only the ASR side still learns, between their caps, widens it)."""
    for gaps in ([], [0.1] * 20, [0.4] * 20, [0.6], [1.2], [1.9], [2.6], [2.9], [10.0]):
        ing, asr = ingest_threshold(), asr_threshold()
        now = 0.0
        for t in (ing, asr):
            now = deliver(t, 0.0, gaps)
        assert asr.threshold_s(now) - ing.threshold_s(now) >= INGEST_MARGIN_S - 1e-9


def test_a_floor_above_the_cap_is_refused() -> None:
    with pytest.raises(ValueError):
        StallThreshold(2.0, 1.0)
