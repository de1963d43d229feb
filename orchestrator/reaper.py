"""`python -m orchestrator.reaper PARENT_PID RUN_ID`: waits for `babelcast run` to end,
then kills what is left of its process tree and every process still carrying its run
mark (see orchestrator.lifecycle)."""

from __future__ import annotations

import os
import signal
import sys
import time

from orchestrator.lifecycle import descendants, marked_pids, start_time_and_parent

GRACE_S = 0.5
"""After the parent died: children with their own parent-death signal go first."""
SNAPSHOT_EVERY_S = 1.0


def reap(run_id: str, tree: dict[int, int] | None = None, rounds: int = 20) -> int:
    """Kill the run's processes: those of `tree` (pid → start time, the last snapshot of
    the run's descendants) that are still the same processes, and any that carry the
    run's mark. Returns how many were signalled."""
    tree = dict(tree or {})
    me = os.getpid()
    killed = 0
    quiet = 0
    for _ in range(rounds):
        pids = set(marked_pids(run_id))
        for pid, started in list(tree.items()):
            now = start_time_and_parent(pid)
            if now is None or now[0] != started:
                del tree[pid]  # gone, or its pid belongs to a newer process
            else:
                pids.add(pid)
        pids.discard(me)
        if not pids:
            quiet += 1
            if quiet >= 2:  # twice empty: nothing was starting either
                break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.2)
    return killed


def main(argv: list[str]) -> int:
    parent, run_id = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the run, which stops us
    wake = [False]

    def on_term(_sig: int, _frame: object) -> None:
        wake[0] = True

    signal.signal(signal.SIGTERM, on_term)
    tree: dict[int, int] = {}
    while not wake[0] and os.getppid() == parent:
        # The parent-death signal wakes us at once; polling covers a parent that died
        # between our fork and the prctl call.
        tree = {pid: t for pid, t in descendants(parent).items() if pid != os.getpid()}
        time.sleep(SNAPSHOT_EVERY_S)
    time.sleep(GRACE_S)
    reap(run_id, tree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
