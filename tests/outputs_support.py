"""Shared by the output tests: caption factories and the real gateway on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

import uvicorn

from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.app import GatewayStream, create_app
from orchestrator.gateway.auth import Authenticator, GatewaySecrets
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.gateway.server import uvicorn_config
from orchestrator.redis_server import free_port
from workers.events import CaptionSegment, StreamOptions

T = TypeVar("T")
START_TIMEOUT_S = 20.0
ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def public_viewers(limits: LimitsConfig | None = None, **secrets: Any) -> GatewaySecurity:
    """What the output tests run under: captions public (`auth.viewers: public`), admin
    routes behind ADMIN_TOKEN. tests/test_auth.py covers viewer tokens."""
    return GatewaySecurity(
        Authenticator(GatewaySecrets(admin=ADMIN_TOKEN, **secrets), viewers_public=True),
        (), limits or LimitsConfig())


def caption(seq: int, segment_id: int, text: str, start: float, end: float, *,
            final: bool = True, stream: str = "hall", lang: str = "en",
            error: str | None = None, wall: float | None = None) -> CaptionSegment:
    now = time.time()
    return CaptionSegment(
        stream=stream, lang=lang, segment_id=segment_id, seq=seq, revision=0,
        is_final=final, text=text, stable_prefix_len=len(text) if final else 0,
        lines=(text,), audio_start_s=start, audio_end_s=end,
        audio_end_wall=now if wall is None else wall, emit_time=now, error=error)


def hall(targets: tuple[str, ...] = ("fr",)) -> GatewayStream:
    return GatewayStream(StreamOptions(stream_id="hall", name="Main hall", source="push",
                                       language="en", targets=targets), "push")


class _QuietServer(uvicorn.Server):
    """uvicorn inside the test's loop, leaving Ctrl-C to pytest."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Gateway:
    def __init__(self, base: str, server: uvicorn.Server, task: asyncio.Task[None],
                 app: Any = None) -> None:
        self.base = base
        self.server = server
        self.task = task
        self.app = app
        """The ASGI app uvicorn serves (for in-process calls, see tests/asgi_ws.py)."""

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)


async def start_gateway(redis_url: str, streams: list[GatewayStream], *,
                        port: int | None = None, **kwargs: Any) -> Gateway:
    port = port or free_port()
    kwargs.setdefault("security", public_viewers())
    app = create_app(redis_url, streams, "Test event", **kwargs)
    limits = kwargs["security"].limits
    server = _QuietServer(uvicorn_config(app, "127.0.0.1", port, limits))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not start on port {port}")
        await asyncio.sleep(0.02)
    return Gateway(f"http://127.0.0.1:{port}", server, task, app)


@contextlib.asynccontextmanager
async def running_gateway(redis_url: str, streams: list[GatewayStream],
                          **kwargs: Any) -> AsyncIterator[Gateway]:
    gateway = await start_gateway(redis_url, streams, **kwargs)
    try:
        yield gateway
    finally:
        await gateway.stop()


class GatewayThread:
    """The real gateway (uvicorn, real sockets) on its own loop in a thread, for tests
    whose clients are synchronous (hypothesis, schemathesis) and for a gateway shared by a
    whole module. `setup` runs on that loop before the gateway starts (e.g. to publish
    captions)."""

    def __init__(self, redis_url: str, streams: list[GatewayStream], *,
                 setup: Callable[[], Awaitable[None]] | None = None, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gateway-thread")
        self._args = (redis_url, streams, setup, kwargs)
        self._failure: BaseException | None = None
        self.gw: Gateway | None = None

    def _run(self) -> None:
        redis_url, streams, setup, kwargs = self._args
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            if setup is not None:
                await setup()
            self.gw = await start_gateway(redis_url, streams, **kwargs)

        try:
            self.loop.run_until_complete(start())
        except BaseException as exc:
            self._failure = exc
            return
        finally:
            self._ready.set()
        self.loop.run_forever()  # until __exit__ stops it, after the gateway

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._ready.wait(START_TIMEOUT_S + 30), "the gateway thread did not start"
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.gw is not None:
                self.call(self.gw.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(15)
            if not self._thread.is_alive():
                self.loop.close()

    @property
    def base(self) -> str:
        assert self.gw is not None
        return self.gw.base

    @property
    def app(self) -> Any:
        assert self.gw is not None
        return self.gw.app

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run `coro` on the gateway's loop (the app's Redis clients live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)
