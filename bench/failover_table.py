"""The failover tables in docs/failover.md and docs/benchmarks.md, rendered from the kept
results of bench.failover (bench/results/failover/*.json; how each was made is in that
folder's README.md).

    python -m bench.failover_table            # rewrite the tables between the markers
    python -m bench.failover_table --check    # exit 1 if a table and its files disagree

Each mode row is judged by issue 35's bound: the longest caption silence p95 within 5 s,
no word lost against the control, no final doubled, seq contiguous. The control row shows
whether the machine could caption its streams at all (on 2 cores it could not: the
silence there is the CPU's). tests/test_failover_table.py fails when a table is stale."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import tables  # noqa: E402

FOLDER = ROOT / "bench" / "results" / "failover"
START = "<!-- failover-table:start (bench/failover_table.py writes this; do not edit) -->"
END = "<!-- failover-table:end -->"
TARGETS = (ROOT / "docs" / "failover.md", ROOT / "docs" / "benchmarks.md")
BOUND_S = 5.0
HEADER = ("| run (file) | machine | mode | silence p50 / p95 | on a live actor p50 / p95 "
          "| words lost / doubled | finals doubled | seq | by the bound |\n"
          "|---|---|---|---|---|---|---|---|---|")


def load(folder: Path = FOLDER) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "control" in data and "modes" in data:
            out.append((path, data))
    return out


def _pair(a: Any, b: Any, unit: str = " s") -> str:
    return "–" if a is None else f"{a:g} / {b:g}{unit}"


def verdict(mode: str, m: dict[str, Any]) -> str:
    """What the row shows against the 5 s bound: `meets`, or what it missed."""
    p95 = m.get("longest_caption_silence_p95_s")
    if mode == "control":
        return ("streams captioned in time" if p95 is not None and p95 <= BOUND_S
                else "**control itself over 5 s**: the machine, not the failover")
    missed = []
    if not m.get("fault_happened", True):
        missed.append("no fault")
    if p95 is None or p95 > BOUND_S:
        missed.append(f"silence p95 {p95} s")
    if (m.get("words_lost_vs_control") or 0) > 0:
        missed.append(f"{m['words_lost_vs_control']} words lost")
    if m.get("finals_doubled"):
        missed.append("finals doubled")
    if not m.get("seq_contiguous"):
        missed.append("seq gap")
    return "meets" if not missed else "misses: " + ", ".join(missed)


def rows(path: Path, data: dict[str, Any], relative_to: Path) -> list[str]:
    link = Path(os.path.relpath(path, relative_to)).as_posix()
    machine = f"{data['cores']} cores" if data.get("cores") else "–"
    code = f", code {data['commit']}" if data.get("commit") else ""
    out = []
    for i, mode in enumerate(["control", *data["modes"]]):
        m = data[mode]
        run = f"[{path.stem}]({link}){code}" if i == 0 else "″"
        back = _pair(m.get("on_a_live_actor_after_p50_s"), m.get("on_a_live_actor_after_p95_s"))
        words = ("–" if mode == "control" else
                 f"{m.get('words_lost_vs_control')} / {m.get('words_doubled_vs_control')}")
        silence = _pair(m["longest_caption_silence_p50_s"], m["longest_caption_silence_p95_s"])
        out.append(f"| {run} | {machine if i == 0 else '″'} | {mode} | {silence} "
                   f"| {back} | {words} | {m['finals_doubled']} "
                   f"| {'contiguous' if m['seq_contiguous'] else '**gap**'} "
                   f"| {verdict(mode, m)} |")
    return out


def table(relative_to: Path, folder: Path = FOLDER) -> str:
    body = [r for path, data in load(folder) for r in rows(path, data, relative_to)]
    return HEADER + "\n" + ("\n".join(body) if body else "| (no runs kept yet) ||||||||| ")


def check(folder: Path = FOLDER, targets: tuple[Path, ...] = TARGETS) -> list[str]:
    return tables.stale(targets, START, END, lambda where: table(where, folder), ROOT)


def main() -> int:
    return tables.main(__doc__.split("\n\n")[0], TARGETS, START, END, table, check,
                       "failover table differs from bench/results/failover",
                       "python -m bench.failover_table")


if __name__ == "__main__":
    sys.exit(main())
