"""The tick gather's decision (workers/engines/vllm/reanchor/gather.py), on the CPU.

The scheduler asks `hold(now, ready, parked, busy)` at each schedule() and reports what it
scheduled; these tests play the engine core's side of that conversation by hand. Whether
the gather saves engine-core time is a GPU measurement (bench.voxtral_capacity --ab with
`+gather`), not asserted here.
"""

from __future__ import annotations

import pytest

from workers.engines.vllm.reanchor.gather import QUIET_S, TickArrivals, TickGather

pytestmark = pytest.mark.unit

MS = 0.001


def steady(g: TickGather, sessions: int, t: float) -> float:
    """One tick whose chunks all came at once: scheduled in one step, no hold."""
    assert not g.hold(t, ready=sessions, parked=0, busy=False)
    g.scheduled(sessions)
    return t + 0.08


def test_off_never_holds() -> None:
    g = TickGather()
    assert not g.hold(0.0, ready=1, parked=24, busy=False)
    g.scheduled(1)
    assert not g.hold(0.001, ready=1, parked=23, busy=False)
    assert g.counts()["holds"] == 0


def test_the_first_tick_is_not_held_its_count_is_unknown() -> None:
    g = TickGather()
    g.switch(5)
    assert not g.hold(0.0, ready=3, parked=22, busy=False)
    assert g.counts()["ticks"] == 1 and g.counts()["holds"] == 0


def test_a_tick_is_held_until_as_many_chunks_wait_as_the_last_tick_carried() -> None:
    """25 sessions; the last tick carried 25 (one step of 3, the rest in a second): this
    tick's first step waits for all 25, then goes as one."""
    g = TickGather()
    g.switch(5)
    assert not g.hold(0.0, ready=3, parked=22, busy=False)  # first tick: as vLLM does
    g.scheduled(3)
    assert not g.hold(0.001, ready=22, parked=0, busy=True)  # the rest, behind it
    g.scheduled(22)
    t = 0.08
    assert g.hold(t, ready=3, parked=22, busy=False)
    g.scheduled(0)  # the empty step a hold makes
    assert g.hold(t + 1 * MS, ready=14, parked=11, busy=False)
    g.scheduled(0)
    assert not g.hold(t + 2 * MS, ready=25, parked=0, busy=False)
    g.scheduled(25)
    c = g.counts()
    assert (c["ticks"], c["held_ticks"], c["holds"], c["timed_out"]) == (2, 1, 2, 0)
    # the next tick expects 25 again
    assert g.hold(0.16, ready=20, parked=5, busy=False)


def test_a_hold_never_outlasts_the_window() -> None:
    """A session that never sends this tick (its stream stalled) costs the others the
    window, once, not a tick."""
    g = TickGather()
    g.switch(5)
    t = steady(g, 25, steady(g, 25, 0.0))
    assert g.hold(t, ready=24, parked=1, busy=False)
    g.scheduled(0)
    assert g.hold(t + 4.9 * MS, ready=24, parked=1, busy=False)
    g.scheduled(0)
    assert not g.hold(t + 5.0 * MS, ready=24, parked=1, busy=False)
    g.scheduled(24)
    assert g.counts()["timed_out"] == 1
    # the tick carried 24: the next waits for 24, so the stalled session holds no one
    assert not g.hold(t + 0.08, ready=24, parked=1, busy=False)


def test_a_busy_engine_is_never_held() -> None:
    """A step in flight (an engine behind, or a prefill going on): chunks go as they come,
    and no tick opens while it runs."""
    g = TickGather()
    g.switch(5)
    t = steady(g, 25, steady(g, 25, 0.0))
    assert not g.hold(t, ready=3, parked=22, busy=True)
    g.scheduled(3)
    assert g.counts()["ticks"] == 2  # none opened on the busy engine
    # once it is idle, the tick opens and waits for the rest
    assert g.hold(t + 1 * MS, ready=10, parked=12, busy=False)
    g.scheduled(0)
    # and a request running while the tick is held (vLLM's own work) ends the hold
    assert not g.hold(t + 2 * MS, ready=12, parked=10, busy=True)


def test_no_session_left_without_its_chunk_releases_at_once() -> None:
    """A session ended since the last tick: 24 wait and none is parked, so nothing can
    come; the step goes."""
    g = TickGather()
    g.switch(5)
    t = steady(g, 25, steady(g, 25, 0.0))
    assert not g.hold(t, ready=24, parked=0, busy=False)


def test_late_chunks_of_a_tick_count_towards_the_next_ones_target() -> None:
    """A tick whose step went at the window with 20, and 5 that came after it (behind the
    running step): the next tick waits for 25, not 20."""
    g = TickGather()
    g.switch(5)
    t = steady(g, 25, steady(g, 25, 0.0))
    assert g.hold(t, ready=10, parked=15, busy=False)
    g.scheduled(0)
    assert not g.hold(t + 5 * MS, ready=20, parked=5, busy=False)
    g.scheduled(20)
    assert not g.hold(t + 6 * MS, ready=5, parked=0, busy=True)
    g.scheduled(5)
    t += 0.08
    assert g.hold(t, ready=20, parked=5, busy=False)  # 25 carried last tick


def test_switching_forgets_the_last_tick_and_checks_the_window() -> None:
    g = TickGather()
    g.switch(5)
    t = steady(g, 25, steady(g, 25, 0.0))
    g.switch(5)
    assert not g.hold(t, ready=3, parked=22, busy=False)  # count unknown again
    with pytest.raises(ValueError, match="0-40"):
        g.switch(50)
    with pytest.raises(ValueError, match="0-40"):
        g.switch(-1)
    assert g.switch(0) == {"on": False, "window_ms": 0}
    assert not g.hold(t + 0.08, ready=3, parked=22, busy=False)


def test_arrivals_are_counted_from_each_ticks_first_chunk() -> None:
    """TickArrivals: a tick's chunks from the first after a quiet gap; each chunk's offset
    from that first in 1 ms bins, each closed tick's first-to-last spread."""
    a = TickArrivals()
    t = 100.0
    for _ in range(3):  # three ticks of six chunks 0.5 ms apart, 80 ms apart
        for i in range(6):
            a.arrived(t + i * 0.5 * MS)
        t += 0.080
    c = a.counts()
    assert c["chunks"] == 18 and c["ticks"] == 2  # the third is still open
    assert c["offset_ms"] == {"0": 6, "1": 6, "2": 6}
    assert c["spread_ms"] == {"2": 2}


def test_a_quiet_gap_starts_a_tick_and_no_tick_spans_more_than_80_ms() -> None:
    a = TickArrivals()
    a.arrived(0.0)
    a.arrived(0.019)  # 19 ms after: the same tick
    a.arrived(0.019 + QUIET_S)  # a quiet gap: a new tick
    assert a.counts()["ticks"] == 1 and a.counts()["spread_ms"] == {"19": 1}
    b = TickArrivals()  # without the tick, chunks one after another every 5 ms
    for i in range(40):
        b.arrived(1.0 + i * 0.005)
    c = b.counts()
    assert c["ticks"] == 2 and c["spread_ms"] == {"75": 2}
    assert max(int(k) for k in c["offset_ms"]) < 80
