"""asyncio helpers every floor uses.

`wait_for` replaces `asyncio.wait_for` in all product code (tests/test_layering.py holds
that). On Python 3.11, our floor, `asyncio.wait_for` can swallow a cancellation: when the
awaited thing finishes in the same loop turn as the task running `wait_for` is
cancelled, it returns the result and the cancel is lost (CPython gh-86296; 3.12 rebuilt
`wait_for` on `asyncio.timeout`, GH-96764). A loop cancelled at shutdown then goes on
forever. It happened here: `babelcast gateway` hung on Ctrl-C when the signal came as a
restarted worker said `ready` (CI, stop 24). This one is built on `asyncio.timeout`, as
3.12's is, so a cancel always reaches the caller.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


# ASYNC109 prefers `asyncio.timeout` at each call; this is that, behind the one name.
async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:  # noqa: ASYNC109
    """`await aw`, raising TimeoutError after `timeout` seconds (None: no limit); on a
    timeout `aw` is cancelled and waited for, as `asyncio.wait_for` does."""
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(aw, timeout)
    if timeout is not None and timeout <= 0:
        fut = asyncio.ensure_future(aw)
        if not fut.done():
            fut.cancel()
            # Cancelled just above: let it run its cancellation out.
            await asyncio.wait([fut])
        try:
            return fut.result()
        except asyncio.CancelledError as exc:
            raise TimeoutError from exc
    async with asyncio.timeout(timeout):
        return await aw


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float) -> bool:  # noqa: ASYNC109
    """Cancel `task` and wait at most `timeout` seconds for it to finish; True if it did.

    Not `wait_for(task, timeout)`: on a timeout that cancels the task again and then waits
    for it with no limit, so a task that does not finish when cancelled (a cleanup stuck
    on a thread, a `finally` that swallows the cancel) would hold its caller forever. A
    task still running after `timeout` is left to finish on its own; the caller says so.
    What the task ended with (a result, an error) is dropped, as a stop wants.
    A cancel of the caller still reaches the caller.
    """
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done and not task.cancelled():
        task.exception()  # retrieved: an error it ended with is not logged as unhandled
    return bool(done)


async def cancel_and_join(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait, with no limit, until it has ended, however it ends; what it
    ended with is dropped. For a task whose end the caller must see (a session's engine
    slot is free only then); `cancel_and_wait` for a bounded stop.

    Not `task.cancel()` then `await task` under `suppress(CancelledError)`: a cancel of
    the caller while it waits there goes to `task` and comes back out of `await task` as
    the task's own CancelledError, which the suppress then swallows, so the caller goes on
    as if never cancelled. A session manager whose aclose landed there went on ticking
    with its stream gone (test_asr_host's restart test hung on CI, 2026-12-02). Here the
    caller's cancel reaches the caller; `task`, cancelled already, ends on its own.
    """
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: an error it ended with is not logged as unhandled
