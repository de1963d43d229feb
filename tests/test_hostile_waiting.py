"""The waiting-connection bound's policy (orchestrator/gateway/server.py), on its own: the
oldest waiting connection goes first, never one younger than the grace unless a burst
passes the hard bound, and an excess is trimmed without waiting for the next arrival.
tests/test_hostile_clients.py shows the same bound on a real gateway under 9,000 sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.gateway import server
from orchestrator.gateway.server import WaitingConnections

pytestmark = pytest.mark.unit


class Conn:
    """A connection as the bound sees it: something it can close."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    def close_waiting(self) -> None:
        self.closed = True


def conns(n: int) -> list[Any]:
    return [Conn(i) for i in range(n)]


async def test_young_connections_are_kept_then_the_oldest_go_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "WAITING_GRACE_S", 0.3)
    waiting = WaitingConnections(16)
    cs = conns(20)
    for c in cs:
        waiting.add(c)
    assert len(waiting) == 20 and not any(c.closed for c in cs)  # a burst of real clients
    await asyncio.sleep(0.5)  # nothing else arrives: the sweep trims anyway
    assert [c.n for c in cs if c.closed] == [0, 1, 2, 3]
    assert len(waiting) == 16 and waiting.evicted == 4


async def test_a_connection_that_is_served_leaves_the_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "WAITING_GRACE_S", 0.0)
    waiting = WaitingConnections(16)
    cs = conns(17)
    for c in cs[:16]:
        waiting.add(c)
    waiting.discard(cs[0])  # its headers came: serving now
    waiting.add(cs[16])
    assert not any(c.closed for c in cs)
    waiting.add(cs[0])  # idle again after its answer: the newest waiting
    assert [c.n for c in cs if c.closed] == [1]


async def test_past_the_hard_bound_the_oldest_goes_whatever_its_age(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "WAITING_GRACE_S", 60.0)
    waiting = WaitingConnections(16)
    cs = conns(16 + server.LISTEN_BACKLOG + 5)
    for c in cs:
        waiting.add(c)
    assert [c.n for c in cs if c.closed] == [0, 1, 2, 3, 4]
    assert len(waiting) == waiting.hard_limit
