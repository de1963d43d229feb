"""Every byte of a request body bounded before it costs anything (ASGI middleware).

FastAPI reads and parses a body before the endpoint runs, so the endpoint's own token
check came too late: a 300 MiB JSON body to `POST /v1/tokens` without a token was read
and parsed whole before its 401 (gateway RSS 189 → 1,312 MiB, `/livez` 4.1 s late), and
validation details (422) answered anyone. Here, in front of every route:

1. A route that takes a body (`BodyRoute`: its size bound and who may send it) checks the
   token first (401/403) and the declared `Content-Length` next (413), before the body
   is read at all; a route that takes none refuses a body with 413.
2. The body is read under a deadline (`body_timeout_s` from the headers, 408) and its
   bound (a chunked body past it: 413), then its JSON nesting (`json_bounds`, 400).
3. Only then is the endpoint called, with the body replayed from memory (at most the
   route's bound: 64 KiB for tokens, 260 KiB for an event file).

A refusal before the body was read whole says `Connection: close`: uvicorn closes the
socket after the answer, so the rest of the body is never read (the kernel's buffer, a
few hundred KiB, is all it costs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import HTTPException
from starlette.datastructures import Headers, QueryParams
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator import metrics
from orchestrator.gateway.access import Access, Check
from orchestrator.gateway.json_bounds import MAX_JSON_DEPTH, nesting_over
from workers.aio import wait_for


@dataclass(frozen=True, slots=True)
class BodyRoute:
    """A route that takes a body: at most `max_bytes`, from a principal `check` admits."""

    max_bytes: int
    check: Check
    what: str
    """What the caller does, for the 401/403 message ("minting tokens")."""
    json: bool = True


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None,
                 refusal: str = "size") -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.refusal = refusal


class BodyGuard:
    def __init__(self, app: ASGIApp, *, access: Access,
                 routes: Mapping[tuple[str, str], BodyRoute], timeout_s: float,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.access = access
        self.routes = dict(routes)
        self.timeout_s = timeout_s
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        try:
            headers = Headers(scope=scope)
            declared, chunked = _declared_length(headers)
            route = self.routes.get((scope["method"], scope["path"]))
            if route is None:
                if chunked or (declared or 0) > 0:
                    raise _Refused(413, "this route takes no request body")
                await self.app(scope, receive, send)
                return
            try:
                self.access.http_headers(headers, QueryParams(scope.get("query_string", b"")),
                                         route.check, route.what)
            except HTTPException as exc:
                raise _Refused(exc.status_code, str(exc.detail), exc.headers,
                               "unauthorized" if exc.status_code == 401 else "forbidden"
                               ) from None
            if declared is not None and declared > route.max_bytes:
                raise _Refused(413, f"the body is over {route.max_bytes} bytes "
                                    f"({declared} declared)")
            body = await self._read(receive, route, started)
        except _Refused as exc:
            metrics.GATEWAY_REFUSALS.labels(refusal=exc.refusal).inc()
            await _answer(send, exc)
            return
        except _Gone:
            return
        if route.json and nesting_over(body, self.max_depth):
            metrics.GATEWAY_REFUSALS.labels(refusal="size").inc()
            await _answer(send, _Refused(400, f"the JSON body nests deeper than "
                                              f"{self.max_depth} levels"))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, route: BodyRoute, started: float) -> bytes:
        body = bytearray()
        deadline = started + self.timeout_s
        while True:
            try:
                message = await wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise _Refused(408, f"the request body did not arrive within "
                                    f"{self.timeout_s:g} s (gateway.limits.body_timeout_s)",
                               refusal="slow_client") from None
            if message["type"] == "http.disconnect":
                raise _Gone
            body += message.get("body", b"")
            if len(body) > route.max_bytes:
                raise _Refused(413, f"the body is over {route.max_bytes} bytes")
            if not message.get("more_body", False):
                return bytes(body)


class _Gone(Exception):
    """The client left while sending its body: nobody to answer."""


def _declared_length(headers: Headers) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked). The HTTP parser already refused a malformed
    Content-Length or one beside Transfer-Encoding."""
    chunked = "transfer-encoding" in headers
    raw = headers.get("content-length")
    if raw is None or not raw.strip().isdigit():
        return None, chunked
    return int(raw), chunked


async def _answer(send: Send, refused: _Refused) -> None:
    body = json.dumps({"detail": str(refused)}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               # The rest of the body is not read: the socket closes after this answer.
               (b"connection", b"close")]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in refused.headers.items()]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
