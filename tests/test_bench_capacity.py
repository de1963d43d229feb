"""bench.voxtral_capacity's bookkeeping (the GPU part runs on the H200 only): a knee is the
largest level every lower level of which also held ≥ 95 % real time, as a median over
rounds; rounds rotate the order so no configuration always runs first."""

from __future__ import annotations

from typing import Any

import pytest

from bench.voxtral_capacity import knees, plan, rotated

pytestmark = pytest.mark.unit


def _rows(*shares: float) -> list[dict[str, Any]]:
    return [{"realtime_share": s} for s in shares]


def test_the_knee_is_the_last_level_that_held_with_every_lower_one() -> None:
    levels = {
        64: {"stock": _rows(1.0, 1.0), "project": _rows(1.0, 1.0)},
        96: {"stock": _rows(0.5, 0.96), "project": _rows(1.0, 0.97)},
        128: {"project": _rows(0.2, 0.96, 0.99)},  # median 0.96: holds
        160: {"project": _rows(0.9, 0.8)},
    }
    assert knees(levels, ["stock", "project"]) == {"stock": 64, "project": 128}


def test_a_configuration_that_misses_the_first_level_has_no_knee() -> None:
    levels = {64: {"stock": _rows(0.94, 0.94)}, 96: {"stock": _rows(1.0, 1.0)}}
    assert knees(levels, ["stock", "project"]) == {"stock": None, "project": None}


def test_rounds_rotate_the_order() -> None:
    configs = ["stock", "project", "project-x2"]
    firsts = [rotated(configs, k)[0] for k in range(3)]
    assert sorted(firsts) == sorted(configs)
    assert rotated(configs, 4) == ["project", "project-x2", "stock"]


def test_two_front_end_configurations_split_over_front_ends_one_and_two() -> None:
    assert plan("stock") == [(0, "stock")]
    assert plan("project") == [(0, "project")]
    assert plan("project-direct") == [(0, "direct")]
    assert plan("project-x2") == [(1, "project"), (2, "project")]
    assert plan("project-direct-x2") == [(1, "direct"), (2, "direct")]
