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
                   limits: LimitsConfig | None = None) -> uvicorn.Config:
    """Per-message deflate is off: a caption is a few hundred bytes and browsers ask for
    deflate, so with it on the gateway compressed every caption once per client: a
    quarter of its CPU at 500 clients (bench.delivery)."""
    limits = limits or LimitsConfig()
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on",
        ws_per_message_deflate=False, ws_max_size=WS_MAX_MESSAGE_BYTES,
        limit_concurrency=limits.max_connections,
        http=protocol_with_timeout(limits.header_timeout_s),
        # A socket whose client vanished mid-handshake can keep uvicorn's graceful
        # shutdown waiting for good; Ctrl-C should stop the event in seconds.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
