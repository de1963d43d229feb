"""Shared test setup: a real redis-server on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.redis_server import LocalRedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    server = LocalRedisServer()
    server.start()
    yield server
    server.stop()
