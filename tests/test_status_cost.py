"""Cheap to watch, and one clear line (issue 36): `babelcast status` against a real gateway
(uvicorn on a real socket, a real redis-server) imports nothing heavy, `--watch` keeps one
connection for all its polls, and a second `babelcast run` in a folder whose Redis is taken
is refused with one line. The CPU it costs is measured by bench/status_cpu.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from orchestrator.redis_server import LocalRedisServer, free_port
from tests.outputs_support import ADMIN_TOKEN, Gateway, hall, running_gateway

pytestmark = pytest.mark.integration

HEAVY = ("ray", "torch", "numpy", "redis", "pydantic", "httpx", "yaml", "fastapi",
         "orchestrator.config", "orchestrator.status", "workers")
PROBE = ("import json, sys\n"
         "from orchestrator.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
         "sys.exit(rc)\n")
RECV_S = 20.0


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Gateway]:
    async with running_gateway(redis_url, [hall()]) as gw:
        yield gw


async def probe(*args: str) -> tuple[int, str, list[str]]:
    """Run the CLI in a fresh interpreter: (exit code, stdout, the modules it imported)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PROBE, *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    lines = err.decode().strip().splitlines()
    assert lines, "the probe printed nothing"
    return proc.returncode or 0, out.decode(), json.loads(lines[-1])


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


async def test_status_json_imports_nothing_heavy(gateway: Gateway) -> None:
    rc, out, modules = await probe("status", "--json", "--url", gateway.base,
                                   "--token", ADMIN_TOKEN)
    assert rc == 0, out
    assert json.loads(out)["event"] == "Test event"
    assert heavy(modules) == []


async def test_the_import_probe_sees_heavy_imports(tmp_path: Path) -> None:
    """The control: `validate` needs the event's models, and the probe says so."""
    cfg = tmp_path / "event.yaml"
    cfg.write_text("event: x\nstreams: [{id: a, source: push, language: en}]\n")
    rc, _, modules = await probe("validate", str(cfg))
    assert rc == 0
    assert {"pydantic", "orchestrator.config", "yaml"} <= set(heavy(modules))


async def test_watch_keeps_one_connection_for_every_poll(gateway: Gateway) -> None:
    port = int(gateway.base.rsplit(":", 1)[1])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli", "status", "--json", "--watch", "0.3",
        "--url", gateway.base, "--token", ADMIN_TOKEN, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    seen: list[set[int]] = []
    try:
        for _ in range(5):
            line = await asyncio.wait_for(proc.stdout.readline(), RECV_S)
            assert json.loads(line)["event"] == "Test event"
            ports = {c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.raddr and c.raddr.port == port}
            seen.append(ports)
    finally:
        proc.terminate()
        await proc.wait()
    assert all(len(p) == 1 for p in seen), seen  # the probe sees the connection each time
    assert len(set.union(*seen)) == 1, seen  # and it is the same one


def test_a_second_run_in_the_same_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    import subprocess

    data = tmp_path / "redis"
    first = LocalRedisServer(data_dir=data)  # the first run's Redis holds the folder
    first.start()
    try:
        cfg = tmp_path / "event.yaml"
        cfg.write_text(f"event: second\nredis: {{data_dir: {data}}}\n"
                       "streams: [{id: a, source: push, language: en}]\n"
                       f"gateway: {{host: 127.0.0.1, port: {free_port()}}}\n")
        done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(cfg),
                               "--plain"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    finally:
        first.stop()
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("babelcast run: another babelcast run uses")
