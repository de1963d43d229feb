"""The captions socket's promise — replay after `since`, then live, no gap, no duplicate —
while the stream is being written fast (every other `since` test replays a finished
stream): clients join at different seqs during a burst of publications and each gets
exactly since+1 … N, in order (real gateway, real Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from orchestrator.gateway.app import GatewayStream
from tests.outputs_support import caption, public_viewers, running_gateway
from workers.bus import RedisBus
from workers.events import StreamOptions

pytestmark = pytest.mark.integration

N = 3000
JOIN_AT = (1, 400, 1200, 2100)


async def test_clients_joining_mid_burst_get_exactly_the_captions_after_their_since(
        redis_url: str, bus: RedisBus) -> None:
    streams = [GatewayStream(StreamOptions(stream_id="hall", name="hall", source="push",
                                           language="en"), "push")]
    async with running_gateway(redis_url, streams, security=public_viewers()) as gw:
        ws = gw.base.replace("http://", "ws://")
        reached = {k: asyncio.Event() for k in JOIN_AT}
        joined = {k: asyncio.Event() for k in JOIN_AT}

        async def publish() -> None:
            for seq in range(1, N + 1):
                await bus.publish_caption(caption(seq, seq, f"sentence {seq}.", seq, seq + 1))
                if seq in joined:  # hold on until that client has connected
                    reached[seq].set()
                    await asyncio.wait_for(joined[seq].wait(), 10)

        async def client(since: int) -> list[int]:
            await reached[since].wait()
            got: list[int] = []
            async with websockets.connect(
                    f"{ws}/v1/streams/hall/captions?lang=en&since={since}") as sock:
                joined[since].set()  # the publisher goes on while we replay
                while not got or got[-1] < N:
                    msg = json.loads(await asyncio.wait_for(sock.recv(), 20))
                    assert msg["type"] == "caption", msg
                    got.append(msg["seq"])
            return got

        results = await asyncio.gather(publish(), *(client(k) for k in JOIN_AT))
        for since, got in zip(JOIN_AT, results[1:], strict=True):
            assert got == list(range(since + 1, N + 1)), (
                f"since={since}: {len(got)} captions, first {got[:3]}, "
                f"duplicates {len(got) - len(set(got))}")
