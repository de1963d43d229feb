"""Admission at the gateway's door: Origin, token, scope and connection caps.

HTTP: a missing or bad token is 401 (with `WWW-Authenticate: Bearer`), a good token
without the scope 403. WebSockets: a foreign Origin is refused before the handshake
(HTTP 403: browsers apply no CORS to WebSockets, so without this check any page open in
the operator's browser could push audio or read captions); past that the socket is
accepted so that the client can read why it is closed: an `error` event, then 4401
(no valid token), 4403 (wrong scope) or 1013 (a cap; retry later).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, WebSocket
from starlette.websockets import WebSocketState

from orchestrator.gateway.auth import PUBLIC_VIEWER, Authenticator, AuthError, Principal, presented
from orchestrator.gateway.limits import CapExceeded, ConnectionCaps
from orchestrator.gateway.security_config import LimitsConfig

Check = Callable[[Principal], bool]
TRY_AGAIN_LATER = 1013


def error_text(code: str, message: str) -> str:
    return json.dumps({"type": "error", "code": code, "message": message})


@dataclass(frozen=True)
class GatewaySecurity:
    """What the gateway needs to admit clients."""

    auth: Authenticator
    allowed_origins: tuple[str, ...] = ()
    limits: LimitsConfig = field(default_factory=LimitsConfig)


def origin_allowed(headers: dict[str, str] | object, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a browser), the gateway's own origin, or one the event allows."""
    get = getattr(headers, "get")  # noqa: B009 - Starlette Headers or a dict
    origin = get("origin")
    if origin is None:
        return True
    if "*" in allowed or origin.rstrip("/") in allowed:
        return True
    host = (get("host") or "").lower()
    return bool(host) and urlsplit(origin).netloc.lower() == host


@dataclass(frozen=True, slots=True)
class Admitted:
    principal: Principal
    ip: str


class Access:
    def __init__(self, security: GatewaySecurity) -> None:
        self.security = security
        self.auth = security.auth
        self.caps = ConnectionCaps(security.limits.max_ws_per_ip,
                                   security.limits.max_viewers_per_stream)

    def principal(self, headers: object, query: object) -> tuple[Principal | None, str | None]:
        """(principal or None, subprotocol); raises AuthError for a bad token."""
        found = presented(headers, query)  # type: ignore[arg-type]
        p = self.auth.identify(found.token, via_query=found.via_query)
        if p is None and self.auth.viewers_public:
            p = PUBLIC_VIEWER
        return p, found.subprotocol

    def http(self, request: Request, check: Check, what: str) -> Principal:
        """The caller's principal, or HTTPException 401/403."""
        return self.http_headers(request.headers, request.query_params, check, what)

    def http_headers(self, headers: object, query: object, check: Check,
                     what: str) -> Principal:
        """As `http`, from the request's headers and query alone (`body_guard` checks
        before a byte of the body is read)."""
        try:
            p, _ = self.principal(headers, query)
        except AuthError as exc:
            raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
        if p is None or (p is PUBLIC_VIEWER and not check(p)):
            # Anonymous (a public viewer is anyone): a token is what is missing, not scope.
            raise HTTPException(401, f"{what} needs a token: send `Authorization: Bearer "
                                     "TOKEN` (see README, Security)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not check(p):
            raise HTTPException(403, f"this {p.kind} token does not allow {what}")
        return p

    async def websocket(self, ws: WebSocket, check: Check, what: str) -> Admitted | None:
        """Admit a WebSocket (accepted on return) or refuse it (closed; None). An
        admitted socket must be handed back with `release`."""
        if not origin_allowed(ws.headers, self.security.allowed_origins):
            await ws.close(code=1008)  # before accept: the handshake gets HTTP 403
            return None
        try:
            p, subprotocol = self.principal(ws.headers, ws.query_params)
            error: AuthError | None = None
            if p is None or (p is PUBLIC_VIEWER and not check(p)):
                error = AuthError(401, f"{what} needs a token: send it as `Authorization: "
                                       "Bearer TOKEN`, as the subprotocol `bearer.TOKEN` "
                                       "(with `babelcast`), or as ?token= (viewers)")
            elif not check(p):
                error = AuthError(403, f"this {p.kind} token does not allow {what}")
        except AuthError as exc:
            p, subprotocol, error = None, None, exc
            _, subprotocol = self._subprotocol_only(ws)
        await ws.accept(subprotocol=subprotocol)
        if error is not None or p is None:
            assert error is not None
            await self.refuse(ws, error.code, str(error), error.ws_close_code)
            return None
        ip = ws.client.host if ws.client else "?"
        try:
            self.caps.open_socket(ip)
        except CapExceeded as exc:
            await self.refuse(ws, exc.code, str(exc), TRY_AGAIN_LATER)
            return None
        return Admitted(p, ip)

    def _subprotocol_only(self, ws: WebSocket) -> tuple[None, str | None]:
        offered = [s.strip() for s in ws.headers.get("sec-websocket-protocol", "").split(",")]
        return None, "babelcast" if "babelcast" in offered else None

    def release(self, admitted: Admitted) -> None:
        self.caps.close_socket(admitted.ip)

    @staticmethod
    async def refuse(ws: WebSocket, code: str, message: str, close_code: int) -> None:
        with contextlib.suppress(Exception):
            if ws.application_state == WebSocketState.CONNECTED:
                await ws.send_text(error_text(code, message))
            await ws.close(code=close_code)


# ---- what each endpoint needs -----------------------------------------------------------
def is_admin(p: Principal) -> bool:
    return p.is_admin


def can_scrape(p: Principal) -> bool:
    return p.is_admin or p.kind == "scrape"


def can_view(stream: str, lang: str | None = None) -> Check:
    return lambda p: p.can_view(stream, lang)


def can_view_any(p: Principal) -> bool:
    return p.is_admin or p.kind == "viewer"


def can_publish(stream: str) -> Check:
    return lambda p: p.can_publish(stream)
