"""Waiting on state that has no change event to await (Redis hashes and streams)."""

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
