"""Word-by-word alignment of timed hypotheses to a reference, for counting errors by place.

A whole-talk count of deletions and insertions cannot say where they happened: three words
lost at a rollover seam and three fewer errors elsewhere add up to nothing. Here each
hypothesis is aligned to the reference word by word (jiwer's Levenshtein alignment); every
reference word gets an audio time from the hypothesis word it was matched to (equal or
substituted; the words in between are interpolated), and every error gets the time of the
reference word it concerns (an insertion: its own time). Errors can then be counted in
time windows, e.g. a few seconds either side of each rollover switch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jiwer


@dataclass(frozen=True, slots=True)
class TimedToken:
    text: str  # already normalised, one token
    t_s: float  # audio time (stream seconds)


@dataclass(frozen=True, slots=True)
class Error:
    kind: str  # "del" | "ins" | "sub"
    t_s: float


def align(ref: list[str], hyp: list[TimedToken]) -> tuple[list[float | None], list[Error]]:
    """Per reference token the time of the hypothesis token matched to it (None if deleted),
    and every error with a time (deletions: None for now, see `reference_times`)."""
    times: list[float | None] = [None] * len(ref)
    errors: list[Error] = []
    if not ref:
        return times, [Error("ins", h.t_s) for h in hyp]
    if not hyp:
        return times, [Error("del", float("nan")) for _ in ref]
    out = jiwer.process_words(" ".join(ref), " ".join(h.text for h in hyp))
    for chunk in out.alignments[0]:
        if chunk.type in ("equal", "substitute"):
            for k in range(chunk.ref_end_idx - chunk.ref_start_idx):
                times[chunk.ref_start_idx + k] = hyp[chunk.hyp_start_idx + k].t_s
                if chunk.type == "substitute":
                    errors.append(Error("sub", hyp[chunk.hyp_start_idx + k].t_s))
        elif chunk.type == "insert":
            errors.extend(Error("ins", hyp[j].t_s)
                          for j in range(chunk.hyp_start_idx, chunk.hyp_end_idx))
        elif chunk.type == "delete":
            # Placed below, once every reference word has a time.
            errors.extend(Error("del", -1.0 - i)
                          for i in range(chunk.ref_start_idx, chunk.ref_end_idx))
    return times, errors


def reference_times(*runs: list[float | None]) -> list[float]:
    """One time per reference word: the first run that matched it, else interpolated
    between the nearest matched neighbours (or copied from the one neighbour there is)."""
    n = len(runs[0])
    times: list[float | None] = [next((r[i] for r in runs if r[i] is not None), None)
                                 for i in range(n)]
    known = [i for i, t in enumerate(times) if t is not None]
    if not known:
        return [0.0] * n
    out: list[float] = []
    for i, t in enumerate(times):
        if t is not None:
            out.append(t)
            continue
        before = max((k for k in known if k < i), default=None)
        after = min((k for k in known if k > i), default=None)
        if before is None:
            out.append(times[after])  # type: ignore[index,arg-type]
        elif after is None:
            out.append(times[before])  # type: ignore[arg-type]
        else:
            tb, ta = times[before], times[after]
            assert tb is not None and ta is not None
            out.append(tb + (ta - tb) * (i - before) / (after - before))
    return out


def placed(errors: list[Error], ref_times: list[float]) -> list[Error]:
    """Deletions get their reference word's time."""
    return [Error(e.kind, ref_times[int(-e.t_s - 1.0)]) if e.kind == "del" else e
            for e in errors]


def count_near(errors: list[Error], points: list[float], window_s: float) -> dict[str, int]:
    """Errors of each kind within `window_s` of any of `points` (each error once)."""
    counts = {"del": 0, "ins": 0, "sub": 0}
    for e in errors:
        if any(abs(e.t_s - p) <= window_s for p in points):
            counts[e.kind] += 1
    return counts


def seam_errors(ref: list[str], with_rollover: list[TimedToken], without: list[TimedToken],
                switches: list[float], window_s: float = 3.0) -> dict[str, int]:
    """Words lost and doubled at rollover switches: deletions and insertions within
    `window_s` of a switch in the run with rollovers, minus the run without rollovers'
    count in the same windows. Signed and unclamped: a negative figure means the seams did
    better than the baseline there (noise of the same size as the figures themselves)."""
    t_with, e_with = align(ref, with_rollover)
    t_without, e_without = align(ref, without)
    times = reference_times(t_without, t_with)
    near_with = count_near(placed(e_with, times), switches, window_s)
    near_without = count_near(placed(e_without, times), switches, window_s)
    return {
        "lost_words": near_with["del"] - near_without["del"],
        "doubled_words": near_with["ins"] - near_without["ins"],
        "substituted_words": near_with["sub"] - near_without["sub"],
        # A word doubled where one was lost aligns as a substitution: all three together.
        "seam_errors": sum(near_with.values()) - sum(near_without.values()),
        "deletions_near_switches": near_with["del"],
        "insertions_near_switches": near_with["ins"],
        "baseline_deletions_there": near_without["del"],
        "baseline_insertions_there": near_without["ins"],
    }


def matched_ref_index(ref: list[str], hyp: list[str]) -> list[int | None]:
    """For each hypothesis token, the reference token it was aligned to (equal or
    substituted), None for an insertion."""
    out: list[int | None] = [None] * len(hyp)
    if not ref or not hyp:
        return out
    for chunk in jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]:
        if chunk.type in ("equal", "substitute"):
            for k in range(chunk.hyp_end_idx - chunk.hyp_start_idx):
                out[chunk.hyp_start_idx + k] = chunk.ref_start_idx + k
    return out
