"""workers.aio.wait_for: what asyncio.wait_for does, except that a cancel is never lost;
and cancel_and_wait, a stop whose wait is bounded even for a task that will not stop.

The race it closes (CPython gh-86296, fixed in 3.12): the awaited future completes and
the waiting task is cancelled in the same loop turn. Python 3.11's asyncio.wait_for
then returns the result, and the task goes on as if never cancelled. `babelcast gateway`
hung on Ctrl-C that way (tests/test_gateway_workers.py's teardown, on CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from workers.aio import cancel_and_join, cancel_and_wait, wait_for

pytestmark = pytest.mark.unit

WaitFor = Callable[[Awaitable[Any], float | None], Awaitable[Any]]


async def cancel_as_it_completes(wait: WaitFor) -> tuple[bool, list[str]]:
    """A task waits on a future through `wait`; in one loop turn the future gets its
    result and the task is cancelled. Whether the cancel reached the task, and how far
    it went."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def waiter() -> None:
        await wait(fut, 10)
        steps.append("returned")
        await asyncio.sleep(0)  # a lost cancel lets it reach here and go on
        steps.append("went on")

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # it is now waiting
    fut.set_result(1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True, steps
    return False, steps


async def test_a_cancel_that_comes_as_the_result_does_is_not_lost() -> None:
    assert await cancel_as_it_completes(wait_for) == (True, [])


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's asyncio.wait_for is fixed")
async def test_the_race_is_real_for_asyncio_wait_for_on_this_python() -> None:
    """The scenario above is the race: asyncio.wait_for of 3.11 loses this cancel."""
    assert await cancel_as_it_completes(asyncio.wait_for) == (False, ["returned", "went on"])


async def test_a_timeout_raises_and_cancels_what_it_waited_for() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await wait_for(slow(), 0.05)
    assert cancelled.is_set()
    task = asyncio.create_task(asyncio.sleep(30))
    with pytest.raises(TimeoutError):
        await wait_for(task, 0.05)
    assert task.cancelled()


async def test_results_errors_and_no_limit_pass_through() -> None:
    assert await wait_for(asyncio.sleep(0.01, result="x"), 5) == "x"
    assert await wait_for(asyncio.sleep(0.01, result="y"), None) == "y"

    async def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await wait_for(fails(), 5)


async def test_a_limit_of_zero_takes_what_is_done_and_times_out_the_rest() -> None:
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await wait_for(done, 0) == 7
    pending = asyncio.create_task(asyncio.sleep(30))
    with pytest.raises(TimeoutError):
        await wait_for(pending, -1.0)
    assert pending.cancelled()


async def test_a_cancel_from_outside_is_a_cancel_not_a_timeout() -> None:
    inner = asyncio.create_task(asyncio.sleep(30))
    outer = asyncio.create_task(wait_for(inner, 10))
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert inner.cancelled()


async def stubborn(release: asyncio.Event) -> None:
    """A task that will not stop when cancelled: it swallows every cancel until `release`."""
    while not release.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await release.wait()


async def test_cancel_and_wait_returns_at_its_timeout_when_the_task_will_not_stop() -> None:
    """wait_for(task, t) would wait for such a task forever; cancel_and_wait does not."""
    release = asyncio.Event()

    task = asyncio.create_task(stubborn(release))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await cancel_and_wait(task, 0.3) is False
    assert 0.25 <= loop.time() - started < 2.0
    assert not task.done()
    release.set()
    await task


async def test_cancel_and_wait_stops_a_willing_task_and_drops_its_error() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, 5) is True
    assert isinstance(task.exception(), RuntimeError)


async def test_a_cancel_of_the_caller_of_cancel_and_wait_reaches_it() -> None:
    release = asyncio.Event()

    inner = asyncio.create_task(stubborn(release))
    outer = asyncio.create_task(cancel_and_wait(inner, 30))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(outer, 2)
    release.set()
    await inner


async def slow_to_stop(cleaned: asyncio.Event, may_end: asyncio.Event) -> None:
    """Stops when cancelled, after a clean-up that waits for `may_end`."""
    try:
        await asyncio.sleep(60)
    finally:
        try:
            await may_end.wait()
        finally:
            cleaned.set()


async def test_a_cancel_of_the_caller_of_cancel_and_join_reaches_it() -> None:
    """The idiom it replaces loses this cancel: the caller's cancel goes to the task being
    joined, comes back out of `await task` as the task's own, and the suppress eats it."""
    cleaned, may_end = asyncio.Event(), asyncio.Event()

    async def closer(task: asyncio.Task[None], joined: Callable[[asyncio.Task[None]],
                                                                Awaitable[None]]) -> str:
        await joined(task)
        return "went on"

    async def old_idiom(task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for joined, caller_cancelled in ((old_idiom, False), (cancel_and_join, True)):
        cleaned.clear()
        may_end.clear()
        task = asyncio.create_task(slow_to_stop(cleaned, may_end))
        await asyncio.sleep(0)
        closing = asyncio.create_task(closer(task, joined))
        await asyncio.sleep(0.05)
        assert not task.done()  # in its clean-up
        closing.cancel()
        await asyncio.sleep(0.05)
        may_end.set()
        if caller_cancelled:
            with pytest.raises(asyncio.CancelledError):
                await closing
        else:  # the old idiom: the cancel is lost
            assert await closing == "went on"
        await asyncio.wait({task})
        assert cleaned.is_set()


async def test_cancel_and_join_waits_for_the_end_and_drops_what_it_ended_with() -> None:
    cleaned, may_end = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(slow_to_stop(cleaned, may_end))
    await asyncio.sleep(0)
    joining = asyncio.create_task(cancel_and_join(task))
    await asyncio.sleep(0.05)
    assert not joining.done()  # the task is still cleaning up
    may_end.set()
    await joining
    assert task.cancelled() and cleaned.is_set()

    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    failing = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    await cancel_and_join(failing)  # the error is dropped, not raised
    assert isinstance(failing.exception(), RuntimeError)
