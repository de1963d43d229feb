"""What the benchmarks share: percentiles, process CPU time from /proc, and a running
`babelcast run` (local redis-server child, local Ray, gateway) on a generated event."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def number_or_text(value: str) -> float | str:
    """A Redis hash value as a number where it is one (an actor's hash mixes both)."""
    try:
        return float(value)
    except ValueError:
        return value


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (linear interpolation), rounded to ms; None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 3)


def _proc_table() -> tuple[dict[int, int], dict[int, float]]:
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return parents, cpu


def _descendants(root_pid: int, parents: dict[int, int]) -> set[int]:
    """root_pid and every process below it."""
    tree = {root_pid}
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree


def tree_cpu_s(root_pid: int, seen: dict[int, float]) -> float:
    """CPU seconds (user + system) of root_pid and its descendants; `seen` keeps the last
    value per pid so processes that already exited still count."""
    parents, cpu = _proc_table()
    for pid in _descendants(root_pid, parents):
        if pid in cpu:
            seen[pid] = cpu[pid]
    return sum(seen.values())


def pids_named(root_pid: int, needle: str) -> list[int]:
    """Descendants of root_pid whose command line contains `needle` (Ray sets an actor
    worker's title to `ray::ClassName...`)."""
    parents, _ = _proc_table()
    found = []
    for pid in _descendants(root_pid, parents):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def client_headers(base: str, kind: str = "viewer", stream: str | None = None
                   ) -> dict[str, str]:
    """The Authorization header a client of the bench's `babelcast run` at `base` sends.
    The run has no `auth:` section, so it keeps per-run tokens in its runtime file (0600),
    as the demo does. `kind`: viewer, admin, or publish (for `stream`)."""
    from orchestrator.gateway.local_credentials import read_credentials

    data = read_credentials(base) or {}
    token = (data.get("publish_tokens") or {}).get(stream) if kind == "publish" else (
        data.get(f"{kind}_token"))
    if not isinstance(token, str) or not token:
        raise RuntimeError(f"no {kind} token for {base} in its runtime file")
    return {"Authorization": f"Bearer {token}"}


@dataclass
class BabelcastRun:
    """A running `babelcast run`: its gateway URL, its Redis (a separate redis-server
    child of this process, so counters can be read after the run) and the process."""

    base: str
    redis: Any
    proc: subprocess.Popen[bytes]
    redis_pid: int | None
    log: Path
    cpu_seen: dict[int, float] = field(default_factory=dict)

    def headers(self, kind: str = "viewer", stream: str | None = None) -> dict[str, str]:
        return client_headers(self.base, kind, stream)

    def cpu_s(self) -> float:
        """CPU seconds of the whole server: babelcast run's process tree and redis-server."""
        total = tree_cpu_s(self.proc.pid, self.cpu_seen)
        if self.redis_pid is not None:
            total += tree_cpu_s(self.redis_pid, {})
        return total

    def asr_actor_cpu_s(self) -> float | None:
        """CPU seconds of the ASR actor processes alone (the engine and its sessions)."""
        pids = pids_named(self.proc.pid, "ray::AsrActor")
        if not pids:
            return None
        _, cpu = _proc_table()
        return sum(cpu.get(p, 0.0) for p in pids)


@contextlib.asynccontextmanager
async def babelcast_run(
    event_lines: list[str], tmp: Path, *, ready_timeout_s: float = 120.0
) -> AsyncIterator[BabelcastRun]:
    """Start `babelcast run` on an event made of `event_lines` (without `redis:` and
    `gateway:`, which this adds), wait until the gateway answers and the ASR actor has
    reported (its model is loaded), and stop it on exit."""
    from redis import Redis

    from orchestrator.redis_server import LocalRedisServer, free_port

    redis_server = LocalRedisServer()
    redis = Redis.from_url(redis_server.start(), decode_responses=True)
    port = free_port()
    cfg = tmp / "bench.yaml"
    cfg.write_text("\n".join([
        *event_lines,
        f"redis: {{url: \"{redis_server.url}\"}}",
        f"gateway: {{host: 127.0.0.1, port: {port}}}",
    ]) + "\n")
    log = tmp / "run.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as logf:
        proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, not awaited
            [sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--plain",
             "--duration", "3600"],
            stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
        )
    redis_proc = getattr(redis_server, "_proc", None)
    run = BabelcastRun(base, redis, proc, getattr(redis_proc, "pid", None), log)
    try:
        deadline = time.monotonic() + ready_timeout_s
        async with httpx.AsyncClient() as http:
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"babelcast run did not start: {log.read_text()[-2000:]}")
                try:
                    ok = (await http.get(f"{base}/healthz", timeout=1)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok and redis.exists("actor:asr-0"):
                    break
                await asyncio.sleep(0.3)
        yield run
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)  # shutdown: nothing else runs
        except subprocess.TimeoutExpired:
            proc.kill()
        redis_server.stop()
