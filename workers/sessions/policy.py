"""What a session manager is told, and the names of what it reports.

`SessionPolicy` sets how the manager (`workers.sessions.manager`) keeps a stream
captioned: session budgets and warm rollovers, the rut watchdog, the stall threshold and
filler, restarts and shedding. `session_budget` clamps the configured budget to the
engine's own limit, and `jittered_budget` shortens it for each session.
`ROLLOVER_REASONS` and `SKIP_REASONS` name the manager's counters.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from workers.engines.base import EngineCapabilities
from workers.sessions.watchdog import RutPolicy

log = logging.getLogger(__name__)

ROLLOVER_REASONS = ("budget", "rut", "engine_error", "gap", "shed")
"""Why a session was replaced (counters `rollovers_<reason>`)."""
SKIP_REASONS = ("replacement", "queue_full", "shed")
"""Why speech was skipped, never captioned (counters `skipped_s_<reason>`): see the
session manager's module doc (replacement), `INPUT_QUEUE_MAX` (queue_full) and
`SessionPolicy.shed_after_s` (shed)."""
SHED_LEAD_S = 1
"""A session that sheds to the live edge starts this many seconds before the newest
audio (a rollover's `overlap_s` would start it that much behind)."""


def session_budget(configured: float | None, caps: EngineCapabilities) -> float | None:
    """Audio seconds per engine session: the configured budget, never past the
    engine's own limit; none for engines that re-anchor (unless configured)."""
    if configured is None:
        return None if caps.reanchors_natively else caps.max_session_s
    if caps.max_session_s is not None and configured > caps.max_session_s:
        log.warning("session budget %.0f s is past the engine's limit; using %.0f s",
                    configured, caps.max_session_s)
        return caps.max_session_s
    return configured


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    budget_s: float | None = None
    """Audio seconds one engine session may take; None: the engine's own capability.
    Never more than the engine's own limit (it is clamped to it)."""
    budget_jitter: float = 0.1
    """Each session's budget is shortened by a random fraction up to this."""
    margin_s: float = 30.0
    """Start a warm rollover this long before the budget runs out."""
    overlap_s: float = 5.0
    """Audio the new session re-reads before the switch."""
    switch_pause_s: float = 0.25
    """Minimum pause (voice activity) that a switch point may sit in."""
    rut: RutPolicy = field(default_factory=RutPolicy)
    stall_s: float = 1.0
    """Floor of the stall threshold, which learns the transport's bursts (sessions/stall.py)."""
    stall_max_s: float = 3.0
    """Cap of the learned stall threshold: a source silent this long is always stalled."""
    dither_lsb: int = 2
    max_fill_s: float = 10.0
    restart_backoff_s: float = 1.0
    max_backoff_s: float = 10.0
    tick_s: float = 0.05
    shed_after_s: float | None = None
    """The shedding policy. None (the default): keep the backlog: every word is captioned,
    late, up to what a session's input queue holds (~60 s; past it the oldest audio is
    dropped and counted as `queue_full`). A number: once the stream's captions are this
    many seconds behind (`caption_lag_s`), skip to the live edge: the session is replaced
    at the newest audio (less `SHED_LEAD_S`), and the audio between the last committed
    word and there is published as a `gap` event (seconds skipped) and counted as `shed`.
    A session is shed at most once per this many seconds of its audio."""


def jittered_budget(budget_s: float | None, policy: SessionPolicy, stream_id: str,
                    n: int) -> float | None:
    """Session `n`'s budget: `budget_s` shortened by a random part of `budget_jitter`."""
    if budget_s is None:
        return None
    # Seeded by stream and session: reproducible, yet different for every stream.
    cut = random.Random(f"{stream_id}:{n}").uniform(0, policy.budget_jitter)
    # Never so short that the warm rollover's margin and overlap no longer fit.
    floor = min(budget_s, policy.margin_s + policy.overlap_s + 1.0)
    return max(floor, budget_s * (1.0 - cut))
