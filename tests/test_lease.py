"""ASR actor leases (workers/lease.py, issue 35) against a real redis-server: renewed while
the engine works, released at once when it does not, lapsed within the expiry when the
process freezes (SIGSTOP of a real child process) or dies, back when it wakes; and the
supervisor's reader (EventRuntime.watch_leases) takes a lapse for a lost actor but not a
Redis that came back empty for the loss of every actor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis as redis_sync

from orchestrator.config import parse_event
from orchestrator.redis_server import LocalRedisServer, free_port
from orchestrator.runtime import EventRuntime
from tests.waiting import eventually
from workers.lease import LeaseKeeper, lease_key

pytestmark = pytest.mark.integration

CHILD = """
import sys, time
from workers.lease import LeaseKeeper
k = LeaseKeeper(sys.argv[1], sys.argv[2], lambda: True, ttl_s=1.0, every_s=0.2)
k.start()
print("renewing", flush=True)
time.sleep(120)
"""


def test_renewed_while_healthy_released_at_once_when_not(redis_url: str) -> None:
    healthy = [True]
    keeper = LeaseKeeper(redis_url, "asr-7", lambda: healthy[0], ttl_s=2.0, every_s=0.2)
    r = redis_sync.Redis.from_url(redis_url)
    try:
        keeper.start()
        deadline = time.monotonic() + 5
        while r.get(lease_key("asr-7")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.get(lease_key("asr-7")).startswith(b"asr-7 ")
        assert 0 < r.pttl(lease_key("asr-7")) <= 2000
        time.sleep(1.0)
        assert keeper.renewals >= 4  # every 0.2 s
        healthy[0] = False  # the engine died: its streams must not wait 2 s
        t = time.monotonic()
        while r.get(lease_key("asr-7")) is not None and time.monotonic() - t < 2:
            time.sleep(0.02)
        assert r.get(lease_key("asr-7")) is None and time.monotonic() - t < 0.5
        assert keeper.released == 1
        healthy[0] = True  # a new engine: the lease comes back
        time.sleep(0.5)
        assert r.get(lease_key("asr-7")) is not None
    finally:
        keeper.stop()
    assert r.get(lease_key("asr-7")) is None, "a stopped keeper hands its streams over"
    with pytest.raises(ValueError, match="renewed within"):
        LeaseKeeper(redis_url, "x", lambda: True, ttl_s=1.0, every_s=1.0)


def test_a_frozen_process_loses_its_lease_and_gets_it_back_when_it_wakes(
        redis_url: str) -> None:
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, "asr-frozen"],
                             cwd=root, stdout=subprocess.PIPE, text=True)
    r = redis_sync.Redis.from_url(redis_url)
    key = lease_key("asr-frozen")
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "renewing"
        deadline = time.monotonic() + 5
        while r.get(key) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.get(key) is not None
        os.kill(child.pid, signal.SIGSTOP)
        t = time.monotonic()
        while r.get(key) is not None and time.monotonic() - t < 5:
            time.sleep(0.02)
        lapsed_s = time.monotonic() - t
        assert r.get(key) is None and lapsed_s <= 1.0 + 0.3, lapsed_s  # its 1 s expiry
        os.kill(child.pid, signal.SIGCONT)
        t = time.monotonic()
        while r.get(key) is None and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert r.get(key) is not None, "woken, it renews"
        child.kill()  # dies: no delete, the lease expires
        child.wait(5)
        t = time.monotonic()
        while r.get(key) is not None and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert r.get(key) is None and time.monotonic() - t <= 1.3
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(5)


EVENT = """
event: leases
redis: {{url: "{url}"}}
streams:
  - {{id: a, source: push, language: en}}
"""


@contextlib.asynccontextmanager
async def leases_read(tmp_path: Path, actors: tuple[str, ...]
                      ) -> AsyncIterator[tuple[LocalRedisServer, dict[str, LeaseKeeper],
                                               EventRuntime, asyncio.Event]]:
    """A redis-server of this test's own, a keeper (1 s expiry) per actor, and a runtime
    whose lease reader (every 0.1 s) reads them: (server, keepers, runtime, wake)."""
    server = LocalRedisServer(port=free_port(), data_dir=tmp_path / "redis")
    url = server.start()
    keepers = {a: LeaseKeeper(url, a, lambda: True, ttl_s=1.0, every_s=0.2) for a in actors}
    runtime = EventRuntime(parse_event(EVENT.format(url=url)), redis_url=url)
    runtime.asr = dict.fromkeys(actors)  # only their leases are read here
    wake = asyncio.Event()
    watcher = asyncio.create_task(runtime.watch_leases(every_s=0.1, wake=wake))
    try:
        for k in keepers.values():
            k.start()

        async def all_seen() -> bool:
            return runtime._lease_seen == set(actors)

        await eventually(all_seen, 10, "every lease seen")
        yield server, keepers, runtime, wake
    finally:
        watcher.cancel()
        for k in keepers.values():
            k._stop.set()
        await asyncio.gather(watcher, return_exceptions=True)
        server.stop()


async def test_the_supervisor_takes_a_lapse_for_a_lost_actor_not_a_redis_restart(
        tmp_path: Path) -> None:
    async with leases_read(tmp_path, ("asr-0", "asr-1")) as (server, keepers, runtime, wake):
        # Redis comes back empty (no append-only file here): every lease is gone at
        # once, and none of the actors is lost.
        url = server.url
        server.stop()
        empty = LocalRedisServer(port=server.port, data_dir=tmp_path / "redis-empty")
        assert empty.start() == url
        try:
            async def restart_seen() -> bool:
                return runtime.lease_redis_restarts == 1

            async def both_seen() -> bool:
                return runtime._lease_seen == {"asr-0", "asr-1"}

            await eventually(restart_seen, 10, "the reader saw Redis restart")
            await eventually(both_seen, 10, "both leases seen again after the restart")
            assert runtime._lease_lapsed == {}, "a Redis restart is not every actor lost"
            # Now one actor is lost (its keeper stops renewing without a word).
            keepers["asr-0"]._stop.set()
            t = time.monotonic()

            async def lapsed() -> bool:
                return "asr-0" in runtime._lease_lapsed

            await eventually(lapsed, 5, "asr-0's lapse seen")
            assert time.monotonic() - t <= 1.0 + 0.5
            assert wake.is_set() and "asr-1" not in runtime._lease_lapsed
        finally:
            empty.stop()


async def test_every_lease_gone_at_once_is_not_every_actor_lost(tmp_path: Path) -> None:
    """A Redis stalled past the leases' expiry (SIGSTOP: its clock runs on) has every lease
    gone when it answers again: the reader does not move every stream for it (and with
    every actor lost there would be nowhere to move them); one actor lost alone still is."""
    actors = ("asr-0", "asr-1", "asr-2")
    async with leases_read(tmp_path, actors) as (server, keepers, runtime, _):
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)  # Redis stalls for 2.5 s: every key expires
        await asyncio.sleep(2.5)
        os.kill(server.pid, signal.SIGCONT)

        async def noticed() -> bool:
            return runtime.lease_redis_restarts + runtime.lease_all_lapsed >= 1

        async def all_seen() -> bool:
            return runtime._lease_seen == set(actors)

        await eventually(noticed, 10, "Redis's stall noticed")
        await eventually(all_seen, 10, "every lease seen again")
        assert runtime._lease_lapsed == {}
        keepers["asr-2"]._stop.set()  # the control: one actor lost alone is moved

        async def one_lapsed() -> bool:
            return set(runtime._lease_lapsed) == {"asr-2"}

        await eventually(one_lapsed, 5, "asr-2's lapse")


async def test_rays_death_signal_ends_a_lease_at_once_and_only_a_renewal_brings_it_back(
        tmp_path: Path) -> None:
    """Ray's death signal (supervise's watch on the actor failed) withdraws the actor's
    lease: down now, not when the lease expires (withdraw_lease). The dead process's last
    value read again (a read in flight across the delete) is not the actor back; an actor
    that is in fact alive renews and is back."""
    async with leases_read(tmp_path, ("asr-0", "asr-1")) as (server, keepers, runtime, _):
        r = redis_sync.Redis.from_url(server.url)
        key = lease_key("asr-0")
        keepers["asr-0"]._stop.set()  # dies: no more renewals
        keepers["asr-0"]._thread.join(timeout=2)
        # Its last renewal stands until its expiry, 1 s here: written again with a long one,
        # so that the withdraw, not the expiry, ends it on a host of any speed.
        r.set(key, f"asr-0 {time.time():.3f}", px=30_000)
        assert await runtime.withdraw_lease("asr-0")
        assert "asr-0" in runtime._lease_lapsed and r.get(key) is None
        stale = runtime._lease_stale["asr-0"]
        assert stale is not None and stale.split()[0] in ("asr-0", b"asr-0")
        r.set(key, stale, px=1000)  # the dead process's value, read late
        await asyncio.sleep(0.5)  # five reads
        assert "asr-0" in runtime._lease_lapsed, "a stale value is not a renewal"
        assert not await runtime.withdraw_lease("asr-0"), "withdrawn once"

        # The control: a wrong signal for a live actor. It renews within 0.2 s: back.
        assert await runtime.withdraw_lease("asr-1")
        assert "asr-1" in runtime._lease_lapsed

        async def back() -> bool:
            return "asr-1" not in runtime._lease_lapsed and "asr-1" in runtime._lease_seen

        await eventually(back, 3, "asr-1's renewal seen")
        assert "asr-0" in runtime._lease_lapsed

    # Leases off (engine.lease_ttl_s: null): Ray's signal and failover_after_s only.
    off = EventRuntime(parse_event(EVENT.format(url="redis://127.0.0.1:1")
                                   + "engine: {lease_ttl_s: null}\n"), redis_url="")
    off._lease_seen.add("a")
    assert not await off.withdraw_lease("a")
