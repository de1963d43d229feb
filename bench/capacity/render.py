"""The capacity tables in README.md and docs/benchmarks.md, rendered from the kept results
(bench/results/capacity_h200/*.json, made by bench.capacity.strict on the H200, then
capacity_h100/*.json, the same bench where an H100 was what the device lent; each row
names its GPU).

    python -m bench.capacity.render            # rewrite the tables between the markers
    python -m bench.capacity.render --check    # exit 1 if a table and its files disagree

Nothing in a table is typed by hand: each row is one results file, and links to it.
tests/test_bench_strict.py fails when a table and its files disagree.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import tables  # noqa: E402
from bench.capacity import results, rule  # noqa: E402

FOLDERS = (ROOT / "bench" / "results" / "capacity_h200",
           ROOT / "bench" / "results" / "capacity_h100")
START = "<!-- capacity-table:start (bench/capacity/render.py writes this; do not edit) -->"
END = "<!-- capacity-table:end -->"
TARGETS = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")

HEADER = ("| run (GPU, file) | configuration | sessions | aged | arrivals | phase | keep up (rule) "
          "| by engine | frames/s p50 (min) | backlog p99 max | growth max "
          "| re-anchors in phase | control at 97 % | GPU busy p50 |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _f(x: Any, fmt: str = "{}") -> str:
    return "—" if x is None else fmt.format(x)


def gpu_of(data: dict[str, Any]) -> str:
    """The GPU's short name from the host fingerprint ("NVIDIA H100 80GB HBM3, …": H100)."""
    name = str((data.get("host") or {}).get("gpu") or "")
    found = re.search(r"\b([A-Z]\d{2,4})\b", name)
    return found.group(1) if found else "—"


def row(path: Path, data: dict[str, Any], relative_to: Path) -> str:
    v = data["verdict"]
    link = Path(os.path.relpath(path, relative_to))
    phase = (f"{v['phase_s']:.0f} s" if v["phase_long_enough"]
             else f"{v['phase_s']:.1f} s (short)")  # 299.6 must not read as 300
    keep = f"{v['keep_up']}/{v['sessions']}" + (
        " **pass**" if v["passes"]
        else " kept up, not counted (phase short)" if not v["phase_long_enough"]
        and v["keep_up_share"] >= rule.KNEE_SHARE else " fail")
    aged = ("new" if data.get("stock") or not data.get("age_min")
            else f"{data['age_min']:g} min, staggered" if data.get("stagger")
            else f"{data['age_min']:g} min")
    re = data.get("reanchors_in_phase") or {}
    reanchors = (f"{re.get('reanchors', 0)} ({re.get('requests_reanchored', 0)} sessions)"
                 if re else "—")
    control = ("none" if not v["controls"] else
               f"{v['controls_caught']}/{v['controls']} caught"
               + ("" if v["instrument_ok"] else " **instrument failed**"))
    # every run before the arrivals were recorded fed every session's chunk at one instant
    arrivals = data.get("arrivals") or "lockstep"
    if data.get("aligned_feed_ms"):
        arrivals += f", fed on a {data['aligned_feed_ms']} ms tick"
    engines = ", ".join(f"{fe['keep_up']}/{fe['sessions']}"
                        for fe in data.get("by_front_end") or [])
    return (f"| {data['date'][:10]} {gpu_of(data)} ([{path.name}]({link.as_posix()})) "
            f"| `{data['config']}` "
            f"| {data['streams']} | {aged} | {arrivals} | {phase} | {keep} | {engines or '—'} "
            f"| {_f(v['frames_per_s_p50'])} ({_f(v['frames_per_s_min'])}) "
            f"| {_f(v['backlog_p99_s_max'], '{:.2f} s')} "
            f"| {_f(v['backlog_growth_s_max'], '{:.2f} s')} | {reanchors} | {control} "
            f"| {_f(data.get('gpu_util_p50'), '{:g} %')} |")


def table(relative_to: Path, folder: Path | tuple[Path, ...] = FOLDERS) -> str:
    folders = (folder,) if isinstance(folder, Path) else folder
    rows = [row(p, d, relative_to) for f in folders
            for p, d in results.load(f, "capacity_strict")]
    if not rows:
        return HEADER + "\n| (no strict runs kept yet) |||||||||||||| "
    return HEADER + "\n" + "\n".join(rows)


def rendered(text: str, relative_to: Path,
             folder: Path | tuple[Path, ...] = FOLDERS) -> str:
    """`text` with its table between the markers replaced by the one from `folder`."""
    return tables.rendered(text, START, END, table(relative_to, folder))


def check(folder: Path | tuple[Path, ...] = FOLDERS,
          targets: tuple[Path, ...] = TARGETS) -> list[str]:
    """The files whose table differs from what `folder` renders."""
    return tables.stale(targets, START, END, lambda where: table(where, folder), ROOT)


def main() -> int:
    return tables.main(__doc__.split("\n\n")[0], TARGETS, START, END, table, check,
                       "capacity table differs from bench/results/capacity_h200 and _h100",
                       "python -m bench.capacity.render")


if __name__ == "__main__":
    sys.exit(main())
