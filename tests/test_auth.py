"""Who may do what at the gateway: every endpoint × {no token, wrong token, expired,
wrong scope, right scope} on the real gateway (real sockets, real Redis); Origin checks;
one publisher per push stream; secrets from the environment and never in logs."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from orchestrator.config import ConfigError, parse_event
from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.app import GatewayStream
from orchestrator.gateway.auth import (
    Authenticator,
    GatewaySecrets,
    SecretsError,
    mint_viewer_token,
)
from orchestrator.gateway.security_config import AuthConfig, LimitsConfig
from tests.outputs_support import Gateway, running_gateway
from workers.events import StreamOptions

pytestmark = pytest.mark.integration

ADMIN = "admin-secret-token-0123456789"
SCRAPE = "scrape-secret-token-0123456789"
PUBLISH = "publish-secret-token-0123456789"
KEY = b"k" * 48
RECV_S = 10.0


def streams() -> list[GatewayStream]:
    return [
        GatewayStream(StreamOptions(stream_id="hall", name="Hall", source="push",
                                    language="en", targets=("fr",)), "push"),
        GatewayStream(StreamOptions(stream_id="annex", name="Annex", source="x.flac",
                                    language="en"), "file"),
    ]


def security(origins: tuple[str, ...] = ()) -> GatewaySecurity:
    secrets_ = GatewaySecrets(admin=ADMIN, signing_key=KEY, scrape=SCRAPE,
                              publish={"hall": PUBLISH})
    return GatewaySecurity(Authenticator(secrets_, viewers_public=False), origins,
                           LimitsConfig())


def viewer(streams: list[str] | None = None, langs: list[str] | None = None,
           ttl: float = 600, now: float | None = None) -> str:
    return mint_viewer_token(KEY, streams=streams, langs=langs, ttl_s=ttl, subject="t",
                             now=now)


TOKENS: dict[str, str | None] = {
    "none": None,
    "wrong": "not-a-token-of-this-event-000",
    "expired": viewer(now=time.time() - 3600, ttl=60),
    "forged": mint_viewer_token(b"x" * 48, streams=None, langs=None, ttl_s=600,
                                subject="evil"),
    "viewer": viewer(),
    "viewer-annex": viewer(["annex"]),
    "viewer-hall-fr": viewer(["hall"], ["fr"]),
    "publish": PUBLISH,
    "scrape": SCRAPE,
    "admin": ADMIN,
}


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Gateway]:
    async with running_gateway(redis_url, streams(),
                               security=security(("https://player.example.org",))) as gw:
        yield gw


def headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


# endpoint → the token names that succeed (everything else: 401 or 403)
HTTP_ALLOWED: dict[str, set[str]] = {
    "GET /metrics": {"scrape", "admin"},
    "GET /v1/status": {"admin"},
    "GET /v1/streams": {"viewer", "viewer-annex", "viewer-hall-fr", "admin"},
    "GET /v1/streams/hall": {"viewer", "viewer-hall-fr", "admin"},
    "GET /": {"viewer", "viewer-annex", "viewer-hall-fr", "admin"},
    "GET /overlay/hall?lang=en": {"viewer", "admin"},
    "GET /overlay/hall?lang=fr": {"viewer", "viewer-hall-fr", "admin"},
    "GET /hls/hall/fr.m3u8": {"viewer", "viewer-hall-fr", "admin"},
    "GET /v1/streams/hall/transcript.vtt?lang=fr": {"viewer", "viewer-hall-fr", "admin"},
    "GET /v1/streams/hall/transcript.srt": {"viewer", "admin"},  # the stream's own: en
    "POST /v1/tokens": {"admin"},
}
UNAUTHENTICATED = {"none", "wrong", "expired", "forged"}


async def test_every_http_endpoint_answers_401_403_or_success_by_token(
    gateway: Gateway,
) -> None:
    wrong: list[str] = []
    async with httpx.AsyncClient(base_url=gateway.base) as http:
        for endpoint, allowed in HTTP_ALLOWED.items():
            method, path = endpoint.split(" ", 1)
            for name, token in TOKENS.items():
                resp = await http.request(method, path, headers=headers(token),
                                          json={} if method == "POST" else None)
                want = 200 if name in allowed else 401 if name in UNAUTHENTICATED else 403
                if resp.status_code != want:
                    wrong.append(f"{endpoint} with {name}: {resp.status_code}, want {want}")
                if resp.status_code == 401:
                    assert resp.headers.get("www-authenticate") == "Bearer"
                if token:
                    assert token not in resp.text, f"{endpoint} echoed the {name} token"
        # What needs nothing: liveness, readiness, the overlay's code.
        for path in ("/livez", "/healthz", "/static/overlay.js"):
            assert (await http.get(path)).status_code == 200, path
    assert not wrong, "\n".join(wrong)


async def test_viewer_tokens_work_in_the_url_but_admin_and_publish_tokens_do_not(
    gateway: Gateway,
) -> None:
    async with httpx.AsyncClient(base_url=gateway.base) as http:
        ok = await http.get("/overlay/hall", params={"lang": "fr",
                                                     "token": TOKENS["viewer-hall-fr"]})
        assert ok.status_code == 200
        for name in ("admin", "publish"):
            resp = await http.get("/v1/streams", params={"token": TOKENS[name]})
            assert resp.status_code == 401 and "Authorization: Bearer" in resp.text, name
        # An HLS playlist fetched with ?token= names its segments with it too.
        playlist = await http.get("/hls/hall/fr.m3u8", params={"token": TOKENS["viewer"]})
        assert playlist.status_code == 200


async def test_admin_mints_viewer_tokens_scoped_to_streams_and_languages(
    gateway: Gateway,
) -> None:
    async with httpx.AsyncClient(base_url=gateway.base, headers=headers(ADMIN)) as http:
        resp = await http.post("/v1/tokens", json={"streams": ["hall"], "langs": ["fr"],
                                                   "ttl_s": 120, "sub": "obs-hall"})
        assert resp.status_code == 200
        body = resp.json()
        assert 110 <= body["expires_at"] - time.time() <= 121
        bad = await http.post("/v1/tokens", json={"streams": ["nope"]})
        assert bad.status_code == 404
        assert (await http.post("/v1/tokens", json={"ttl_s": -1})).status_code == 422
        assert (await http.post("/v1/tokens", json={"extra": 1})).status_code == 422
    minted = body["token"]
    async with httpx.AsyncClient(base_url=gateway.base, headers=headers(minted)) as http:
        assert (await http.get("/overlay/hall?lang=fr")).status_code == 200
        assert (await http.get("/overlay/hall?lang=en")).status_code == 403
        assert (await http.get("/v1/status")).status_code == 403
        page = (await http.get("/")).text
    assert "/overlay/hall?lang=en" in page and "token=" in page


async def ws_outcome(url: str, *, token: str | None = None, via: str = "header",
                     origin: str | None = None) -> tuple[str, Any]:
    """('open', first message or None) or ('closed', code) or ('refused', HTTP status)."""
    kwargs: dict[str, Any] = {}
    if token and via == "header":
        kwargs["additional_headers"] = headers(token)
    elif token and via == "subprotocol":
        kwargs["subprotocols"] = ["babelcast", f"bearer.{token}"]
    elif token and via == "query":
        url += ("&" if "?" in url else "?") + f"token={token}"
    if origin:
        kwargs["origin"] = origin
    try:
        async with websockets.connect(url, **kwargs) as ws:
            try:
                first = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
            except TimeoutError:
                return "open", None
            except websockets.ConnectionClosed as exc:
                return "closed", exc.rcvd.code if exc.rcvd else None
            if first.get("type") == "error":
                try:
                    await asyncio.wait_for(ws.recv(), RECV_S)
                except websockets.ConnectionClosed as exc:
                    return "closed", exc.rcvd.code if exc.rcvd else None
            return "open", first
    except websockets.InvalidStatus as exc:
        return "refused", exc.response.status_code


async def ws_outcome_once_free(url: str, **kwargs: Any) -> tuple[str, Any]:
    """`ws_outcome`, waiting out a publisher that has just closed: the gateway frees the
    stream's one publisher place when that handler ends, moments after the close."""
    for _ in range(50):
        outcome = await ws_outcome(url, **kwargs)
        if outcome != ("closed", 4409):
            return outcome
        await asyncio.sleep(0.1)
    return outcome


WS_ALLOWED = {
    "/v1/streams/hall/captions?lang=fr": {"viewer", "viewer-hall-fr", "admin"},
    "/v1/streams/hall/captions?lang=en": {"viewer", "admin"},
    "/v1/streams/hall/audio": {"publish"},
    "/v1/realtime?stream=hall": {"publish"},
}


async def test_every_websocket_closes_4401_or_4403_or_serves_by_token(
    gateway: Gateway,
) -> None:
    ws_base = gateway.base.replace("http://", "ws://")
    wrong: list[str] = []
    for path, allowed in WS_ALLOWED.items():
        for name, token in TOKENS.items():
            kind, detail = await ws_outcome_once_free(ws_base + path, token=token)
            if name in allowed:
                ok = kind == "open" and (detail is None or detail.get("type") != "error")
            else:
                ok = (kind, detail) == ("closed", 4401 if name in UNAUTHENTICATED else 4403)
            if not ok:
                wrong.append(f"{path} with {name}: {kind} {detail}")
    assert not wrong, "\n".join(wrong)


async def test_browsers_send_the_token_as_a_subprotocol_and_obs_in_the_url(
    gateway: Gateway,
) -> None:
    url = gateway.base.replace("http://", "ws://") + "/v1/streams/hall/captions?lang=fr"
    async with websockets.connect(url, subprotocols=["babelcast", f"bearer.{TOKENS['viewer']}"]
                                  ) as ws:
        assert ws.subprotocol == "babelcast"
    assert (await ws_outcome(url, token=TOKENS["viewer"], via="query"))[0] == "open"
    assert await ws_outcome(url, token=ADMIN, via="query") == ("closed", 4401)


async def test_a_foreign_origin_is_refused_on_every_websocket(gateway: Gateway) -> None:
    ws_base = gateway.base.replace("http://", "ws://")
    for path, allowed in WS_ALLOWED.items():
        token = TOKENS[sorted(allowed)[0]]
        assert await ws_outcome(ws_base + path, token=token, origin="https://evil.example"
                                ) == ("refused", 403), path
        # The gateway's own pages and the allowed player are welcome.
        host = gateway.base.removeprefix("http://")
        for origin in (f"http://{host}", "https://player.example.org"):
            outcome = await ws_outcome_once_free(ws_base + path, token=token, origin=origin)
            assert outcome[0] == "open", (path, origin, outcome)


async def test_a_second_publisher_of_a_stream_is_refused_with_4409(gateway: Gateway) -> None:
    ws_base = gateway.base.replace("http://", "ws://")
    async with websockets.connect(ws_base + "/v1/streams/hall/audio",
                                  additional_headers=headers(PUBLISH)) as first:
        await first.send(bytes(3200))
        for path in ("/v1/streams/hall/audio", "/v1/realtime?stream=hall"):
            async with websockets.connect(ws_base + path,
                                          additional_headers=headers(PUBLISH)) as second:
                msg = json.loads(await asyncio.wait_for(second.recv(), RECV_S))
                assert msg["code"] == "publisher_busy"
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(second.recv(), RECV_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4409
        await first.send(bytes(3200))  # the first one is unharmed
    # Once it is gone the stream takes a publisher again.
    await asyncio.sleep(0.5)
    async with websockets.connect(ws_base + "/v1/realtime?stream=hall",
                                  additional_headers=headers(PUBLISH)) as again:
        msg = json.loads(await asyncio.wait_for(again.recv(), RECV_S))
        assert msg["type"] == "session.created"
        await again.send(json.dumps({"type": "input_audio_buffer.append",
                                     "audio": base64.b64encode(bytes(320)).decode()}))


async def test_with_public_viewers_anyone_reads_but_admin_and_publish_still_want_a_token(
    redis_url: str,
) -> None:
    public = GatewaySecurity(Authenticator(GatewaySecrets(admin=ADMIN, publish={"hall": PUBLISH}),
                                           viewers_public=True))
    async with running_gateway(redis_url, streams(), security=public) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/v1/streams")).status_code == 200
            assert (await http.get("/overlay/hall?lang=fr")).status_code == 200
            for path in ("/metrics", "/v1/status"):  # anonymous: a token is missing (401)
                resp = await http.get(path)
                assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        ws = gw.base.replace("http://", "ws://")
        assert (await ws_outcome(ws + "/v1/streams/hall/captions?lang=fr"))[0] == "open"
        for path in ("/v1/streams/hall/audio", "/v1/realtime?stream=hall"):
            assert await ws_outcome(ws + path) == ("closed", 4401), path


async def test_a_viewer_token_is_closed_4401_when_it_expires(redis_url: str) -> None:
    async with running_gateway(redis_url, streams(), security=security()) as gw:
        url = gw.base.replace("http://", "ws://") + "/v1/streams/hall/captions?lang=fr"
        async with websockets.connect(url, additional_headers=headers(viewer(ttl=1))) as ws:
            msg = json.loads(await asyncio.wait_for(ws.recv(), RECV_S))
            assert msg["code"] == "token_expired"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), RECV_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


# ---- configuration and secrets --------------------------------------------------------------
EVENT = """
event: e
gateway: {{host: "{host}", port: 8000}}
streams:
  - {{id: hall, source: push, language: en}}
{auth}
"""


def test_a_gateway_other_machines_reach_needs_an_auth_section() -> None:
    with pytest.raises(ConfigError) as err:
        parse_event(EVENT.format(host="0.0.0.0", auth=""), filename="e.yaml")
    text = str(err.value)
    assert "e.yaml:3: gateway.host" in text and "auth" in text and "hall" in text
    for host in ("127.0.0.1", "localhost", "::1"):
        parse_event(EVENT.format(host=host, auth=""))  # the demo: tokens made per run
    ok = "auth: {admin_token_env: A, publish_token_env: {hall: P}, signing_key_env: K}"
    assert parse_event(EVENT.format(host="0.0.0.0", auth=ok)).auth is not None


def test_auth_problems_name_the_key_and_never_hold_secrets() -> None:
    with pytest.raises(ConfigError) as err:
        parse_event(EVENT.format(host="127.0.0.1", auth="auth: {admin_token_env: 'a b'}"),
                    filename="e.yaml")
    text = str(err.value)
    assert "e.yaml:6: auth.admin_token_env" in text and "environment variable name" in text
    bad = "auth: {admin_token_env: ADM, viewers: token}"
    with pytest.raises(ConfigError) as err:
        parse_event(EVENT.format(host="127.0.0.1", auth=bad), filename="e.yaml")
    text = str(err.value)
    assert "push stream 'hall' has no publish token" in text
    assert "signing_key_env" in text


def test_secrets_come_from_the_named_variables_and_errors_name_only_the_variable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = AuthConfig(admin_token_env="ADM", publish_token_env={"hall": "PUB"},
                      signing_key_env="KEY")
    env = {"ADM": ADMIN, "PUB": "short", "KEY": "k" * 10}
    with caplog.at_level(logging.DEBUG), pytest.raises(SecretsError) as err:
        GatewaySecrets.from_env(auth, env)
    text = str(err.value)
    assert "PUB holds fewer than 16" in text and "KEY must hold at least 32" in text
    assert ADMIN not in text and "short" not in text
    same = {"ADM": ADMIN, "PUB": ADMIN, "KEY": "k" * 40}
    with pytest.raises(SecretsError, match="same token"):
        GatewaySecrets.from_env(auth, same)
    good = GatewaySecrets.from_env(auth, {"ADM": ADMIN, "PUB": PUBLISH, "KEY": "k" * 40})
    assert ADMIN not in repr(good) and PUBLISH not in repr(good)
    assert ADMIN not in caplog.text


async def test_tokens_never_reach_the_gateways_log(
    gateway: Gateway, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG):
        await test_every_websocket_closes_4401_or_4403_or_serves_by_token(gateway)
    # The test's own client library logs what it sends at DEBUG; the gateway's side is
    # everything else.
    ours = "\n".join(r.getMessage() for r in caplog.records
                     if not r.name.startswith("websockets.client"))
    assert ours
    for token in TOKENS.values():
        if token:
            assert token not in ours
