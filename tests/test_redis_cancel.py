"""A task stopped by `cancel()` while it talks to Redis stops: the clients every process
makes (`workers.bus.connect_redis`) never drop a cancel, and a send that outlives
`socket_timeout` still fails as a Redis timeout. Real redis-server throughout."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator.redis_server import LocalRedisServer
from workers.bus import cancel_safe, connect_redis

pytestmark = pytest.mark.integration

CANCELS = 300


async def cancels_lost(client: Redis, n: int) -> int:
    """Start a loop of GETs `n` times and cancel it 0-3 ms later: how many loops went on
    as if never cancelled (their task says it was asked to cancel, yet the command
    returned)."""
    lost = 0
    rng = random.Random(7)

    async def loop() -> str:
        while True:
            await client.get("k")
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                return "lost"

    for _ in range(n):
        task = asyncio.create_task(loop())
        await asyncio.sleep(rng.uniform(0.0, 0.003))
        task.cancel()
        try:
            lost += await asyncio.wait_for(task, 5) == "lost"
        except asyncio.CancelledError:
            pass
    return lost


async def test_a_loop_of_redis_commands_stops_at_its_first_cancel(redis_url: str) -> None:
    """redis-py 8 sends through `asyncio.wait_for`, which on Python 3.11 drops a cancel
    that meets the send's end: plain clients lost 233 of 300 here. An ASR host's audio
    reader went on reading after its stop cancelled it."""
    client = connect_redis(redis_url)
    try:
        await client.ping()
        assert await cancels_lost(client, CANCELS) == 0
        assert await client.get("k") is None  # the client still works after 300 cancels
    finally:
        await client.aclose()


def test_cancel_safe_keeps_the_connection_class_the_url_chose() -> None:
    for url, base in (("redis://127.0.0.1:1", "Connection"),
                      ("rediss://127.0.0.1:1", "SSLConnection"),
                      ("unix:///tmp/none.sock", "UnixDomainSocketConnection")):
        cls = connect_redis(url).connection_pool.connection_class
        assert cls.__name__ == f"CancelSafe{base}"
        assert [c.__name__ for c in cls.__mro__].index(base) > 0
    client = connect_redis("redis://127.0.0.1:1")
    before = client.connection_pool.connection_class
    assert cancel_safe(client).connection_pool.connection_class is before  # not twice


async def test_a_send_to_a_stalled_redis_still_times_out_and_the_client_recovers(
    tmp_path: object,
) -> None:
    """The send's own bound stays: a Redis that stops reading (SIGSTOP: its socket
    buffers fill) makes a large write fail with redis-py's TimeoutError after
    `socket_timeout`, and the client works again once Redis does."""
    server = LocalRedisServer()
    server.start()
    client = connect_redis(server.url, socket_timeout=0.5)
    pid = server.pid
    assert pid is not None
    try:
        await client.ping()
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(client.set("big", b"x" * (64 << 20)), 20)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await client.ping()
        await client.set("small", b"y")
        assert await client.get("small") == b"y"
    finally:
        await client.aclose()
        server.stop()
