"""A tick's chunks gathered into one engine step (an engine-core lever, `+gather` in the benches).

On the shared feed tick (`aligned_feed_ms`) an engine's caught-up sessions hand their
chunks to the front end in one turn of its event loop, but the front end sends them to
the engine core one message each, and an idle engine core starts a step on the first to
arrive. With vLLM's async scheduling the rest go into the next step, queued behind it:
on the H200 every engine took **two steps per 80 ms tick** (25.0-25.5 steps a second at
12.5 requests a step, 2026-12-05, bench/results/capacity_h200/), each with the engine
core's fixed cost (two levels fit ~10 ms of engine-core CPU per step and ~1.2 ms per
request: a fit of two points, not a measurement of either).

Switched on, the scheduler holds an idle engine's first step of a tick, for at most the
window, until as many chunks wait as the last tick carried (or no session is left
without its chunk). Then one step takes them all. Never held:
- a busy engine (a request running: a step in flight or a prefill going on), so an engine
  that is behind is never slowed;
- past the window from the first chunk it saw, so a late or missing session costs at
  most the window, once a tick;
- when the last tick's count is unknown (the first tick, or after the lever is switched).
While it holds, the scheduler returns an empty step (vLLM's own `PAUSED_NEW`: waiting
requests are not scheduled, running ones would be), and the engine core polls its inputs
again a millisecond later.

First run on a GPU on 2026-12-05 (bench/results/gather_h100/: one engine on an H100, 25
new sessions on the tick, 60 s with and 60 s without): one step a tick instead of two
(12.6 steps a second against 25.0; all 26 sessions in 747 of 783 steps), 1.94 x less
engine-core CPU per chunk (611 against 1,185 us), the sessions' backlog 48 ms lower, 3 %
of ticks released by the window. At 48 aged sessions on one H100 engine (2026-12-07,
bench/results/capacity_h100/) the 5 ms window ran out in 99.7 % of ticks: the tick's
chunks reached the engine core over longer than that, the tick still took two steps
(~7 requests, then ~41) and engine-core CPU per chunk fell only 8 %. Off by default
(`engine.vllm.tick_gather_ms`, the engine option `tick_gather_ms`, a benchmark's
`+gather`): what it is worth at the H200's knee needs a strict level with it and the same
level without, on one H200 host, with a window that covers the tick's spread (`python -m
bench.capacity.strict --config …+gather`). This module imports no vLLM: the logic is
tested on the CPU (tests/test_tick_gather.py), the scheduler applies it (scheduler.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

MAX_WINDOW_MS = 40
"""The longest window the gather takes: half a tick (the engine option, the event file's
`engine.vllm.tick_gather_ms` and `bench.capacity.strict --gather-ms` are bounded by it)."""


@dataclass
class TickGather:
    """One engine core's gather state. The worker switches it (collective_rpc, worker
    thread), the scheduler consults it (engine-core thread): `switch` and `counts` take
    the lock; `hold` and `scheduled` run in the scheduler's thread only."""

    window_s: float = 0.0  # 0: off
    holds: int = 0  # schedule() calls that held
    ticks: int = 0  # ticks that began with the engine idle
    held_ticks: int = 0  # of those, ticks whose first step was held at least once
    timed_out: int = 0  # held ticks released by the window, not by the count
    _opened: float | None = None  # when this tick's first chunk was seen
    _target: int = 0  # chunks to wait for this tick
    _last_tick: int = 0  # requests scheduled from the last tick's start to this one's
    _since_open: int = 0  # requests scheduled since the last tick opened
    _held_this: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def switch(self, window_ms: float) -> dict[str, Any]:
        if window_ms < 0 or window_ms > MAX_WINDOW_MS:
            raise ValueError(f"the gather's window must be 0-{MAX_WINDOW_MS:g} ms (half a tick), "
                             f"not {window_ms}")
        with self._lock:
            self.window_s = window_ms / 1000
            self._opened, self._last_tick, self._since_open = None, 0, 0
        return {"on": window_ms > 0, "window_ms": window_ms}

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {"window_ms": round(self.window_s * 1000, 3), "ticks": self.ticks,
                    "held_ticks": self.held_ticks, "holds": self.holds,
                    "timed_out": self.timed_out}

    def hold(self, now: float, ready: int, parked: int, busy: bool) -> bool:
        """Whether this schedule() should leave the waiting chunks for a moment.
        `ready`: requests waiting to be scheduled; `parked`: streaming sessions still
        without their next chunk; `busy`: a request is running."""
        if self.window_s <= 0 or ready == 0:
            return False
        if self._opened is None:
            if busy:
                return False  # no tick starts on a busy engine: its chunks go as they come
            self._opened = now
            self._last_tick, self._since_open = self._since_open, 0
            self._target = min(self._last_tick, ready + parked)
            self._held_this = False
            self.ticks += 1
        if busy or ready >= self._target or parked == 0:
            return False
        if now - self._opened >= self.window_s:
            if self._held_this:
                self.timed_out += 1
                self._held_this = False  # counted once
            return False
        if not self._held_this:
            self.held_ticks += 1
            self._held_this = True
        self.holds += 1
        return True

    def scheduled(self, requests: int) -> None:
        """After a schedule(): `requests` were scheduled (0 for an empty step). A tick
        ends at its first step with requests; what comes after it counts towards it
        until the next tick opens."""
        if self._opened is None:
            self._since_open += requests
            return
        if requests:
            self._since_open += requests
            self._opened = None
            self._held_this = False


GATHER = TickGather()
"""This engine-core process's gather (the worker switches it, the scheduler reads it)."""


QUIET_S = 0.020
"""A chunk that comes this long after the one before starts a new tick's arrivals."""
TICK_S = 0.080
"""A tick's arrivals never span more than a tick: without the tick (`aligned_feed_ms: 0`)
chunks come one after another and every 80 ms counts as a tick."""
OFFSET_MAX_MS = 80
_EPS = 1e-9  # a sum of float steps that is 2 ms in the arithmetic counts as 2 ms, not 1.999…


@dataclass
class TickArrivals:
    """When the scheduler sees each chunk, counted from its tick's first (an instrument
    for the gather's window: how many of a tick's chunks a window of W ms would hold for).
    A tick's arrivals are the chunks from one after a quiet gap (`QUIET_S`) to the next such
    gap, at most `TICK_S` long. Timestamps are taken in the scheduler's `add_request`, in
    the engine-core thread: while a step runs, chunks wait in vLLM's input queue and are
    seen after it, so the figures read as arrivals only while the engine is idle or
    holding (with the gather on). `offset_ms`: chunks by ms after their tick's first (1 ms
    bins, 0-79: a tick is cut at 80 ms); `spread_ms`: closed ticks by first-to-last;
    `ticks`, `chunks`: how many."""

    ticks: int = 0
    chunks: int = 0
    offset_ms: dict[int, int] = field(default_factory=dict)
    spread_ms: dict[int, int] = field(default_factory=dict)
    _first: float | None = None
    _last: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def arrived(self, now: float) -> None:
        with self._lock:
            first = self._first
            if (first is None or now - self._last >= QUIET_S - _EPS
                    or now - first >= TICK_S - _EPS):
                self._close()
                self._first = first = now
            self._last = now
            self.chunks += 1
            b = min(OFFSET_MAX_MS, int((now - first) * 1000 + _EPS))
            self.offset_ms[b] = self.offset_ms.get(b, 0) + 1

    def _close(self) -> None:
        if self._first is not None:
            self.ticks += 1
            b = min(OFFSET_MAX_MS, int((self._last - self._first) * 1000 + _EPS))
            self.spread_ms[b] = self.spread_ms.get(b, 0) + 1

    def counts(self) -> dict[str, Any]:
        """Closed ticks only in `spread_ms` and `ticks`; every chunk seen in the rest."""
        with self._lock:
            return {"ticks": self.ticks, "chunks": self.chunks,
                    "offset_ms": {str(k): v for k, v in sorted(self.offset_ms.items())},
                    "spread_ms": {str(k): v for k, v in sorted(self.spread_ms.items())}}


ARRIVALS = TickArrivals()
"""This engine-core process's arrivals (the scheduler stamps them, the worker reports)."""
