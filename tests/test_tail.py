"""`babelcast tail` ends when the event does, with a message, instead of retrying forever."""

from __future__ import annotations

import asyncio
import sys

import pytest

from orchestrator.redis_server import free_port
from tests.outputs_support import caption, hall, start_gateway
from tests.speech import ROOT
from workers.bus import RedisBus

pytestmark = pytest.mark.integration


async def tail(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli", "tail", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def test_tail_stops_with_a_message_when_the_gateway_shuts_down(
        redis_url: str, bus: RedisBus) -> None:
    gateway = await start_gateway(redis_url, [hall()])
    try:
        await bus.publish_caption(caption(1, 1, "Hello.", 0.0, 1.0))
        proc = await tail("hall", "--url", gateway.base, "--since", "0")
        assert proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert b"Hello." in line
    finally:
        await gateway.stop()  # what `babelcast run` does when the event ends
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    err = (await proc.stderr.read()).decode()
    assert "the event has ended" in err and gateway.base in err


async def test_tail_gives_up_on_a_gateway_that_never_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = await tail("hall", "--url", url, "--give-up", "1")
    assert proc.stderr is not None
    assert await asyncio.wait_for(proc.wait(), 20) == 1
    err = (await proc.stderr.read()).decode()
    assert f"no gateway at {url} for 1 s" in err
