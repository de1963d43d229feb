"""Every child of `babelcast run` dies with it, even when it is killed with SIGKILL.

Two mechanisms, because neither alone covers everything:
- direct children we start (the local redis-server, the reaper) get a parent-death
  signal (`prctl(PR_SET_PDEATHSIG)`): the kernel signals them when we die;
- everything Ray starts (GCS, raylet, its agents, actor workers) is started by Ray,
  several levels down, and some of it outlived a SIGKILLed run. The reaper, a small
  child process with a parent-death signal, kills all of it once the run is gone (after
  a clean stop it finds nothing). It finds them two ways:
  - the tree: every second while the run lives it notes the run's descendants (pid and
    start time, so a reused pid is left alone);
  - the mark: the run marks its environment with a fresh `BABELCAST_RUN_ID`, which every
    descendant inherits, for what started in the last second before the run died.
  The mark alone was not enough: Ray's dashboard and runtime-env agents rename
  themselves (setproctitle), which overwrites the environment /proc shows, and they
  outlived 4 of 6 SIGKILLed test runs by more than 20 s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable

RUN_ID_ENV = "BABELCAST_RUN_ID"
_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get `sig` when its parent thread dies."""

    def apply() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the reaper still covers us
            pass

    return apply


def mark_run() -> str:
    """Mark this process's environment (inherited by every child started after this)."""
    run_id = uuid.uuid4().hex
    os.environ[RUN_ID_ENV] = run_id
    return run_id


def start_reaper(run_id: str) -> subprocess.Popen[bytes] | None:
    """The reaper of this run's processes; None where /proc is missing (not Linux)."""
    if not os.path.isdir("/proc"):
        return None
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.reaper", str(os.getpid()), run_id],
        env=env, stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal(signal.SIGTERM),
    )


def marked_pids(run_id: str) -> list[int]:
    """Processes of this user whose environment carries the run's mark."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    me = os.getpid()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def descendants(root: int) -> dict[int, int]:
    """Every process below `root` (not itself): pid → start time (clock ticks after
    boot, /proc/PID/stat field 22), which tells a process from a later one that reuses
    its pid."""
    parents: dict[int, int] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = start_time_and_parent(int(entry))
        if stat is not None:
            starts[int(entry)], parents[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = starts[pid]
            todo.extend(children.get(pid, ()))
    return found


def start_time_and_parent(pid: int) -> tuple[int, int] | None:
    """(start time, parent pid) of a live process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]), int(fields[1])
