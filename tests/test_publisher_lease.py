"""The publisher lease (orchestrator/gateway/publishers.py) on a real redis-server.

CI saw the case this covers: Redis (or the host) stood still ~19 s, longer than the
15 s lease, so the key expired with nobody else holding it; the renewal then took the
only publisher for a lost one and closed it with 4409 `publisher_busy`. A lease nobody
holds is taken back; only one another publisher holds is lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from orchestrator.gateway import publishers
from orchestrator.gateway.publishers import LEASE_S, PublisherLease, lease_key

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Redis]:
    monkeypatch.setattr(publishers, "RENEW_S", 0.05)
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def held_lease(redis: Redis) -> tuple[PublisherLease, list[str]]:
    lost: list[str] = []

    async def on_lost() -> None:
        lost.append("lost")

    lease = PublisherLease(redis, "room", on_lost)
    assert await lease.claim()
    return lease, lost


async def test_a_lease_renewed_stays_ours(redis: Redis) -> None:
    lease, lost = await held_lease(redis)
    mine = await redis.get(lease_key("room"))
    await asyncio.sleep(0.3)
    assert await redis.get(lease_key("room")) == mine and lost == []
    assert 0 < await redis.pttl(lease_key("room")) <= LEASE_S * 1000
    await lease.release()
    assert not await redis.exists(lease_key("room"))


async def test_a_lease_that_expired_with_nobody_holding_it_is_taken_back(redis: Redis) -> None:
    lease, lost = await held_lease(redis)
    mine = await redis.get(lease_key("room"))
    await redis.delete(lease_key("room"))  # what the expiry (or an empty restart) leaves
    await asyncio.sleep(0.3)
    assert lost == []
    assert await redis.get(lease_key("room")) == mine
    assert 0 < await redis.pttl(lease_key("room")) <= LEASE_S * 1000
    # and a second publisher is still refused
    other = PublisherLease(redis, "room", lambda: asyncio.sleep(0))
    assert not await other.claim()
    await lease.release()


async def test_a_lease_another_publisher_took_is_lost(redis: Redis) -> None:
    lease, lost = await held_lease(redis)
    await redis.set(lease_key("room"), "another-publisher", ex=LEASE_S)
    for _ in range(40):
        if lost:
            break
        await asyncio.sleep(0.05)
    assert lost == ["lost"]
    assert await redis.get(lease_key("room")) == b"another-publisher"
    await lease.release()  # gives back only its own: the other's stays
    assert await redis.get(lease_key("room")) == b"another-publisher"


async def test_release_returns_when_the_renewals_redis_call_swallows_the_cancel(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite once hung 300 s in `release()`: the renewal task was still looping after
    its cancel. Fault injection (clearly not Redis): the client's `eval` turns a cancel
    into a ConnectionError, as a client library may when a cancel lands mid-command. The
    renewal loop takes that for Redis being away and would go on; release must not wait
    for it."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    real_eval = redis.eval
    calls = 0

    async def swallowing_eval(*args: object) -> object:
        nonlocal calls
        calls += 1
        try:
            await asyncio.sleep(0.2)  # the command in flight when the cancel comes
        except asyncio.CancelledError:
            raise RedisConnectionError("connection reset while cancelled") from None
        return await real_eval(*args)  # type: ignore[arg-type]

    lease, lost = await held_lease(redis)
    monkeypatch.setattr(redis, "eval", swallowing_eval)
    for _ in range(40):  # until a renewal is in its Redis call
        if calls:
            break
        await asyncio.sleep(0.05)
    assert calls, "no renewal ran"
    await asyncio.wait_for(lease.release(), 5)
    assert lost == []
