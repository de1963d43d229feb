"""Real time means keeping up, sustained (issue 34).

A session *keeps up* over a measured phase when
- its backlog at the end exceeds its backlog at the start by less than `GROWTH_MAX_S`, and
- its 99th-percentile backlog over the phase is at most `P99_MAX_S`,
where its backlog at a moment is the audio a real-time sender had sent by then minus the
audio the engine had decoded (one output per 80 ms frame), both counted from the phase's
feed start. "At the start" and "at the end" are means over the phase's first and last
`EDGE_S` (the instantaneous backlog moves by a frame or two with every step).

Why these bounds: a session at 12.1 frames/s (97 % of real time) passes any frames/s
threshold of 12.0 and falls 130 s behind in an hour, past the actor's 60 s input queue;
over a 5-minute phase it grows 9.6 s, and this rule fails it. The rule fails any session
slower than 1 - 0.5 / 300 = 99.83 % of real time over 5 minutes (at most 6 s behind per
hour, caught up by the first pause). The p99 bound is a caption budget: text a second
after the words is the most a live overlay should add on top of the model's delay.

The knee is the largest number of sessions at which at least `KNEE_SHARE` of them keep
up, every smaller level measured also passing (climbing stops at the first miss).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

FRAME_S = 0.08
GROWTH_MAX_S = 0.5
P99_MAX_S = 1.0
MIN_PHASE_S = 300.0
KNEE_SHARE = 0.99
EDGE_S = 2.0
SAMPLE_S = 0.25

RULE: dict[str, Any] = {
    "name": "keeps_up",
    "growth_max_s": GROWTH_MAX_S,
    "backlog_p99_max_s": P99_MAX_S,
    "min_phase_s": MIN_PHASE_S,
    "knee_share": KNEE_SHARE,
    "edge_s": EDGE_S,
    "sample_s": SAMPLE_S,
    "text": ("a session keeps up when its backlog (audio sent by a real-time sender minus "
             "audio decoded) at the phase's end exceeds its backlog at the start by "
             f"< {GROWTH_MAX_S} s (means over the first and last {EDGE_S} s) and its p99 "
             f"backlog is <= {P99_MAX_S} s, over a phase of >= {MIN_PHASE_S:.0f} s after "
             f"warm-up; the knee is the largest N where >= {KNEE_SHARE:.0%} of sessions "
             "keep up, every smaller level measured passing too"),
}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def session_verdict(times: Sequence[float], backlog_s: Sequence[float],
                    decoded_frames: float | None = None) -> dict[str, Any]:
    """One session's figures over a measured window from its samples: `times` (seconds,
    increasing) and the backlog at each (seconds). `decoded_frames` (outputs over the
    window) gives frames/s."""
    if len(times) != len(backlog_s) or len(times) < 2:
        raise ValueError("a session's window needs two or more samples, times and backlogs "
                         "paired")
    t0, t1 = times[0], times[-1]
    span = t1 - t0
    edge = min(EDGE_S, span / 4)
    head = [b for t, b in zip(times, backlog_s, strict=True) if t <= t0 + edge]
    tail = [b for t, b in zip(times, backlog_s, strict=True) if t >= t1 - edge]
    start, end = sum(head) / len(head), sum(tail) / len(tail)
    p99 = percentile(backlog_s, 0.99)
    growth = end - start
    peak = max(range(len(backlog_s)), key=backlog_s.__getitem__)
    # how long the backlog stayed past the p99 bound: each sample stands for the time to
    # the next one (a stall of several seconds, or a steady deficit, reads differently)
    over = sum(t_next - t for t, t_next, b in zip(times, times[1:], backlog_s, strict=False)
               if b > P99_MAX_S)
    out = {
        "backlog_start_s": round(start, 3), "backlog_end_s": round(end, 3),
        "backlog_growth_s": round(growth, 3), "backlog_p99_s": round(p99, 3),
        "keeps_up": growth < GROWTH_MAX_S and p99 <= P99_MAX_S,
        # where the worst moment was, seconds into the window: to line a stall up with
        # re-anchors, other engines or the host
        "backlog_max_s": round(backlog_s[peak], 3),
        "backlog_max_at_s": round(times[peak] - t0, 2),
        "backlog_over_bound_s": round(over, 2),
    }
    if decoded_frames is not None and span > 0:
        out["frames_per_s"] = round(decoded_frames / span, 3)
    return out


def phase_verdict(sessions: Sequence[Mapping[str, Any]], seconds: float,
                  controls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A phase's share of sessions keeping up; whether the phase was long enough for the
    rule; and whether every negative control (a session made to decode below real time on
    purpose) was caught. A control that passes means the instrument cannot be trusted."""
    n = len(sessions)
    kept = sum(1 for s in sessions if s["keeps_up"])
    fps = [s["frames_per_s"] for s in sessions if s.get("frames_per_s") is not None]
    return {
        "sessions": n,
        "keep_up": kept,
        "keep_up_share": round(kept / n, 4) if n else 0.0,
        "passes": bool(n) and kept / n >= KNEE_SHARE and seconds >= MIN_PHASE_S,
        "phase_s": round(seconds, 1),
        "phase_long_enough": seconds >= MIN_PHASE_S,
        "frames_per_s_p50": round(percentile(fps, 0.5), 3) if fps else None,
        "frames_per_s_min": round(min(fps), 3) if fps else None,
        "backlog_p99_s_max": max((s["backlog_p99_s"] for s in sessions), default=None),
        "backlog_growth_s_max": max((s["backlog_growth_s"] for s in sessions), default=None),
        "controls": len(controls),
        "controls_caught": sum(1 for c in controls if not c["keeps_up"]),
        "instrument_ok": all(not c["keeps_up"] for c in controls) if controls else None,
    }


def knee(levels: Mapping[int, Mapping[str, Any]]) -> int | None:
    """The largest N whose phase passes, every smaller measured N passing too; None when
    the smallest fails or a phase's control went uncaught (the figure cannot be trusted)."""
    found = None
    for n in sorted(levels):
        v = levels[n]
        if v.get("instrument_ok") is False or not v.get("passes"):
            break
        found = n
    return found
