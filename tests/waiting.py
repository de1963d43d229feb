"""Waiting on state that has no change event to await (Redis hashes and streams, whether a
process is still alive)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, every_s: float = 0.1
) -> None:
    """Poll until `check` holds; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (ended, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
