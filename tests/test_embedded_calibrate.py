"""Capacity from the host it runs on (issue 37): the embedded engine's calibration.

The figure itself is a timing, so no test here asserts a value of it: they assert what is
measured (one stream's decode work on real speech), how it becomes a stream count, and
that a host measures once and then reads its cache, keyed by what changes the figure.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from workers.engines import calibrate
from workers.engines.calibrate import Calibration, cached, host_key, store, streams_for
from workers.engines.embedded import DecodeStats, EmbeddedEngineOptions, EmbeddedWhisperEngine


def opts(**kw: Any) -> EmbeddedEngineOptions:
    return EmbeddedEngineOptions(**{"model": "tiny.en", "cpu_threads": 2, **kw})


@pytest.mark.unit
def test_streams_are_the_target_share_of_the_decode_thread_over_one_streams_share() -> None:
    assert streams_for(0.2, target=0.7) == 3
    assert streams_for(0.1, target=0.7) == 7
    assert streams_for(0.9, target=0.7) == 1, "at least one stream, however slow the host"


@pytest.mark.unit
def test_the_cache_is_keyed_by_what_changes_the_work_and_expires(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    cal = Calibration(0.2, 3, host_key(opts()), measured_at=1000.0)
    store(cal, path)
    hit = cached(opts(), path, now=1000.0 + 60)
    assert hit is not None and hit.cached
    assert (hit.busy_per_stream, hit.streams) == (0.2, 3)
    # What sets one stream's work changes the key: a beamed final pass is more work.
    assert cached(opts(final_beam_size=5), path, now=1060.0) is None
    assert cached(opts(cpu_threads=1), path, now=1060.0) is None
    # ... what does not, does not.
    assert cached(dataclasses.replace(opts(), min_word_p=0.5), path, now=1060.0) is not None
    assert cached(opts(), path, max_age_s=30.0, now=1060.0) is None, "too old"
    store(Calibration(0.25, 2, host_key(opts(final_beam_size=5)), 1000.0), path)
    assert cached(opts(), path, now=1060.0) is not None, "one entry per key"
    path.write_text("{not json")
    assert cached(opts(), path, now=1060.0) is None


@pytest.mark.integration
def test_an_engine_measures_its_host_once_then_reads_the_figure_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(calibrate.CACHE_ENV, raising=False)  # the suite's own file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "CALIBRATION_S", 6.0)

    async def start() -> tuple[dict[str, str], DecodeStats]:
        engine = EmbeddedWhisperEngine(opts(calibrate=True))
        await engine.start()
        try:
            # The measurement's decodes are not counted as the streams' work.
            assert engine.stats()["decode_calls"] == 0
            return engine.describe(), engine.calibration_stats
        finally:
            await engine.aclose()

    first, stats = asyncio.run(start())
    assert first["calibration_source"] == "measured"
    busy = float(first["calibration_busy_per_stream"])
    # It decoded speech: interims and at least one final pass, through a real session.
    assert busy > 0 and stats.calls >= 3 and stats.final_greedy_calls >= 1
    # The status rounds the figure to 3 places; the engine used the unrounded one, which
    # may sit across a step of streams_for (seen: 0.350 → 2, the engine's → 1).
    assert streams_for(busy + 0.0005) <= int(first["calibrated_streams"]) \
        <= streams_for(busy - 0.0005)
    assert (tmp_path / "babelcast" / "calibration.json").exists()
    second, stats = asyncio.run(start())
    assert second["calibration_source"] == "cache"
    assert second["calibrated_streams"] == first["calibrated_streams"]
    assert stats.calls == 0, "a cached figure costs no decode"
    assert EmbeddedWhisperEngine(opts()).describe() == {}, "calibration is asked for"


@pytest.mark.unit
def test_status_shows_what_the_host_carries_beside_the_actors_budget() -> None:
    from orchestrator.status import _actor, render

    now = 1000.0
    actor = _actor("asr-0", {"max_streams": "3", "streams": "3", "calibrated_streams": "2",
                             "updated": str(now)}, now)
    assert actor["calibrated_streams"] == 2
    text = render({"event": "e", "streams": [], "actors": [actor],
                   "translation": {"languages": {}, "queue": {}},
                   "clients": {"total": 0, "by_stream": {}}})
    line = next(line for line in text.splitlines() if line.startswith("asr-0 "))
    assert "3/3 streams" in line and "host carries 2" in line
    uncalibrated = _actor("asr-1", {"max_streams": "3", "updated": str(now)}, now)
    assert uncalibrated["calibrated_streams"] is None
