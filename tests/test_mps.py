"""CUDA MPS: whether its control daemon answers, and what a vllm engine that shares its
GPU says without it. No GPU here: the control binary is a STAND-IN script that answers
`get_server_list` as the real one did on the H200 on 2026-12-03: exit 1 with no daemon
("Cannot find MPS control daemon process"), exit 0 and nothing before any client, one
server PID per line once a CUDA process runs. The engine runs on the fake backend
(tests/fake_vllm.py)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from bench import voxtral_capacity as capacity
from tests.fake_vllm import FakeVllmBackend
from workers.engines.base import EngineError
from workers.engines.mps import CONTROL, mps_advice, mps_servers
from workers.engines.vllm_voxtral import StreamGeometry, VllmEngineOptions, VllmVoxtralEngine

pytestmark = pytest.mark.unit


def stand_in(folder: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A STAND-IN control binary first on PATH."""
    control = folder / CONTROL
    control.write_text(f"#!/bin/sh\n{script}\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return control


ANSWERS = 'read cmd; [ "$cmd" = get_server_list ] && echo 4242'


def test_the_daemon_answers_with_its_servers_or_there_is_no_mps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary at all
    assert mps_servers() is None
    control = stand_in(tmp_path, ANSWERS, monkeypatch)
    assert mps_servers() == ["4242"]
    assert capacity.host_fingerprint()["mps"] == ["4242"]  # the bench says it too
    control.write_text("#!/bin/sh\nread cmd\n")  # a daemon up, no server started yet
    assert mps_servers() == []
    control.write_text("#!/bin/sh\nexit 1\n")  # no daemon answers
    assert mps_servers() is None


def test_only_engines_that_share_a_gpu_without_mps_are_told() -> None:
    assert mps_advice(1, None) is None
    assert mps_advice(3, ["4242"]) is None
    assert mps_advice(3, []) is None
    advice = mps_advice(3, None)
    assert advice is not None
    assert "3 engines share this GPU without CUDA MPS" in advice
    assert f"{CONTROL} -d" in advice and "12.15" in advice


@pytest.mark.parametrize("answers", [True, False])
def test_the_engine_says_whether_it_runs_under_mps(
        answers: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if answers:
        stand_in(tmp_path, ANSWERS, monkeypatch)
    else:
        monkeypatch.setenv("PATH", str(tmp_path))
    engine = VllmVoxtralEngine(
        VllmEngineOptions(model="/m", engines_per_gpu=3, reanchor="off"),
        backend=FakeVllmBackend(), geometry=StreamGeometry(0.48, 32, 17))

    async def go() -> dict[str, str]:
        await engine.start()
        try:
            return engine.describe()
        finally:
            await engine.aclose()

    with caplog.at_level(logging.WARNING, logger="workers.engines.vllm_voxtral"):
        described = asyncio.run(asyncio.wait_for(go(), 20))
    assert described["engine_mps"] == ("on" if answers else "off")
    told = [r.getMessage() for r in caplog.records if "without CUDA MPS" in r.getMessage()]
    assert len(told) == (0 if answers else 1)


def test_an_engine_told_the_node_runs_mps_refuses_to_start_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.vllm.cuda_mps: true` buys a budget measured under MPS (36 per engine, three
    per GPU): without a daemon that engine would lag, so it does not start, and says why."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no daemon answers
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/mps-here")

    def engine() -> VllmVoxtralEngine:
        return VllmVoxtralEngine(
            VllmEngineOptions(model="/m", engines_per_gpu=3, reanchor="off", cuda_mps=True),
            backend=FakeVllmBackend(), geometry=StreamGeometry(0.48, 32, 17))

    refused = engine()
    with pytest.raises(EngineError, match="cuda_mps is on but no CUDA MPS control daemon "
                                          r"answers.*/run/mps-here"):
        asyncio.run(asyncio.wait_for(refused.start(), 20))
    stand_in(tmp_path, ANSWERS, monkeypatch)
    started = engine()

    async def go() -> str:
        await started.start()
        try:
            return started.describe()["engine_mps"]
        finally:
            await started.aclose()

    assert asyncio.run(asyncio.wait_for(go(), 20)) == "on"
