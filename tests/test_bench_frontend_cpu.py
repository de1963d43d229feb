"""bench.frontend_cpu's parts on their own: both VAD transports give the same flags, both
rut walks the same answer (the bench's legs differ only in cost)."""

from __future__ import annotations

import pytest

from bench.frontend_cpu import _rut_walk, _vad_calls

pytestmark = pytest.mark.unit


async def test_the_legacy_and_current_vad_transports_give_the_same_flags() -> None:
    got = await _vad_calls(streams=3, calls=30)
    assert got["same_flags"] is True
    assert {k for k in got if k.endswith("in_flight")} == {
        f"{leg}_us_per_call_{n}_in_flight" for leg in ("before", "after") for n in (1, 3)}


def test_the_full_and_bounded_rut_walks_agree_on_the_bench_stream() -> None:
    assert _rut_walk()["same_answer"] is True
