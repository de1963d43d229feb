"""`python -m orchestrator.reaper PARENT_PID RUN_ID`: waits for `babelcast run` to end,
then kills every process still carrying its run mark (see orchestrator.lifecycle)."""

from __future__ import annotations

import os
import signal
import sys
import time

from orchestrator.lifecycle import marked_pids

GRACE_S = 0.5
"""After the parent died: children with their own parent-death signal go first."""


def reap(run_id: str, rounds: int = 20) -> int:
    killed = 0
    quiet = 0
    for _ in range(rounds):
        pids = marked_pids(run_id)
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
    while not wake[0] and os.getppid() == parent:
        # The parent-death signal wakes us at once; polling covers a parent that died
        # between our fork and the prctl call.
        time.sleep(1.0)
    time.sleep(GRACE_S)
    reap(run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
