"""Property-based fuzzing (hypothesis, 2,000 examples each) of the event YAML loader and
the gateway's three WebSocket protocols, against one real gateway (real Redis) for the
module: realtime and push over real sockets (one connection carries many examples); the
captions socket's query in-process through the same app (each example is a connection).
Every input gets a clear error or is taken, and the gateway keeps serving."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from websockets.sync.client import ClientConnection, connect

from orchestrator.config import ConfigError, EventConfig, parse_event
from orchestrator.gateway.app import GatewayStream
from orchestrator.gateway.realtime_protocol import ERROR_CODES
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.redis_server import LocalRedisServer
from tests.asgi_ws import AsgiWebSocket, Conversation
from tests.outputs_support import GatewayThread, caption, public_viewers
from workers.bus import RedisBus
from workers.events import StreamOptions

EXAMPLES = 2000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
PUBLISH = "fuzz-publish-token-0123456789"
AUTH = {"Authorization": f"Bearer {PUBLISH}"}
NEWEST = 50


# ---- the YAML loader ------------------------------------------------------------------------
KEYS = ["event", "streams", "engine", "gateway", "auth", "redis", "translation", "outputs",
        "id", "source", "language", "targets", "host", "port", "kind", "model",
        "admin_token_env", "viewers", "limits", "push_rate", "allowed_origins", "glossary"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=20),
                    st.sampled_from(["push", "en", "auto", "127.0.0.1", "0.0.0.0", "public"]))
documents = st.recursive(
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                    st.dictionaries(st.sampled_from(KEYS), kids, max_size=5)),
    max_leaves=25)


@pytest.mark.unit
@FUZZ
@given(doc=documents, raw=st.one_of(st.none(), st.text(max_size=200)))
def test_any_yaml_gets_a_config_or_errors_naming_file_and_key(doc: Any, raw: str | None
                                                              ) -> None:
    text = raw if raw is not None else yaml.safe_dump(doc, allow_unicode=True)
    try:
        cfg = parse_event(text, filename="fuzz.yaml")
    except ConfigError as exc:
        assert exc.errors
        for issue in exc.errors:
            assert issue.file == "fuzz.yaml" and issue.key and issue.message
            assert str(issue).startswith("fuzz.yaml")
    else:
        assert isinstance(cfg, EventConfig)


# ---- one gateway for the WebSocket protocols ---------------------------------------------------
@pytest.fixture(scope="module")
def gateway(redis_server: LocalRedisServer) -> Iterator[GatewayThread]:
    streams = [GatewayStream(StreamOptions(stream_id="hall", name="Hall", source="push",
                                           language="en", targets=("fr",)), "push")]
    # Generous pace: the fuzz sends audio far faster than real time on purpose.
    limits = LimitsConfig(push_rate=20.0, push_burst_s=120.0)

    async def captions() -> None:
        bus = RedisBus(Redis.from_url(redis_server.url))
        await bus.redis.flushdb()
        for seq in range(1, NEWEST + 1):
            await bus.publish_caption(caption(seq, seq, "s", 0, 1, stream="hall"))
        await bus.redis.aclose()

    with GatewayThread(redis_server.url, streams, setup=captions,
                       security=public_viewers(limits, publish={"hall": PUBLISH})) as gw:
        yield gw
        for ws in _conn.values():
            ws.close()
        _conn.clear()


def ws_base(gateway: GatewayThread) -> str:
    return gateway.base.replace("http://", "ws://")


def recv_json(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    data = json.loads(ws.recv(timeout=timeout))
    assert isinstance(data, dict)
    return data


def until_sentinel(ws: ClientConnection, sentinel_code: str) -> list[dict[str, Any]]:
    """Messages up to and including the reply to the sentinel error we sent last."""
    out = []
    while True:
        msg = recv_json(ws)
        out.append(msg)
        if msg.get("type") == "error" and msg.get("code") == sentinel_code and (
                "sentinel" in str(msg.get("error", msg.get("message", ""))) or
                sentinel_code == "invalid_json"):
            return out


# ---- /v1/realtime ------------------------------------------------------------------------
b64 = st.binary(max_size=4000).map(lambda b: base64.b64encode(b).decode())
realtime_events = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio_buffer.append"])},
                          optional={"audio": st.one_of(b64, st.text(max_size=50), scalars)}),
    st.fixed_dictionaries({"type": st.just("session.update")},
                          optional={"model": st.one_of(st.text(max_size=30), scalars)}),
    # A final commit waits for the last words (up to seconds); the fuzz commits non-final.
    st.fixed_dictionaries({"type": st.just("input_audio_buffer.commit")},
                          optional={"final": st.just(False)}),
    st.dictionaries(st.text(max_size=10), scalars, max_size=4),
    st.fixed_dictionaries({"type": st.text(max_size=30)}),
)


@pytest.mark.integration
@FUZZ
@given(events=st.lists(realtime_events, min_size=1, max_size=3))
def test_realtime_answers_every_event_with_a_protocol_error_or_takes_it(
    gateway: GatewayThread, events: list[Any],
) -> None:
    ws = _realtime(gateway)
    for event in events:
        if isinstance(event, bytes):
            ws.send(event)
        else:
            ws.send(event if isinstance(event, str) else json.dumps(event))
    ws.send("{sentinel")  # invalid JSON: its error marks the end of our events' replies
    for msg in until_sentinel(ws, "invalid_json"):
        assert msg["type"] in {"error", "transcription.delta"}, msg
        if msg["type"] == "error":
            assert msg["code"] in ERROR_CODES and msg["error"], msg


_conn: dict[str, ClientConnection] = {}


def _open(url: str) -> ClientConnection:
    """A connection kept across hypothesis examples (closed by the test that ends it):
    entered as its context, which websockets 17.1+ expects of a sync client."""
    return connect(url, additional_headers=AUTH).__enter__()


def _realtime(gateway: GatewayThread) -> ClientConnection:
    ws = _conn.get("rt")
    if ws is None:
        ws = _open(f"{ws_base(gateway)}/v1/realtime?stream=hall")
        assert recv_json(ws)["type"] == "session.created"
        _conn["rt"] = ws
    return ws


# ---- push audio ----------------------------------------------------------------------------------
frames = st.one_of(st.binary(max_size=5000), st.text(max_size=200))


@pytest.mark.integration
@FUZZ
@given(batch=st.lists(frames, min_size=1, max_size=3))
def test_push_answers_every_bad_frame_and_takes_every_good_one(
    gateway: GatewayThread, batch: list[bytes | str],
) -> None:
    ws = _conn.get("push")
    if ws is None:
        rt = _conn.pop("rt", None)  # one publisher per stream: the realtime one leaves
        if rt is not None:
            rt.close()
        for _ in range(100):
            ws = _open(f"{ws_base(gateway)}/v1/streams/hall/audio")
            try:
                early = json.loads(ws.recv(timeout=0.2))
            except TimeoutError:
                break
            assert early["code"] == "publisher_busy", early
            ws.close()
        _conn["push"] = ws
    bad = 0
    for frame in batch:
        ws.send(frame)
        bad += isinstance(frame, str) or len(frame) % 2 == 1 or not frame
    ws.send("sentinel")
    replies = []
    while True:
        msg = recv_json(ws)
        assert msg["type"] == "error" and msg["code"] == "invalid_audio", msg
        replies.append(msg)
        if len(replies) == bad + 1:
            break


# ---- the captions socket's query -----------------------------------------------------------
# Each example is one connection (the query is per connection). Over a real socket one
# costs ~0.1 s on the shared 2-core machine, so 2,000 ran past pytest's 300 s timeout:
# this fuzz talks to the same app object in-process (tests/asgi_ws.py), with the same
# Redis and hub behind it; the real-socket path of this endpoint is covered by
# test_auth, test_limits and test_pipeline.
def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any],
           rare_in: int) -> st.SearchStrategy[Any]:
    """`rare` one time in `rare_in`, else `common` (one_of picks its branches unevenly)."""
    return st.sampled_from([False] * (rare_in - 1) + [True]).flatmap(
        lambda is_rare: rare if is_rare else common)


lang_values = mostly(st.sampled_from([None, "", "en", "fr"]),
                     st.one_of(st.text(max_size=12), st.integers(-5, 99).map(str)), 4)
since_values = st.one_of(st.none(), st.text(max_size=12), st.integers(-5, NEWEST + 5).map(str),
                         st.integers(0, NEWEST).map(str),
                         st.integers(0, NEWEST).map(lambda n: f"{n:,}" if n > 9 else f"+{n}"))
# Any token that is not the event's is refused, whatever the rest of the query says.
token_values = mostly(st.none(), st.text(min_size=1, max_size=40), 10)
NEWEST_OF = {"en": NEWEST, "fr": 0}  # the fixture published NEWEST captions in en only


def expected_outcome(lang: str | None, since: str | None, token: str | None) -> str:
    """What the captions socket must do with this query (see gateway.captions_ws)."""
    if token:
        return "unauthorized"
    lang = lang or "en"  # no lang: the stream's own
    if lang not in NEWEST_OF:
        return "unknown_language"
    if since in (None, ""):
        return "live"  # the live edge: quiet until something is published
    if not (since.isascii() and since.isdigit()):
        return "invalid_since"  # "+3", "1,000", " 3", "٣" too: a seq is ASCII digits
    if int(since) > NEWEST_OF[lang]:
        return "since_ahead"
    return "caption" if int(since) < NEWEST_OF[lang] else "live"


CLOSE_CODES = {"unauthorized": 4401, "unknown_language": 4404, "invalid_since": 4400,
               "since_ahead": 4409}


async def query_conversation(gateway: GatewayThread, lang: str | None, since: str | None,
                             token: str | None) -> None:
    ctx = gateway.app.state.context
    want = expected_outcome(lang, since, token)
    query = {k: v for k, v in (("lang", lang), ("since", since), ("token", token))
             if v is not None}
    served_before = sum(ctx.clients.values())

    def held() -> tuple[object, ...]:
        """What a connection holds in the gateway while it is open."""
        caps = ctx.access.caps
        return (+ctx.clients, +caps.per_ip, +caps.viewers,
                {k: len(v) for k, v in ctx.hub._clients.items()})

    before = held()
    ws = AsgiWebSocket(gateway.app, "/v1/streams/hall/captions", query)

    def settled(said: Conversation) -> bool:
        # The live edge sends nothing: it has settled once the client is being served.
        return bool(said.texts) or (want != "caption" and
                                    sum(ctx.clients.values()) > served_before)

    try:
        try:
            said = await ws.run(settled, timeout_s=10.0)
        except TimeoutError:
            pytest.fail(f"{query}: nothing within 10 s, want {want}")
        assert said.accepted, query
        if want == "live":
            assert not said.texts and said.close_code is None, (query, said)
        elif want == "caption":
            first = json.loads(said.texts[0])
            assert first["type"] == "caption" and first["seq"] == int(since or 0) + 1, query
            assert said.close_code is None
        else:
            assert said.close_code == CLOSE_CODES[want], (query, said)
            assert len(said.texts) == 1, (query, said)
            error = json.loads(said.texts[0])
            assert error["type"] == "error" and error["code"] == want and error["message"]
    finally:
        await ws.leave()
    assert held() == before, f"{query}: the connection left something behind"


@pytest.mark.integration
@FUZZ
@given(lang=lang_values, since=since_values, token=token_values)
def test_captions_query_gets_captions_or_a_clear_error_and_close(
    gateway: GatewayThread, lang: str | None, since: str | None, token: str | None,
) -> None:
    # The mix of outcomes shows with --hypothesis-show-statistics.
    hypothesis.event(expected_outcome(lang, since, token))
    gateway.call(query_conversation(gateway, lang, since, token))


@pytest.mark.integration
def test_after_all_that_the_gateway_still_serves(gateway: GatewayThread) -> None:
    for ws in _conn.values():
        ws.close()
    _conn.clear()
    time.sleep(0.5)
    start = time.monotonic()
    with connect(f"{ws_base(gateway)}/v1/streams/hall/captions?lang=en&since=0") as ws:
        assert recv_json(ws)["seq"] == 1
    with connect(f"{ws_base(gateway)}/v1/realtime?stream=hall", additional_headers=AUTH) as ws:
        assert recv_json(ws)["type"] == "session.created"
    assert time.monotonic() - start < 30
