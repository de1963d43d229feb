"""The `babelcast` command line, run as an operator would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.speech import ROOT

pytestmark = pytest.mark.unit


def babelcast(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_validate_accepts_the_demo_event() -> None:
    result = babelcast("validate", "examples/demo.yaml")
    assert result.returncode == 0, result.stderr
    assert "2 stream(s)" in result.stdout


def test_validate_names_file_line_and_key_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "event: broken\n"
        "streams:\n"
        "  - id: hall\n"
        "    source: push\n"
        "    langauge: en\n"
    )
    result = babelcast("validate", str(bad))
    assert result.returncode == 2
    assert f"{bad}:5: streams[0].langauge:" in result.stderr
    assert "nothing was started" in result.stderr


def test_validate_reports_every_problem_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "event: broken\n"
        "engine: {actors: 0}\n"
        "streams:\n"
        "  - id: Hall A\n"
        "    source: push\n"
    )
    result = babelcast("validate", str(bad))
    assert result.returncode == 2
    assert f"{bad}:2: engine.actors:" in result.stderr
    assert f"{bad}:4: streams[0].id:" in result.stderr


def test_live_view_prints_the_redis_url_that_export_needs() -> None:
    from redis.asyncio import Redis

    from orchestrator.config import load_event
    from orchestrator.live import LiveView

    cfg = load_event(ROOT / "examples" / "demo.yaml")
    redis = Redis.from_url("redis://:s3cret@127.0.0.1:6390/2")  # connects on first use only
    view = LiveView(cfg, redis, "http://127.0.0.1:8000", plain=True, unplaced=[])
    line = view.redis_line()
    assert "redis://127.0.0.1:6390/2" in line
    assert f"babelcast export {cfg.streams[0].id} --redis redis://127.0.0.1:6390/2" in line
    assert "s3cret" not in line
