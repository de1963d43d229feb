"""`babelcast run` as an operator starts it, for the end-to-end tests: a subprocess on a
generated event file, ready once its gateway answers /healthz."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 120.0


class Event:
    def __init__(self, base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.base = base
        self.ws = base.replace("http://", "ws://")
        self.proc = proc
        self.log = log
        self.started = time.time()


def start_event(cfg: Path, port: int, env: dict[str, str], duration_s: float = 400
                ) -> Event:
    """Start `babelcast run cfg` with `env` added to this process's environment; returns
    once its gateway on `port` is ready."""
    log = cfg.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--plain",
             "--duration", str(duration_s)],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"babelcast run exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return Event(base, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"gateway did not come up: {log.read_text()[-3000:]}")


def stop_event(ev: Event) -> None:
    ev.proc.send_signal(signal.SIGINT)  # what an operator's Ctrl-C sends
    try:
        ev.proc.wait(60)
    except subprocess.TimeoutExpired:
        ev.proc.kill()
