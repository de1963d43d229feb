"""docs/failover.md's and docs/benchmarks.md's failover tables are bench.failover's kept
results, rendered (bench/failover_table.py), and each row is judged by issue 35's bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import failover_table as ft
from bench import tables

pytestmark = pytest.mark.unit


def test_the_docs_tables_are_the_kept_results() -> None:
    assert ft.check() == [], "run python -m bench.failover_table"


def test_a_changed_result_makes_its_table_stale(tmp_path: Path) -> None:
    folder = tmp_path / "failover"
    shutil.copytree(ft.FOLDER, folder)
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{ft.START}\n{ft.END}\noutro\n")
    tables.write((doc,), ft.START, ft.END, lambda where: ft.table(where, folder))
    assert tables.stale((doc,), ft.START, ft.END, lambda w: ft.table(w, folder),
                           tmp_path) == []
    path = sorted(folder.glob("*h200-at-aa5389c.json"))[0]
    data = json.loads(path.read_text())
    data["actor_loss"]["longest_caption_silence_p95_s"] = 5.01
    path.write_text(json.dumps(data))
    assert tables.stale((doc,), ft.START, ft.END, lambda w: ft.table(w, folder),
                           tmp_path) == ["doc.md"]
    assert "misses: silence p95 5.01 s" in ft.table(tmp_path, folder)


def test_the_bound_is_judged_on_every_count() -> None:
    ok = {"fault_happened": True, "longest_caption_silence_p95_s": 5.0,
          "words_lost_vs_control": -2, "finals_doubled": 0, "seq_contiguous": True}
    assert ft.verdict("actor_loss", ok) == "meets"
    assert ft.verdict("actor_loss", {**ok, "longest_caption_silence_p95_s": 5.01}) \
        == "misses: silence p95 5.01 s"
    assert ft.verdict("actor_loss", {**ok, "words_lost_vs_control": 1}) \
        == "misses: 1 words lost"
    assert ft.verdict("actor_loss", {**ok, "finals_doubled": 1}) == "misses: finals doubled"
    assert ft.verdict("actor_loss", {**ok, "seq_contiguous": False}) == "misses: seq gap"
    assert ft.verdict("actor_loss", {**ok, "fault_happened": False}) == "misses: no fault"
    assert ft.verdict("control", {"longest_caption_silence_p95_s": 15.9}).startswith(
        "**control itself over 5 s**")
