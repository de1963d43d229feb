"""The `auth:` section and `gateway.limits` of the event file (YAML models).

```yaml
auth:
  admin_token_env: BABELCAST_ADMIN_TOKEN        # status, metrics, token minting
  scrape_token_env: BABELCAST_SCRAPE_TOKEN      # optional: a token for /metrics only
  publish_token_env: {hall-b: HALL_B_PUBLISH}   # one per `source: push` stream
  signing_key_env: BABELCAST_SIGNING_KEY        # signs viewer tokens (JWT, HS256)
  viewers: token                                # or public: captions need no token
  viewer_ttl_s: 86400
gateway:
  allowed_origins: ["https://player.example.org"]
  limits: {push_rate: 1.5, push_burst_s: 10, max_ws_per_ip: 256}
```

The file names environment variables, never secrets: a YAML file gets copied, mailed
and committed. Values are read when `babelcast run` starts (`orchestrator.gateway.auth`),
so `babelcast validate` works on a machine without them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

Loc = tuple[str | int, ...]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ORIGIN = re.compile(r"^(\*|https?://[A-Za-z0-9.\-\[\]:]+)$")


# The conventions of orchestrator/config.py, which imports this module.
def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("babelcast_config", "{reason}", {"reason": message})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _env_name(v: str) -> str:
    if not _ENV_NAME.match(v):
        raise _fail(f"{v!r} is not an environment variable name; the file names the "
                    "variable that holds the secret, never the secret itself")
    return v


class AuthConfig(_Strict):
    """Who may publish, read and administer. Secrets live in environment variables."""

    admin_token_env: str = Field(
        description="environment variable holding the admin token (status, metrics, "
                    "token minting)")
    scrape_token_env: str | None = Field(
        default=None,
        description="environment variable holding a token that may read /metrics only; "
                    "null: /metrics needs the admin token")
    publish_token_env: dict[str, str] = Field(
        default_factory=dict,
        description="per `source: push` stream id, the environment variable holding the "
                    "token that may push its audio (WebSocket audio and /v1/realtime)")
    signing_key_env: str | None = Field(
        default=None,
        description="environment variable holding the key (≥ 32 bytes) that signs viewer "
                    "tokens; needed unless viewers: public")
    viewers: Literal["token", "public"] = Field(
        default="token",
        description="token: captions, overlays and HLS need a viewer token; public: anyone "
                    "may read them (publishing and admin always need tokens)")
    viewer_ttl_s: int = Field(
        default=86_400, ge=60, le=31 * 86_400,
        description="lifetime of the viewer tokens `babelcast run` prints and mints by "
                    "default, in seconds")

    @field_validator("admin_token_env", "scrape_token_env", "signing_key_env")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return None if v is None else _env_name(v)

    @field_validator("publish_token_env")
    @classmethod
    def _publish_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v.values():
            _env_name(name)
        return v


class LimitsConfig(_Strict):
    """Bounds on every network input; past one the client gets a clear error. The
    connection caps hold per gateway process: with `gateway.workers: N` the port takes up
    to N times `max_connections`, `max_ws_per_ip` and `max_viewers_per_stream`."""

    push_rate: float = Field(
        default=1.5, ge=1.0, le=20.0,
        description="pushed audio may arrive at most this many times faster than real "
                    "time, averaged over seconds")
    push_burst_s: float = Field(
        default=10.0, gt=0, le=120.0,
        description="audio seconds a publisher may send at once on top of the rate "
                    "(catching up after a reconnect)")
    realtime_append_max_bytes: int = Field(
        default=65_536, ge=3_200, le=1_048_576,
        description="/v1/realtime: decoded bytes of one input_audio_buffer.append")
    realtime_precommit_max_s: float = Field(
        default=30.0, gt=0, le=600.0,
        description="/v1/realtime: audio seconds held before the first commit")
    header_timeout_s: float = Field(
        default=10.0, gt=0, le=300.0,
        description="a connection that has not sent its request headers by then is closed")
    max_connections: int = Field(
        default=4_096, ge=16,
        description="connections serving a request or a WebSocket on one gateway worker; "
                    "past it: HTTP 503 (connections holding no request are counted apart, "
                    "in max_pending_connections)")
    max_pending_connections: int = Field(
        default=1_024, ge=16,
        description="connections one gateway worker holds that carry no request being "
                    "served (headers not yet complete, or idle between requests); past it "
                    "the oldest of them is closed, so they never take the places of "
                    "requests being served (max_connections)")
    body_timeout_s: float = Field(
        default=10.0, gt=0, le=300.0,
        description="a request body (POST /v1/tokens, /v1/admin/apply) must arrive whole "
                    "within this many seconds of its headers; past it: HTTP 408 and the "
                    "connection is closed")
    trusted_proxies: list[str] = Field(
        default_factory=list, max_length=64,
        description="addresses or networks (CIDR) of reverse proxies whose "
                    "X-Forwarded-For header names the client (per-address caps then count "
                    "that client); default none: the header is ignored from everyone, "
                    "loopback included")
    max_ws_per_ip: int = Field(
        default=256, ge=1, description="WebSockets one client address may hold open on one "
                                       "gateway worker")
    max_viewers_per_stream: int = Field(
        default=2_000, ge=1, description="caption WebSockets of one stream (all languages) "
                                         "on one gateway worker")
    client_finals_max: int = Field(
        default=1_000, ge=16,
        description="finals queued for one slow caption client before it is closed with "
                    "1013 (it resumes with since)")


    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise _fail(f"{item!r} is not an IP address or network (e.g. 10.0.0.5 or "
                            "10.0.0.0/24); name the proxies by address") from None
        return v


class StreamLike(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def source_kind(self) -> str: ...


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def origin_problems(origins: Sequence[str]) -> list[tuple[Loc, str, object]]:
    return [((i,), f"{o!r} is not an origin: use scheme://host[:port] (no path) or '*'", o)
            for i, o in enumerate(origins) if not _ORIGIN.match(o)]


def auth_problems(auth: AuthConfig | None, host: str,
                  streams: Sequence[StreamLike]) -> list[tuple[Loc, str, object]]:
    """Cross-field rules: (location under the event, message, value)."""
    push = [s.id for s in streams if s.source_kind == "push"]
    if auth is None:
        if is_loopback(host):
            return []  # tokens are made per run (see orchestrator.gateway.local_credentials)
        return [(("gateway", "host"),
                 f"the gateway listens on {host}, which other machines reach, but the event "
                 "has no auth section: add auth with admin_token_env"
                 + (f" and publish_token_env for {', '.join(push)}" if push else "")
                 + " (see README, Security), or listen on 127.0.0.1", host)]
    problems: list[tuple[Loc, str, object]] = []
    for sid in auth.publish_token_env:
        if sid not in push:
            problems.append((("auth", "publish_token_env", sid),
                             f"{sid!r} is not a `source: push` stream of this event"
                             + (f" (push streams: {', '.join(push)})" if push else ""), sid))
    for sid in push:
        if sid not in auth.publish_token_env:
            problems.append((("auth", "publish_token_env"),
                             f"push stream {sid!r} has no publish token; add "
                             f"{sid}: ENV_VAR_NAME", None))
    if auth.viewers == "token" and auth.signing_key_env is None:
        problems.append((("auth", "signing_key_env"),
                         "viewers: token needs signing_key_env (the key that signs viewer "
                         "tokens), or set viewers: public", None))
    return problems
