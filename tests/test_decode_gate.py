"""The embedded engine's decode gate: one decode at a time, finals before interims."""

from __future__ import annotations

import asyncio

import pytest

from workers.engines.embedded import DecodeGate

pytestmark = pytest.mark.unit


async def _holder(gate: DecodeGate, priority: int, name: str, order: list[str],
                  hold: asyncio.Event | None = None) -> None:
    await gate.acquire(priority)
    try:
        order.append(name)
        if hold is not None:
            await hold.wait()
        await asyncio.sleep(0)
    finally:
        gate.release()


def test_a_final_that_arrives_later_goes_before_waiting_interims() -> None:
    async def run() -> list[str]:
        gate, order, hold = DecodeGate(), [], asyncio.Event()
        first = asyncio.create_task(_holder(gate, DecodeGate.INTERIM, "busy", order, hold))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(_holder(gate, DecodeGate.INTERIM, f"interim-{i}", order))
                   for i in range(2)]
        await asyncio.sleep(0)
        final = asyncio.create_task(_holder(gate, DecodeGate.FINAL, "final", order))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.gather(first, *waiting, final)
        return order

    assert asyncio.run(run()) == ["busy", "final", "interim-0", "interim-1"]


def test_a_cancelled_waiter_never_holds_the_thread() -> None:
    async def run() -> list[str]:
        gate, order, hold = DecodeGate(), [], asyncio.Event()
        first = asyncio.create_task(_holder(gate, DecodeGate.INTERIM, "busy", order, hold))
        await asyncio.sleep(0)
        gone = asyncio.create_task(_holder(gate, DecodeGate.FINAL, "gone", order))
        later = asyncio.create_task(_holder(gate, DecodeGate.INTERIM, "later", order))
        await asyncio.sleep(0)
        gone.cancel()
        hold.set()
        await asyncio.gather(first, later)
        assert gone.cancelled()
        # Handed the thread and cancelled in the same moment: it passes the thread on.
        await gate.acquire(DecodeGate.INTERIM)  # free: taken at once
        order.append("busy2")
        racer = asyncio.create_task(gate.acquire(DecodeGate.FINAL))
        tail = asyncio.create_task(_holder(gate, DecodeGate.INTERIM, "tail", order))
        await asyncio.sleep(0)  # both wait, the racer first
        gate.release()  # hands the thread to the racer ...
        racer.cancel()  # ... which is cancelled before it runs
        await asyncio.wait_for(tail, 1.0)
        with pytest.raises(asyncio.CancelledError):
            await racer
        await asyncio.wait_for(gate.acquire(DecodeGate.INTERIM), 1.0)  # free again
        return order

    assert asyncio.run(run()) == ["busy", "later", "busy2", "tail"]
