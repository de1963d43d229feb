"""How the gateway is served: uvicorn with a header timeout, a connection limit and a
WebSocket frame cap.

uvicorn closes idle keep-alive connections, but a connection that sends part of a
request (or nothing) and stalls stays open for good: 1,000 such connections were all
still open after 90 s. `HeaderTimeoutProtocol` closes a connection whose request
headers are not complete `header_timeout_s` after it opened (or after the first byte of
a later request on the same connection).

Connections are counted in two kinds. A connection *waiting* holds no request being served:
its headers are not complete yet, or it is idle between keep-alive requests. A connection
*serving* has a request in flight (or is a WebSocket). uvicorn's own `limit_concurrency`
counts both, so ~4,100 clients that opened connections and trickled bytes held all 4,096
places and `/livez` itself answered 503. Here waiting connections are bounded apart
(`max_pending_connections`): past the bound the one that has waited longest is closed (a
real client's headers arrive in milliseconds, so it is never the oldest), and
`max_connections` counts serving connections only. Bodies are bounded where they are read
(`body_guard`): auth and size before a byte of the body, then a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import resource
import socket
import time
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator import metrics
from orchestrator.gateway.security_config import LimitsConfig

WS_MAX_MESSAGE_BYTES = 128 * 1024
"""The largest WebSocket message any endpoint takes (a 64 KiB `/v1/realtime` append as
base64 in JSON); each endpoint checks its own smaller cap on top."""


SHUTDOWN_GRACE_S = 3
LISTEN_BACKLOG = 2048  # uvicorn's own default


log = logging.getLogger(__name__)


WAITING_GRACE_S = 2.0
"""A waiting connection younger than this is not closed for the soft bound: a burst of
accepts (up to the listen backlog at once) runs every connection_made before any data is
read, so the newest connections of a burst would otherwise close real clients whose
request was already in the kernel's buffer (seen in tests/test_hostile_clients.py as
resets)."""


class WaitingConnections:
    """The connections of one server that hold no request being served, oldest first.
    Past `limit`, `add` closes the oldest that waited at least `WAITING_GRACE_S`; past
    `limit + LISTEN_BACKLOG` (more than one burst of accepts) the oldest, whatever its
    age."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.hard_limit = limit + LISTEN_BACKLOG
        self._waiting: collections.OrderedDict[HeaderTimeoutProtocol, float] = (
            collections.OrderedDict())
        self.evicted = 0
        self._warned_at = 0.0
        self._sweep: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, conn: HeaderTimeoutProtocol) -> None:
        if conn not in self._waiting:
            self._waiting[conn] = time.monotonic()
        self._trim()

    def _trim(self) -> None:
        self._sweep = None
        now = time.monotonic()
        while len(self._waiting) > self.limit:
            oldest, since = next(iter(self._waiting.items()))
            if now - since < WAITING_GRACE_S and len(self._waiting) <= self.hard_limit:
                # Too young yet: look again when it is not (nothing else may arrive).
                if self._sweep is None:
                    self._sweep = asyncio.get_running_loop().call_later(
                        WAITING_GRACE_S - (now - since) + 0.01, self._trim)
                return
            del self._waiting[oldest]
            oldest.close_waiting()
            self.evicted += 1
            metrics.GATEWAY_REFUSALS.labels(refusal="cap").inc()
            if now - self._warned_at > 60.0:  # one line a minute, not one per connection
                self._warned_at = now
                log.warning("more than %d connections hold no request "
                            "(gateway.limits.max_pending_connections); closing the oldest "
                            "(%d closed so far)", self.limit, self.evicted)

    def discard(self, conn: HeaderTimeoutProtocol) -> None:
        self._waiting.pop(conn, None)


MAX_HEADER_BYTES = 64 * 1024
"""The request line and headers of one request (uvicorn's h11 takes 16 KiB; a viewer token
in the URL is ~300 bytes): past it, 431 and the connection is closed."""
LINGER_S = 2.0
LINGER_MAX_BYTES = 4 * 1024 * 1024
"""After an answer that left the request's body unread (a 401 or 413 from `body_guard`),
the socket is half-closed and what the client still sends is read and dropped for up to
this long and this many bytes before the close. A client that writes its whole body
before reading (httpx, curl) then reads the answer; closed at once, the unread bytes made
the kernel reset the connection and the client saw a reset instead of the 401."""


class _LingerOnClose:
    """The transport as a request cycle sees it: `close()` goes through the protocol."""

    def __init__(self, transport: asyncio.Transport, protocol: HeaderTimeoutProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_after_answer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_connections: int = 4_096
    waiting: ClassVar[WaitingConnections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._lingering = -1  # bytes dropped while lingering; -1: not lingering
        self._header_bytes = 0  # bytes of the request line and headers read so far

    def close_after_answer(self) -> None:
        cycle = self.cycle
        if (cycle is None or not cycle.response_complete or not cycle.more_body
                or self.transport.is_closing() or not self.transport.can_write_eof()):
            self.transport.close()
            return
        self._lingering = 0
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.close_waiting)
        self.waiting.add(self)  # its place is the first to go when places are short

    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:
            self._lingering += len(data)
            if self._lingering > LINGER_MAX_BYTES:
                self.close_waiting()
            return
        super().data_received(data)
        if self._header_timer is not None:  # the headers are still not complete
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                # httptools keeps whatever a header line brings until it ends: without
                # this a client could send hundreds of MB within the header timeout.
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                     b"content-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    def _arm(self) -> None:
        self._header_bytes = 0
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s,
                                                      self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        self.close_waiting()

    def close_waiting(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self.waiting.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.waiting.discard(self)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        # Serving from here on (a WebSocket upgrade leaves this protocol for good).
        self.waiting.discard(self)
        # uvicorn answers 503 once len(connections) reaches its limit: shift the limit by
        # the waiting connections, so that it counts the serving ones only.
        self.limit_concurrency = self.max_connections + len(self.waiting)
        super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, _LingerOnClose):
            # Its task has not run yet: the cycle closes through us from the start.
            self.cycle.transport = _LingerOnClose(self.cycle.transport, self)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self.waiting.add(self)  # idle keep-alive: waiting for its next request


def protocol_with_timeout(header_timeout_s: float, max_connections: int = 4_096,
                          max_pending: int = 1_024) -> type[HeaderTimeoutProtocol]:
    """A protocol class per server: its waiting connections are counted apart from any
    other server's in the same process (tests run several)."""
    return type("GatewayHttpProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections,
                 "waiting": WaitingConnections(max_pending)})


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-file limit towards `wanted` (within the hard limit): every
    connection is a descriptor, and a soft limit of 1,024 (common) would refuse
    connections long before the bounds above decide anything."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft,
                        target, exc)


def uvicorn_config(app: Any, host: str, port: int,
                   limits: LimitsConfig | None = None, *,
                   worker: int | None = None) -> uvicorn.Config:
    """Per-message deflate is off: a caption is a few hundred bytes and browsers ask for
    deflate, so with it on the gateway compressed every caption once per client: a
    quarter of its CPU at 500 clients (bench.delivery). `worker`: with several gateway
    processes, this one's index, sent as `X-Babelcast-Worker` on every response and
    WebSocket handshake (uvicorn adds it; nothing on the message path)."""
    limits = limits or LimitsConfig()
    # Serving and waiting connections, plus Redis, logs and the workers' own sockets.
    raise_fd_limit(limits.max_connections + limits.max_pending_connections + LISTEN_BACKLOG
                   + 1_024)
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on",
        headers=[] if worker is None else [("X-Babelcast-Worker", str(worker))],
        ws_per_message_deflate=False, ws_max_size=WS_MAX_MESSAGE_BYTES,
        # Counted by the protocol (serving connections only), not by uvicorn.
        limit_concurrency=None,
        http=protocol_with_timeout(limits.header_timeout_s, limits.max_connections,
                                   limits.max_pending_connections),
        # X-Forwarded-For names the client only when a configured proxy sent it; uvicorn
        # would otherwise believe it from loopback (anyone on the machine).
        proxy_headers=bool(limits.trusted_proxies),
        forwarded_allow_ips=list(limits.trusted_proxies),
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
