"""CUDA MPS: whether its control daemon answers, whether it serves the engine, and what a
vllm engine that shares its GPU says without it. No GPU here: the control binary is a
STAND-IN script that answers `get_server_list` as the real one did on the H200 on
2026-12-03 (exit 1 with no daemon, "Cannot find MPS control daemon process"; exit 0 and
nothing before any client; one server PID per line once a CUDA process runs), and
`get_client_list <server>` with one client PID per line (the command NVIDIA documents;
the stand-in's answers are the test's script, not a recording). The engine runs on the
FAKE backend (tests/fake_vllm.py), started through a backend factory so that start()
checks it as it checks a real one; its engine-core pid is the fake probe's answer, or a
child process of this test titled like vLLM's engine core."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.capacity.host import host_fingerprint
from tests.fake_vllm import FakeVllmBackend, started_health
from workers.engines.base import EngineError
from workers.engines.vllm.checks import engine_core_pids
from workers.engines.vllm.engine import VllmEngineOptions, VllmVoxtralEngine
from workers.engines.vllm.mps import CONTROL, mps_advice, mps_clients, mps_servers, mps_unserved

pytestmark = pytest.mark.unit

ENGINE_CORE = 31337
"""The engine core's pid as the plugin worker's probe gives it (a fake's answer)."""
SYSTEM_PATH = os.environ["PATH"]  # the stand-in's own commands (cat, head) come from here


def stand_in(folder: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A STAND-IN control binary first on PATH."""
    control = folder / CONTROL
    control.write_text(f"#!/bin/sh\n{script}\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{SYSTEM_PATH}")
    return control


ANSWERS = 'read cmd; [ "$cmd" = get_server_list ] && echo 4242'


def daemon(folder: Path, monkeypatch: pytest.MonkeyPatch, servers: list[int],
           clients: list[int]) -> None:
    """A STAND-IN daemon that is up: `get_server_list` gives `servers`,
    `get_client_list <first server>` gives `clients`, anything else fails."""
    (folder / "servers").write_text("".join(f"{s}\n" for s in servers))
    (folder / "clients").write_text("".join(f"{c}\n" for c in clients))
    stand_in(folder, f"""read cmd arg
case "$cmd" in
  get_server_list) cat "{folder}/servers" ;;
  get_client_list) [ "$arg" = "$(head -n 1 "{folder}/servers")" ] && cat "{folder}/clients" ;;
  *) exit 1 ;;
esac""", monkeypatch)


def no_daemon(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = folder / "no-binaries"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))  # no control binary at all


def model_folder(folder: Path) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "tekken.json").write_text(json.dumps(
        {"audio": {"transcription_delay_ms": 480, "streaming_n_left_pad_tokens": 32}}))
    return str(folder)


def built(folder: Path, backend: FakeVllmBackend, **opts: object) -> VllmVoxtralEngine:
    options = VllmEngineOptions(model=model_folder(folder / "model"), engines_per_gpu=3,
                                reanchor="off", **opts)  # type: ignore[arg-type]
    return VllmVoxtralEngine(options, backend_factory=lambda _: backend)


def probing(pid: int | None = ENGINE_CORE) -> FakeVllmBackend:
    """A fake whose plugin worker is loaded (re-anchoring refused) and gives its pid."""
    probe: dict[str, object] = {"supported": False, "why_not": "fake"}
    if pid is not None:
        probe["pid"] = pid
    return FakeVllmBackend(version="0.26.0", reanchor_requested=True, probe_answer=probe)


def run(engine: VllmVoxtralEngine) -> dict[str, str]:
    return asyncio.run(asyncio.wait_for(started_health(engine), 20))


def test_the_daemon_answers_with_its_servers_and_their_clients_or_there_is_no_mps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_daemon(tmp_path, monkeypatch)
    assert mps_servers() is None and mps_clients("4242") is None
    control = stand_in(tmp_path, ANSWERS, monkeypatch)
    assert mps_servers() == ["4242"]
    assert host_fingerprint()["mps"] == ["4242"]  # the bench says it too
    control.write_text("#!/bin/sh\nread cmd\n")  # a daemon up, no server started yet
    assert mps_servers() == []
    control.write_text("#!/bin/sh\nexit 1\n")  # no daemon answers
    assert mps_servers() is None
    daemon(tmp_path, monkeypatch, [4242], [ENGINE_CORE, 777])
    assert mps_clients("4242") == [ENGINE_CORE, 777]
    assert mps_unserved([ENGINE_CORE]) is None
    assert mps_unserved([]) == "the engine-core process was not found"
    why = mps_unserved([555])
    assert why == "engine core pid 555 is not a client of MPS server 4242"
    daemon(tmp_path, monkeypatch, [], [])
    assert "runs no server" in (mps_unserved([ENGINE_CORE]) or "")


def test_only_engines_that_share_a_gpu_without_mps_are_told() -> None:
    assert mps_advice(1, on=False) is None
    assert mps_advice(3, on=True) is None
    advice = mps_advice(3, on=False)
    assert advice is not None
    assert "3 engines share this GPU without CUDA MPS" in advice
    assert f"{CONTROL} -d" in advice and "12.15" in advice


@pytest.mark.parametrize(("servers", "clients", "on", "why"), [
    (None, [], False, None),  # no daemon: the node runs no MPS, nothing to explain
    ([], [], False, "runs no server"),
    ([4242], [777], False, f"engine core pid {ENGINE_CORE} is not a client"),
    ([4242], [777, ENGINE_CORE], True, None),
])
def test_mps_is_on_only_where_the_engine_core_is_a_client_of_its_server(
        servers: list[int] | None, clients: list[int], on: bool, why: str | None,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that answers is not MPS serving this engine: an engine whose CUDA context
    came before the daemon, or that sees another pipe directory, runs without it. Health
    says "on" only where the engine core is among a server's clients, and why not where a
    daemon answered; engines sharing the GPU are told what running without it costs."""
    if servers is None:
        no_daemon(tmp_path, monkeypatch)
    else:
        daemon(tmp_path, monkeypatch, servers, clients)
    with caplog.at_level(logging.WARNING, logger="workers.engines.vllm.checks"):
        health = run(built(tmp_path, probing()))
    assert health["engine_mps"] == ("on" if on else "off")
    if why is None:
        assert health["engine_mps_why"] == ""
    else:
        assert why in health["engine_mps_why"]
    told = [r.getMessage() for r in caplog.records if "without CUDA MPS" in r.getMessage()]
    assert len(told) == (0 if on else 1)


def test_an_engine_told_the_node_runs_mps_refuses_to_start_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.vllm.cuda_mps: true` buys a budget measured under MPS (36 per engine, three
    per GPU): without a daemon that engine would lag, so it does not start, and says why."""
    no_daemon(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/mps-here")
    backend = probing()
    with pytest.raises(EngineError, match="cuda_mps is on but no CUDA MPS control daemon "
                                          r"answers.*/run/mps-here"):
        run(built(tmp_path, backend, cuda_mps=True))
    assert backend.shutdowns == 0, "refused before a model was loaded"
    daemon(tmp_path, monkeypatch, [4242], [ENGINE_CORE])
    assert run(built(tmp_path, probing(), cuda_mps=True))["engine_mps"] == "on"


@pytest.mark.parametrize(("servers", "clients"), [([], []), ([4242], [777])])
def test_an_engine_told_mps_that_mps_does_not_serve_refuses_to_start(
        servers: list[int], clients: list[int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon answers, but not for this engine: with `cuda_mps` the engine refuses to
    start (for good: a retry meets the same daemon), gives its GPU memory back and says
    which pipe directory it asked and what to do."""
    daemon(tmp_path, monkeypatch, servers, clients)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/mps-here")
    backend = probing()
    with pytest.raises(EngineError) as refused:
        run(built(tmp_path, backend, cuda_mps=True))
    said = str(refused.value)
    assert not refused.value.retryable and backend.shutdowns == 1
    assert "CUDA MPS does not serve this engine" in said and "/run/mps-here" in said
    assert f"start `{CONTROL} -d`" in said and "set cuda_mps false" in said


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A child process of this test titled like vLLM's engine core."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "VLLM::EngineCore_DP0"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_without_the_plugin_worker_the_engine_core_is_the_child_vllm_titled_so(
        child: subprocess.Popen[bytes], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-anchoring off, no probe gives a pid: the engine core is found among this
    process's children by vLLM's process title. Negative control: the same pid as a
    client, but no child so titled, is not taken for the engine core."""
    assert engine_core_pids({"pid": ENGINE_CORE}) == [ENGINE_CORE]
    assert child.pid in engine_core_pids({})
    daemon(tmp_path, monkeypatch, [4242], [child.pid])
    plain = FakeVllmBackend(version="0.26.0")  # reanchor off: no probe
    assert run(built(tmp_path, plain, cuda_mps=True))["engine_mps"] == "on"
    monkeypatch.setattr("workers.engines.vllm.checks.ENGINE_CORE_TITLE", "NoSuchTitle")
    health = run(built(tmp_path, FakeVllmBackend(version="0.26.0")))
    assert health["engine_mps"] == "off"
    assert health["engine_mps_why"] == "the engine-core process was not found"
