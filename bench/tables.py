"""Tables in the docs that a script writes from kept results, between two marker lines.

Each renderer (bench.capacity.render, bench.failover_table) gives its markers and a
function from a page's folder to the table; `rendered` puts the table between the markers,
`stale` lists the pages whose table differs from what the files render now (a test fails
on it: a table is never typed by hand)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def rendered(text: str, start: str, end: str, table: str) -> str:
    """`text` with what stands between the marker lines `start` and `end` replaced."""
    if start not in text or end not in text:
        raise ValueError(f"no table markers ({start!r} ... {end!r})")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def stale(targets: tuple[Path, ...], start: str, end: str,
          table: Callable[[Path], str], root: Path) -> list[str]:
    """The pages (relative to `root`) whose table is not what `table(page folder)` gives."""
    wrong = []
    for target in targets:
        text = target.read_text()
        if rendered(text, start, end, table(target.parent)) != text:
            wrong.append(str(target.relative_to(root)))
    return wrong


def write(targets: tuple[Path, ...], start: str, end: str,
          table: Callable[[Path], str]) -> None:
    for target in targets:
        target.write_text(rendered(target.read_text(), start, end, table(target.parent)))


def main(description: str, targets: tuple[Path, ...], start: str, end: str,
         table: Callable[[Path], str], check: Callable[[], list[str]], what: str,
         command: str) -> int:
    """A renderer's command line: rewrite the tables, or with --check exit 1 naming each
    page whose table is stale. `what`: the table and its folder, for that message."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true")
    if ap.parse_args().check:
        wrong = check()
        for w in wrong:
            print(f"{w}: its {what} (run {command})", file=sys.stderr)
        return 1 if wrong else 0
    write(targets, start, end, table)
    return 0
