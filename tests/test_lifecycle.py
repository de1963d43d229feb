"""`babelcast run` as an operator runs it on loopback without an `auth` section (the
demo): per-run tokens in a file only its user reads, the CLI finds them, nothing is
open without them; SIGKILL of the run leaves no process behind (local redis-server,
Ray and its agents, actor workers, the other gateway workers: `gateway.workers` is
'auto' here) nor their metric socket folder, and a new run on the same port starts at
once.
The reaper on its own: a process that lost the run's mark from its environment (as
Ray's agents do when they rename themselves) dies with the run too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.config import GatewayConfig
from orchestrator.redis_server import free_port
from tests.speech import AUDIO
from tests.waiting import alive

pytestmark = pytest.mark.integration


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, changed = {root}, True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree - {root}


def cmdline(pid: int) -> bytes:
    """Its command line; b"" once it is gone (Ray starts and ends workers meanwhile)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def get(url: str, **kwargs: Any) -> httpx.Response:
    # Generous: the run answers while it starts Ray and loads a model on a busy machine.
    return httpx.get(url, timeout=30, **kwargs)


def start(cfg: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = cfg.with_suffix(f".{time.monotonic_ns()}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", str(cfg),
                             "--plain", "--duration", "300"], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "babelcast run exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/livez", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail("the gateway did not come up")


RUN_LIKE = r"""
import os, subprocess, time
from orchestrator.lifecycle import mark_run, start_reaper
start_reaper(mark_run())
# Like Ray's agents after setproctitle: nothing of the run's mark in its environment.
unmarked = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"]})
marked = subprocess.Popen(["sleep", "300"])
print(unmarked.pid, marked.pid, flush=True)
time.sleep(300)
"""


def test_the_reaper_kills_the_runs_tree_even_processes_without_its_mark() -> None:
    proc = subprocess.Popen([sys.executable, "-c", RUN_LIKE], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert b"BABELCAST_RUN_ID" not in Path(f"/proc/{pids[0]}/environ").read_bytes()
        time.sleep(2.5)  # the reaper notes the run's tree every second
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a child outlived the SIGKILLed run"


def test_a_local_run_makes_its_own_tokens_and_sigkill_leaves_no_child(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "event.yaml"
    cfg.write_text(f"""
event: lifecycle
engine: {{kind: embedded, model: tiny.en, actors: 1, streams_per_actor: 1}}
streams:
  - {{id: room, source: "{AUDIO / 'room-a.flac'}", loop: true, language: en}}
gateway: {{host: 127.0.0.1, port: {port}}}
""")
    runtime = tmp_path / "run"
    # A private temporary folder for the gateway's socket folder (the suite's other
    # worker starts gateways of its own in /tmp); Ray's stays where it always is. Short:
    # a Unix socket path holds at most 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="bclc-", dir="/tmp"))
    env = {**os.environ, "BABELCAST_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1",
           "TMPDIR": str(tmp), "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp")}
    env.pop("BABELCAST_TOKEN", None)

    def metric_folders() -> set[Path]:  # orchestrator.gateway.metrics_merge.WorkerGroup
        return set(tmp.glob("babelcast-gw-*"))

    folders = metric_folders()
    proc = start(cfg, port, env)
    base = f"http://127.0.0.1:{port}"
    try:
        files = list(runtime.glob("gateway-*.json"))
        deadline = time.monotonic() + 60
        while not files and time.monotonic() < deadline:
            time.sleep(0.2)
            files = list(runtime.glob("gateway-*.json"))
        assert len(files) == 1
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        creds = json.loads(files[0].read_text())
        assert get(f"{base}/v1/status").status_code == 401
        assert get(f"{base}/v1/streams").status_code == 401  # captions not open
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}
        assert get(f"{base}/v1/status", headers=admin).status_code == 200
        overlay = get(f"{base}/overlay/room",
                            params={"lang": "en", "token": creds["viewer_token"]})
        assert overlay.status_code == 200
        status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--url",
                                 base, "--json"], capture_output=True, text=True,
                                env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        # Wait for the actors (Ray workers) so the kill below has a whole tree to orphan.
        deadline = time.monotonic() + 120
        while get(f"{base}/healthz").status_code != 200 or not any(
                b"ray::" in cmdline(p) for p in descendants(proc.pid)):
            assert time.monotonic() < deadline, "actors did not start"
            time.sleep(0.5)
        def log_text_now() -> str:
            return b"".join(p.read_bytes() for p in tmp_path.glob("*.log")).decode()

        while "overlays" not in log_text_now() or b"ray::AsrActor" not in b" ".join(
                cmdline(p) for p in descendants(proc.pid)):
            assert time.monotonic() < deadline, "the live view or the ASR actor never came"
            time.sleep(0.5)
        log_text = log_text_now()
        assert creds["admin_token"] not in log_text  # the file's path is printed, not it
        assert f"token={creds['viewer_token']}" in log_text  # overlay URLs carry it
        children = {p for p in descendants(proc.pid) if alive(p)}
        names = {p: cmdline(p)[:60] for p in children}
        assert any(b"redis-server" in n for n in names.values())
        if GatewayConfig().worker_count() > 1:
            assert any(b"orchestrator.gateway.workers" in cmdline(p) for p in children), names
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 20
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: names[p] for p in children if alive(p)}
    assert not left, f"left behind: {left}"
    deadline = time.monotonic() + 10
    while metric_folders() - folders and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not metric_folders() - folders, "the gateway workers' socket folder was left"
    # The port is free again at once (TIME_WAIT connections do not count as in use).
    again = start(cfg, port, env)
    try:
        assert get(f"{base}/livez").status_code == 200
    finally:
        again.send_signal(signal.SIGINT)
        again.wait(60)
    assert not list(runtime.glob("gateway-*.json")), "a clean stop removes the tokens file"
    shutil.rmtree(tmp, ignore_errors=True)
