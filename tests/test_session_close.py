"""Closing a session waits for its task to end (its engine slot is free only then), and a
cancel of whoever closes it reaches them: under `suppress(CancelledError)` it was lost,
and a session manager closing a session went on running with its stream gone."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from workers.engines.base import RecognizeSession, SessionInput, SessionOptions

pytestmark = pytest.mark.unit


class SlowToStop(RecognizeSession):
    """TEST DOUBLE session: when cancelled, its clean-up waits for `may_end`, whatever
    cancels it meanwhile (a clean-up stuck on a thread, say)."""

    def __init__(self) -> None:
        super().__init__(SessionOptions("s"))
        self.may_end = asyncio.Event()
        self.ended = False

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            while not self.may_end.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await self.may_end.wait()
            self.ended = True


async def test_aclose_waits_for_the_sessions_end_past_its_grace() -> None:
    session = SlowToStop()
    session.start()
    await asyncio.sleep(0)
    closing = asyncio.create_task(session.aclose(grace_s=0.1))
    await asyncio.sleep(0.3)
    assert not closing.done()  # past the grace: cancelled again, its end still awaited
    session.may_end.set()
    await closing
    assert session.ended


async def test_a_cancel_of_whoever_closes_a_session_reaches_them() -> None:
    session = SlowToStop()
    session.start()
    await asyncio.sleep(0)

    async def closer() -> str:
        await session.aclose(grace_s=5)
        return "went on as if not cancelled"

    closing = asyncio.create_task(closer())
    await asyncio.sleep(0.05)
    closing.cancel()
    await asyncio.sleep(0.05)
    session.may_end.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.sleep(0.05)
    assert session.ended
