"""Who is asking: tokens, scopes, and where a request carries its token.

Token kinds
- admin: status, metrics, token minting (and later, event changes); a secret from the
  environment variable `auth.admin_token_env`.
- scrape: `/metrics` only, when `auth.scrape_token_env` is set.
- publish:<stream>: push audio to that stream (`/v1/streams/{id}/audio`, `/v1/realtime`);
  a secret per push stream, from `auth.publish_token_env`.
- viewer: captions, overlays and HLS, optionally of some streams and languages only; a
  short-lived JWT (HS256, claims `sub`, `exp`, `scope`, `streams`, `langs`) signed with
  the key in `auth.signing_key_env`, minted by `babelcast token` or `POST /v1/tokens`.
  With `auth.viewers: public` reading needs no token; publishing and admin always do.

Where a token travels: `Authorization: Bearer T` (any client), the WebSocket subprotocol
`bearer.T` next to `babelcast` (browsers cannot set headers on a WebSocket), or `?token=T`
(OBS browser-source URLs and HLS players). A URL ends up in logs, histories and screen
shares, so `?token=` is accepted for viewer tokens only.

Static secrets are compared in constant time, every one of them on every check, so the
time taken says nothing about which secret a guess came close to. Tokens never reach a
log line or an error message.
"""

from __future__ import annotations

import hmac
import math
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jwt

from orchestrator.gateway.security_config import AuthConfig

Kind = Literal["admin", "scrape", "publish", "viewer"]
SUBPROTOCOL = "babelcast"
BEARER_PREFIX = "bearer."
MIN_SECRET_CHARS = 16
MIN_SIGNING_KEY_BYTES = 32
ISSUER = "babelcast"
MAX_MINT_TTL_S = 31 * 86_400


class AuthError(Exception):
    """`status` 401 (no valid token) or 403 (a valid token without the scope)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def code(self) -> str:
        return "unauthorized" if self.status == 401 else "forbidden"

    @property
    def ws_close_code(self) -> int:
        return 4401 if self.status == 401 else 4403


class SecretsError(Exception):
    """A secret the event file names is missing or too weak; the message names the
    environment variable, never its value."""


@dataclass(frozen=True, slots=True)
class Principal:
    kind: Kind
    streams: frozenset[str] | None = None
    """Streams this principal may use; None: all."""
    langs: frozenset[str] | None = None
    """Caption languages a viewer may read; None: all."""
    subject: str = ""
    expires_at: float | None = None

    def can_view(self, stream: str, lang: str | None = None) -> bool:
        if self.kind == "admin":
            return True
        if self.kind != "viewer":
            return False
        return ((self.streams is None or stream in self.streams)
                and (lang is None or self.langs is None or lang in self.langs))

    def can_publish(self, stream: str) -> bool:
        return self.kind == "publish" and self.streams is not None and stream in self.streams

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"


PUBLIC_VIEWER = Principal("viewer", subject="public")


@dataclass(frozen=True, slots=True)
class GatewaySecrets:
    """The resolved secrets (never logged; `repr` hides them)."""

    admin: str = field(repr=False)
    signing_key: bytes | None = field(default=None, repr=False)
    scrape: str | None = field(default=None, repr=False)
    publish: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def generate(cls, push_streams: Iterable[str]) -> GatewaySecrets:
        """Fresh secrets for one run of a loopback event without an `auth` section."""
        return cls(admin=secrets.token_urlsafe(32), signing_key=secrets.token_bytes(32),
                   publish={s: secrets.token_urlsafe(32) for s in push_streams})

    @classmethod
    def from_env(cls, auth: AuthConfig, env: Mapping[str, str] | None = None) -> GatewaySecrets:
        env = os.environ if env is None else env
        problems: list[str] = []

        def read(name: str, what: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                problems.append(f"{name} is not set (the {what}); export it before "
                                "`babelcast run`")
            elif len(value) < MIN_SECRET_CHARS:
                problems.append(f"{name} holds fewer than {MIN_SECRET_CHARS} characters (the "
                                f"{what}); use e.g. `python3 -c 'import secrets; "
                                "print(secrets.token_urlsafe(32))'`")
            return value

        admin = read(auth.admin_token_env, "admin token")
        scrape = read(auth.scrape_token_env, "scrape token") if auth.scrape_token_env else None
        publish = {sid: read(name, f"publish token of {sid}")
                   for sid, name in auth.publish_token_env.items()}
        key: bytes | None = None
        if auth.signing_key_env is not None:
            raw = env.get(auth.signing_key_env, "").strip().encode()
            if len(raw) < MIN_SIGNING_KEY_BYTES:
                problems.append(f"{auth.signing_key_env} must hold at least "
                                f"{MIN_SIGNING_KEY_BYTES} bytes (the viewer-token signing "
                                "key); use e.g. `python3 -c 'import secrets; "
                                "print(secrets.token_urlsafe(48))'`")
            key = raw
        distinct = [v for v in (admin, scrape, *publish.values()) if v]
        if len(set(distinct)) != len(distinct):
            problems.append("two of the auth environment variables hold the same token; each "
                            "kind of access needs its own")
        if problems:
            raise SecretsError("; ".join(problems))
        return cls(admin=admin, signing_key=key, scrape=scrape, publish=publish)


def _equal(a: str, b: str | None) -> bool:
    return b is not None and hmac.compare_digest(a.encode(), b.encode())


class Authenticator:
    def __init__(self, secrets_: GatewaySecrets, *, viewers_public: bool,
                 viewer_ttl_s: float = 86_400) -> None:
        self._secrets = secrets_
        self.viewers_public = viewers_public
        self.viewer_ttl_s = viewer_ttl_s

    # ---- checking ----------------------------------------------------------------
    def identify(self, token: str | None, *, via_query: bool = False) -> Principal | None:
        """The principal a token stands for; None without a token. Raises AuthError(401)
        for a token that is wrong, expired, or (in a URL) not a viewer token."""
        if not token:
            return None
        if token.count(".") == 2:
            principal = self._verify_jwt(token)
        else:
            principal = self._match_static(token)
        if principal is None:
            raise AuthError(401, "the token is not valid for this event")
        if via_query and principal.kind != "viewer":
            # Said without echoing the token. 401: this token does not count here.
            raise AuthError(401, f"{principal.kind} tokens are not accepted in a URL (it "
                                 "ends up in logs); send `Authorization: Bearer`")
        return principal

    def _match_static(self, token: str) -> Principal | None:
        s = self._secrets
        # Every comparison runs, so the timing does not tell which secret was near.
        admin = _equal(token, s.admin)
        scrape = _equal(token, s.scrape)
        publish = [sid for sid, secret in s.publish.items() if _equal(token, secret)]
        if admin:
            return Principal("admin", subject="admin")
        if scrape:
            return Principal("scrape", subject="scrape")
        if publish:
            return Principal("publish", streams=frozenset(publish), subject="publish")
        return None

    def _verify_jwt(self, token: str) -> Principal | None:
        key = self._secrets.signing_key
        if key is None:
            return None
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=["HS256"], issuer=ISSUER,
                options={"require": ["exp", "sub", "scope", "iss"]})
        except jwt.ExpiredSignatureError:
            raise AuthError(401, "the token has expired; ask for a new one") from None
        except jwt.PyJWTError:
            return None
        if claims.get("scope") != "viewer":
            return None
        streams, langs = claims.get("streams"), claims.get("langs")
        if not _str_list_or_none(streams) or not _str_list_or_none(langs):
            return None
        return Principal("viewer", streams=None if streams is None else frozenset(streams),
                         langs=None if langs is None else frozenset(langs),
                         subject=str(claims["sub"])[:128], expires_at=float(claims["exp"]))

    # ---- minting -----------------------------------------------------------------
    def mint_viewer(self, *, streams: Iterable[str] | None = None,
                    langs: Iterable[str] | None = None, ttl_s: float | None = None,
                    subject: str = "viewer", now: float | None = None) -> str:
        return mint_viewer_token(self._secrets.signing_key, streams=streams, langs=langs,
                                 ttl_s=self.viewer_ttl_s if ttl_s is None else ttl_s,
                                 subject=subject, now=now)

    @property
    def secrets(self) -> GatewaySecrets:
        return self._secrets

    @property
    def can_mint(self) -> bool:
        return self._secrets.signing_key is not None


def _str_list_or_none(value: object) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def mint_viewer_token(key: bytes | None, *, streams: Iterable[str] | None,
                      langs: Iterable[str] | None, ttl_s: float, subject: str,
                      now: float | None = None) -> str:
    if key is None:
        raise SecretsError("viewer tokens need auth.signing_key_env (viewers are public "
                           "without it)")
    if not 0 < ttl_s <= MAX_MINT_TTL_S:
        raise ValueError(f"ttl must be between 1 s and {MAX_MINT_TTL_S} s")
    at = time.time() if now is None else now
    # JWT times are whole seconds: exp rounds up, so a token never lives less than its
    # ttl (int(now) + ttl cut up to a second off: a 1 s token could be dead on arrival)
    claims: dict[str, Any] = {"iss": ISSUER, "sub": subject, "scope": "viewer",
                              "iat": int(at), "exp": math.ceil(at + ttl_s)}
    if streams is not None:
        claims["streams"] = sorted(set(streams))
    if langs is not None:
        claims["langs"] = sorted(set(langs))
    return jwt.encode(claims, key, algorithm="HS256")


# ---- where the token is -----------------------------------------------------------------
def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def subprotocol_token(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(token, subprotocol to answer with) from `Sec-WebSocket-Protocol`."""
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
    token = next((p[len(BEARER_PREFIX):] for p in offered if p.startswith(BEARER_PREFIX)),
                 None)
    return token or None, SUBPROTOCOL if SUBPROTOCOL in offered else None


@dataclass(frozen=True, slots=True)
class Presented:
    token: str | None
    via_query: bool
    subprotocol: str | None


def presented(headers: Mapping[str, str], query: Mapping[str, str]) -> Presented:
    """The token a request carries: header first, then subprotocol, then the URL."""
    sub_token, subprotocol = subprotocol_token(headers)
    token = bearer(headers) or sub_token
    if token is not None:
        return Presented(token, False, subprotocol)
    q = query.get("token") or None
    return Presented(q, q is not None, subprotocol)
