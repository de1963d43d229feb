"""Shared test setup: a real redis-server on a free port, emptied per test that asks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from orchestrator.redis_server import LocalRedisServer
from workers.bus import RedisBus


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    server = LocalRedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis_url(redis_server: LocalRedisServer) -> AsyncIterator[str]:
    """The session-wide server, emptied for this test."""
    client = Redis.from_url(redis_server.url)
    try:
        await client.flushdb()
    finally:
        await client.aclose()
    yield redis_server.url


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[RedisBus]:
    client = Redis.from_url(redis_url)
    yield RedisBus(client)
    await client.aclose()


TIERS = ("unit", "integration", "gpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test declares its tier (STYLE: "every test module declares its tier"): a test
    with none is a collection error, not a test that silently runs in no tier."""
    missing = [item.nodeid for item in items
               if not any(item.get_closest_marker(t) for t in TIERS)]
    if missing:
        raise pytest.UsageError("tests without a unit/integration/gpu marker:\n  "
                                + "\n  ".join(missing))
