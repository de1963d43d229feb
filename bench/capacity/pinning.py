"""`+pin`: each engine-core process on a physical core of its own, and the front end and
its VAD helpers off those cores.
"""

from __future__ import annotations

import contextlib
import os

from bench.capacity.host import cpu_groups

_USABLE_CPUS: set[int] = set()


def pin_plan(slot: int, of: int, usable: set[int]) -> tuple[set[int], set[int]]:
    """(the CPUs of engine core `slot` of `of`, the CPUs everything else keeps): engines
    take whole physical cores from the top (CPU 0 takes the interrupts), the rest keep
    every other core."""
    groups = cpu_groups(usable)
    if len(groups) < of + 2:
        raise RuntimeError(f"{len(groups)} physical cores cannot give {of} engine cores one "
                           "each and keep two for the rest")
    mine = set(groups[len(groups) - 1 - slot])
    rest = usable - {c for g in groups[len(groups) - of:] for c in g}
    return mine, rest


def _set_cpus(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` onto `cpus` (affinity is per thread; new threads inherit
    their creator's); the threads set."""
    done = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)
                done += 1
    return done


def pin_cpus(on: bool, slot: int, of: int) -> list[int] | bool:
    """From a front-end process: with `on`, its engine-core process onto a physical core of
    its own (`pin_plan`) and this process and its other children (VAD helpers) off every
    engine's core; else all of them back onto the CPUs the process started with. Returns
    the engine core's CPUs, or False."""
    import psutil

    if not _USABLE_CPUS:
        _USABLE_CPUS.update(os.sched_getaffinity(0))
    usable = set(_USABLE_CPUS)
    mine, rest = pin_plan(slot, of, usable) if on else (usable, usable)
    cores = 0
    for child in psutil.Process().children(recursive=True):
        try:
            name = " ".join([child.name(), *child.cmdline()])
        except psutil.Error:
            continue
        is_core = "EngineCore" in name
        moved = _set_cpus(child.pid, mine if is_core else rest)
        cores += is_core and moved > 0
    if on and not cores:
        raise RuntimeError("no engine-core process among this front end's children took "
                           "the CPUs")
    _set_cpus(os.getpid(), rest)
    return sorted(mine) if on else False
