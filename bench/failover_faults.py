"""The faults bench.failover causes, and how it checks they happened: processes signalled
and seen dead or stopped, a node's processes, their Redis connections, and (FAULT
INJECTION) an embedded engine that can die inside its actor."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def pid_state(pid: int) -> str:
    """'gone', 'zombie', 'stopped' or 'running' (psutil's other states count as running)."""
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    if status == psutil.STATUS_ZOMBIE:
        return "zombie"
    if status == psutil.STATUS_STOPPED:
        return "stopped"
    return "running"


@dataclass
class Fault:
    """What a fault did, checked: `happened` only when pids were found and each was then
    seen in the wanted state."""

    kind: str
    pids: list[int] = field(default_factory=list)
    states: dict[int, str] = field(default_factory=dict)
    at: float = 0.0

    def check(self, want: str) -> bool:
        """want: 'dead' (gone or zombie), 'stopped' or 'running' (woken)."""
        self.states = {p: pid_state(p) for p in self.pids}
        ok = {"dead": {"gone", "zombie"}, "stopped": {"stopped"}, "running": {"running"}}[want]
        return bool(self.pids) and all(s in ok for s in self.states.values())


def signal_all(pids: Sequence[int], sig: int, want: str, wait_s: float = 5.0) -> Fault:
    """Send `sig` to every pid at once, then wait until each is in `want`."""
    fault = Fault(kind=signal.Signals(sig).name, pids=list(pids), at=time.time())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    deadline = time.monotonic() + wait_s
    while not fault.check(want) and time.monotonic() < deadline:
        time.sleep(0.02)
    return fault


def node_pids(node: Any) -> list[int]:
    """Every process of a node started by Ray's cluster utilities: the processes it
    started (raylet, agents, log monitor) and all their descendants (the workers)."""
    import psutil

    roots = [info.process.pid for infos in node.all_processes.values() for info in infos
             if info.process is not None]
    out: set[int] = set()
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            out.add(pid)
            out.update(c.pid for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return sorted(out)


def redis_ports_of(pids: Sequence[int], redis_port: int) -> set[int]:
    """The local ports of the processes' connections to Redis (to tell their commands
    apart in MONITOR)."""
    import psutil

    ports: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == redis_port:
                    ports.add(c.laddr.port)
    return ports


# ---- FAULT INJECTION: an embedded engine that can die inside its actor -----------------
def _killable_actor_class() -> Any:
    from orchestrator.ray_actors import AsrActor
    from workers.asr import AsrHost
    from workers.engines.base import WrappedEngine

    class KillableEngine(WrappedEngine):
        """FAULT INJECTION (bench only): `kill()` unloads the real model and shuts its
        decode thread down, so sessions fail, and reports the engine dead from then on."""

        dead = False

        async def kill(self) -> bool:
            await self.inner.aclose()
            self.dead = True
            return getattr(self.inner, "_model", None) is None

        async def check_health(self) -> bool:
            return not self.dead and await self.inner.check_health()

        def open_session(self, options: Any) -> Any:
            return self.inner.open_session(options)

    class KillableEngineAsrActor(AsrActor):
        def __init__(self, options: Any, engine: Any) -> None:
            super().__init__(options, engine)
            assert isinstance(self.host, AsrHost)
            self.killable = KillableEngine(self.host.engine)
            self.host.engine = self.killable

        async def kill_engine(self) -> dict[str, Any]:
            return {"pid": os.getpid(), "unloaded": await self.killable.kill()}

    return KillableEngineAsrActor
