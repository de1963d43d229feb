"""Shared test setup: a real redis-server on a free port, emptied per test that asks."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from types import FrameType

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from orchestrator.redis_server import LocalRedisServer
from workers.bus import RedisBus, connect_redis


def pytest_configure(config: pytest.Config) -> None:
    """The suite measures this host into a calibration cache of its own (the embedded
    default streams per actor, `engine.calibrate`): figures taken while the suite loads the
    host are low and must not land in the user's cache. Set before any actor, Ray or
    `babelcast run` child starts, so they inherit it; xdist's workers inherit the
    controller's."""
    from workers.engines.calibrate import CACHE_ENV

    if not os.environ.get(CACHE_ENV):
        folder = tempfile.mkdtemp(prefix="babelcast-suite-calibration-")
        os.environ[CACHE_ENV] = os.path.join(folder, "calibration.json")
        _made_here.append(folder)


_made_here: list[str] = []
"""The suite's calibration folder, where this process made it (xdist's workers inherit
the controller's and leave it alone)."""


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _made_here:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray of the test module's own (address="local": never one another test run left on
    this machine), two CPUs, shut down after the module."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    server = LocalRedisServer()
    server.start()
    yield server
    server.stop()


class LeftoverWriter(UserWarning):
    """A connection an earlier test left open sent commands into this test's emptied
    Redis: something of that test (an actor, a run, a reader) still runs."""


async def _connections(client: Redis) -> dict[int, dict[str, str]]:
    """The connections to `client`'s database but its own (a module's own event may use
    another database of the same server: not counted)."""
    own = await client.client_id()
    db = str(client.connection_pool.connection_kwargs.get("db", 0))
    return {int(c["id"]): {k: str(c.get(k, "")) for k in ("addr", "age", "idle", "cmd",
                                                          "flags")}
            for c in await client.client_list()
            if int(c["id"]) != own and str(c.get("db")) == db}


@pytest.fixture
async def redis_url(redis_server: LocalRedisServer,
                    request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The session-wide server, emptied for this test.

    Then a check of the test's isolation: what an earlier test left running (an actor, a
    run, a reader) and that wrote into or read from this test's Redis is reported as a
    `LeftoverWriter` warning (in the run's warnings summary). A connection open before
    the flush counts when it sent a command over a second after the flush, or waits in a
    blocking read (its process may merely not be reaped yet when the flush comes, so its
    state then says nothing)."""
    client = connect_redis(redis_server.url)
    try:
        before = await _connections(client)
        await client.flushdb()
        flushed = time.monotonic()
    finally:
        await client.aclose()
    yield redis_server.url
    if before:
        client = connect_redis(redis_server.url)
        try:
            after = await _connections(client)
        except (RedisError, OSError):  # the test left this server unreachable: no check
            after = {}
        finally:
            await client.aclose()
        since = time.monotonic() - flushed
        late = [c for cid, c in after.items() if cid in before
                and (int(c["idle"]) < since - 1 or "b" in c["flags"])]
        if late:
            warnings.warn(LeftoverWriter(
                f"{request.node.nodeid}: connections an earlier test left open used its "
                f"Redis during its {since:.0f} s: {late}"), stacklevel=1)


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[RedisBus]:
    client = connect_redis(redis_url)
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


TASKS_BEFORE_TIMEOUT_S = 20.0
"""How long before pytest-timeout's limit every asyncio task's stack is printed."""


def _awaiting(task: asyncio.Task[object]) -> list[str]:
    """Where a task waits: its coroutine and every coroutine it awaits, outermost first
    (`Task.print_stack` shows only the outermost)."""
    lines: list[str] = []
    obj: object = task.get_coro()
    while obj is not None and len(lines) < 30:
        frame = (getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
                 or getattr(obj, "ag_frame", None))
        if frame is None:
            lines.append(f"  awaiting {obj!r}")
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        obj = (getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
               or getattr(obj, "ag_await", None))
    return lines


def _print_tasks(signum: int, frame: FrameType | None) -> None:
    """Where every task of the running loop waits (signal handler, main thread)."""
    loop = asyncio._get_running_loop()
    tasks = asyncio.all_tasks(loop) if loop is not None else set()
    print(f"+++ {len(tasks)} asyncio task(s), {TASKS_BEFORE_TIMEOUT_S:.0f} s before the "
          "test's timeout +++", file=sys.stderr)
    for task in tasks:
        print(f"task {task.get_name()}:", *_awaiting(task), sep="\n", file=sys.stderr)


@pytest.fixture(autouse=True)
def _asyncio_tasks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """pytest-timeout's dump shows threads, and a hung asyncio test shows only its loop in
    select() (test_asr_host's restart test, CI 2026-12-02: no clue where it waited). So
    shortly before the limit, every asyncio task's stack goes to stderr, which the failure
    report shows."""
    marker = request.node.get_closest_marker("timeout")
    limit = (float(marker.args[0]) if marker and marker.args
             else float(request.config.getini("timeout") or 0))
    if limit <= TASKS_BEFORE_TIMEOUT_S or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR1, _print_tasks)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(limit - TASKS_BEFORE_TIMEOUT_S, signal.pthread_kill,
                            (main, signal.SIGUSR1))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
