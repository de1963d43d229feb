"""schemathesis against the gateway's REST OpenAPI, on the real gateway (uvicorn, real
sockets, real Redis holding captions): every generated request, valid or not, sent
without a token, with a viewer token and with the admin token, gets a 2xx or a clear
4xx (a JSON `detail` or a text message), never a 5xx; and the gateway keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from redis.asyncio import Redis
from schemathesis import GenerationMode

from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.app import GatewayStream, create_app
from orchestrator.gateway.auth import Authenticator, GatewaySecrets, mint_viewer_token
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.redis_server import LocalRedisServer
from tests.outputs_support import GatewayThread, caption
from workers.bus import RedisBus
from workers.events import StreamOptions

pytestmark = pytest.mark.integration

ADMIN = "openapi-admin-token-0123456789"
KEY = b"o" * 48
EXAMPLES = 100
"""At most, per operation and generation mode (valid and invalid requests); each is sent
three times (no token, viewer, admin)."""


STREAMS = [
    GatewayStream(StreamOptions(stream_id="hall", name="Hall", source="push", language="en",
                                targets=("fr",)), "push"),
    GatewayStream(StreamOptions(stream_id="annex", name="Annex", source="a.flac",
                                language="en"), "file"),
]
SECURITY = GatewaySecurity(Authenticator(GatewaySecrets(admin=ADMIN, signing_key=KEY),
                                         viewers_public=False), (), LimitsConfig())


@pytest.fixture(scope="module")
def gateway(redis_server: LocalRedisServer) -> Iterator[GatewayThread]:

    async def captions() -> None:  # something for HLS, transcripts and status to read
        bus = RedisBus(Redis.from_url(redis_server.url))
        await bus.redis.flushdb()
        for seq in range(1, 21):
            await bus.publish_caption(caption(seq, seq, f"Sentence {seq}.", seq, seq + 0.8,
                                              stream="hall"))
            await bus.publish_caption(caption(seq, seq, f"Phrase {seq}.", seq, seq + 0.8,
                                              stream="hall", lang="fr"))
        await bus.redis.aclose()

    with GatewayThread(redis_server.url, STREAMS, setup=captions, security=SECURITY) as gw:
        yield gw


def _schema() -> Any:
    """The OpenAPI document of the app `create_app` builds for this module's event (built
    without I/O; the one served is the same code with the same streams)."""
    app = create_app("redis://unused", STREAMS, "openapi", security=SECURITY)
    return schemathesis.openapi.from_dict(app.openapi())


SCHEMA = _schema()
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}
IDENTITIES: dict[str, dict[str, str]] = {
    "none": {},
    "viewer": {"Authorization": "Bearer " + mint_viewer_token(
        KEY, streams=None, langs=None, ttl_s=3600, subject="openapi")},
    "admin": {"Authorization": f"Bearer {ADMIN}"},
}


KNOWN_PATH_VALUES = {"stream_id": "hall", "lang": "fr"}
"""Generated ids almost never name a stream of the event, so half the cases use the
event's own: they get past the 404 into the handlers."""


def cases(op: Any, mode: GenerationMode) -> st.SearchStrategy[Any]:
    names = {p.name for p in op.path_parameters}
    known = {k: v for k, v in KNOWN_PATH_VALUES.items() if k in names}
    generated = op.as_strategy(generation_mode=mode)
    if not known:
        return generated
    return st.one_of(generated, op.as_strategy(generation_mode=mode, path_parameters=known))


def check(case: Any, base: str, session: requests.Session) -> None:
    for who, auth in IDENTITIES.items():
        response = case.call(base_url=base, session=session,
                             headers={**(case.headers or {}), **auth}, timeout=10)
        status = response.status_code
        where = f"{case.method} {case.formatted_path} {case.query or ''} as {who}"
        hypothesis.event(f"{who}: {status}")  # see --hypothesis-show-statistics
        assert status < 500, f"{where}: {status} {response.text[:300]}"
        assert 200 <= status < 300 or 400 <= status < 500, f"{where}: {status}"
        if status >= 400:  # FastAPI's JSON {"detail": ...}, or a text message
            try:
                body = json.loads(response.text)
            except ValueError:
                body = None
            if isinstance(body, dict):
                assert body.get("detail"), f"{where}: {status} without a detail"
            else:
                assert response.text.strip(), f"{where}: {status} with an empty body"


@pytest.mark.parametrize("label", sorted(OPERATIONS))
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_every_generated_request_gets_a_2xx_or_a_clear_4xx(
    gateway: GatewayThread, label: str, mode: GenerationMode,
) -> None:
    with requests.Session() as session:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases(OPERATIONS[label], mode))
        def fuzz(case: Any) -> None:
            check(case, gateway.base, session)

        try:
            fuzz()
        except Unsatisfiable:
            # Nothing in this operation can be made invalid (no parameters, no body).
            assert mode == GenerationMode.NEGATIVE, label


def test_after_the_fuzz_the_gateway_still_serves(gateway: GatewayThread) -> None:
    admin = IDENTITIES["admin"]
    with httpx.Client(base_url=gateway.base, timeout=10) as http:
        assert http.get("/livez").status_code == 200
        assert http.get("/healthz").status_code == 200
        assert http.get("/v1/status", headers=admin).status_code == 200
        vtt = http.get("/v1/streams/hall/transcript.vtt", headers=admin)
        assert vtt.status_code == 200 and "Sentence 20." in vtt.text
