"""How the gateway is served: uvicorn with a header timeout, a connection limit and a
WebSocket frame cap.

uvicorn closes idle keep-alive connections, but a connection that sends part of a
request (or nothing) and stalls stays open for good: 1,000 such connections were all
still open after 90 s. `HeaderTimeoutProtocol` closes a connection whose request
headers are not complete `header_timeout_s` after it opened (or after the first byte of
a later request on the same connection).
"""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.gateway.security_config import LimitsConfig

WS_MAX_MESSAGE_BYTES = 128 * 1024
"""The largest WebSocket message any endpoint takes (a 64 KiB `/v1/realtime` append as
base64 in JSON); each endpoint checks its own smaller cap on top."""


SHUTDOWN_GRACE_S = 3


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s,
                                                      self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()


def protocol_with_timeout(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    return type("GatewayHttpProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, host: str, port: int,
                   limits: LimitsConfig | None = None, *,
                   worker: int | None = None) -> uvicorn.Config:
    """Per-message deflate is off: a caption is a few hundred bytes and browsers ask for
    deflate, so with it on the gateway compressed every caption once per client: a
    quarter of its CPU at 500 clients (bench.delivery). `worker`: with several gateway
    processes, this one's index, sent as `X-Babelcast-Worker` on every response and
    WebSocket handshake (uvicorn adds it; nothing on the message path)."""
    limits = limits or LimitsConfig()
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on",
        headers=[] if worker is None else [("X-Babelcast-Worker", str(worker))],
        ws_per_message_deflate=False, ws_max_size=WS_MAX_MESSAGE_BYTES,
        limit_concurrency=limits.max_connections,
        http=protocol_with_timeout(limits.header_timeout_s),
        # A socket whose client vanished mid-handshake can keep uvicorn's graceful
        # shutdown waiting for good; Ctrl-C should stop the event in seconds.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S)


def tune_gc() -> None:
    """Young collections far less often. The gateway allocates per caption and client, and
    with the default thresholds (700, 10, 10) what a busy second had in flight survived into
    the old generation fast enough for a full collection every 3 s, walking every
    connection's objects: at 2,000 clients 15 % of the gateway's CPU and 0.2-0.3 s pauses,
    which set the p99 of delivery (bench.delivery)."""
    gc.set_threshold(50_000, 20, 10)


LISTEN_BACKLOG = 2048  # uvicorn's own default


def listen_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening socket for uvicorn (`server.serve(sockets=[...])`). `reuse_port`: with
    SO_REUSEPORT, so that every gateway worker process binds the same port and the kernel
    spreads new connections over them (Linux: only processes of the same user may join).
    SO_REUSEADDR as uvicorn sets it: a previous run's TIME_WAIT connections do not make the
    port busy. Port 0 picks a free one; read it back with `getsockname()`. Raises OSError
    when the port is taken."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock
