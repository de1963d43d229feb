"""Property-based fuzzing (hypothesis, 2,000 examples each) of the event YAML loader and
the gateway's three WebSocket protocols, against one real gateway (real sockets, real
Redis) for the module: every input gets a clear error or is taken, and the gateway
keeps serving."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from orchestrator.config import ConfigError, EventConfig, parse_event
from orchestrator.gateway.app import GatewayStream
from orchestrator.gateway.realtime_protocol import ERROR_CODES
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.redis_server import LocalRedisServer
from tests.outputs_support import caption, public_viewers, start_gateway
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
class _Gateway:
    def __init__(self, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(redis_url,), daemon=True)
        self.base = ""

    def _run(self, redis_url: str) -> None:
        asyncio.set_event_loop(self.loop)
        streams = [GatewayStream(StreamOptions(stream_id="hall", name="Hall", source="push",
                                               language="en", targets=("fr",)), "push")]
        # Generous pace: the fuzz sends audio far faster than real time on purpose.
        limits = LimitsConfig(push_rate=20.0, push_burst_s=120.0)
        security = public_viewers(limits, publish={"hall": PUBLISH})

        async def main() -> None:
            bus = RedisBus(__import__("redis.asyncio", fromlist=["Redis"]).Redis.from_url(
                redis_url))
            await bus.redis.flushdb()
            for seq in range(1, NEWEST + 1):
                await bus.publish_caption(caption(seq, seq, "s", 0, 1, stream="hall"))
            gw = await start_gateway(redis_url, streams, security=security)
            self.base = gw.base.replace("http://", "ws://")
            self.gw = gw
            self.ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30)


@pytest.fixture(scope="module")
def gateway(redis_server: LocalRedisServer) -> Iterator[_Gateway]:
    gw = _Gateway(redis_server.url)
    gw.start()
    yield gw
    # A daemon thread: it ends with the test process.


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
    gateway: _Gateway, events: list[Any],
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


def _realtime(gateway: _Gateway) -> ClientConnection:
    ws = _conn.get("rt")
    if ws is None:
        ws = connect(f"{gateway.base}/v1/realtime?stream=hall", additional_headers=AUTH)
        assert recv_json(ws)["type"] == "session.created"
        _conn["rt"] = ws
    return ws


# ---- push audio ----------------------------------------------------------------------------------
frames = st.one_of(st.binary(max_size=5000), st.text(max_size=200))


@pytest.mark.integration
@FUZZ
@given(batch=st.lists(frames, min_size=1, max_size=3))
def test_push_answers_every_bad_frame_and_takes_every_good_one(
    gateway: _Gateway, batch: list[bytes | str],
) -> None:
    ws = _conn.get("push")
    if ws is None:
        rt = _conn.pop("rt", None)  # one publisher per stream: the realtime one leaves
        if rt is not None:
            rt.close()
        for _ in range(100):
            ws = connect(f"{gateway.base}/v1/streams/hall/audio", additional_headers=AUTH)
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
query_values = st.one_of(st.none(), st.text(max_size=12), st.integers(-5, NEWEST + 5).map(str))
# A valid `since` below the newest seq gets a caption at once; quiet cases (the live
# edge) cost a wait each, so they are kept rare.
since_values = st.one_of(st.text(min_size=1, max_size=12),
                         st.integers(-5, NEWEST + 5).map(str))


# Each example here is a new connection (the query is per connection), about 0.1 s on
# the shared 2-core machine: 2,000 of them ran past pytest's 300 s timeout, so this
# protocol is fuzzed with fewer examples than the other two (see the issue's note).
QUERY_EXAMPLES = 400


@pytest.mark.integration
@settings(FUZZ, max_examples=QUERY_EXAMPLES)
@given(lang=query_values, since=since_values)
def test_captions_query_gets_captions_or_a_clear_error_and_close(
    gateway: _Gateway, lang: str | None, since: str | None,
) -> None:
    from urllib.parse import urlencode

    query = {k: v for k, v in (("lang", lang), ("since", since)) if v is not None}
    url = f"{gateway.base}/v1/streams/hall/captions?{urlencode(query)}"
    valid_since = since in (None, "") or (since.isascii() and since.isdigit() and
                                          int(since) <= NEWEST)
    quiet = lang in (None, "", "en", "fr") and (since in (None, "") or (
        valid_since and int(since) == NEWEST) or lang == "fr")
    with connect(url) as ws:
        try:
            msg = recv_json(ws, timeout=0.2 if quiet else 5.0)
        except TimeoutError:
            assert lang in (None, "", "en", "fr") and valid_since  # live edge: quiet
            return
        except ConnectionClosed:
            pytest.fail("closed without an error event")
        if msg["type"] == "caption":
            assert lang in (None, "", "en") and valid_since
            return
        assert msg["type"] == "error" and msg["code"] in {
            "unknown_language", "invalid_since", "since_ahead"}, msg
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code in {4400, 4404, 4409}


@pytest.mark.integration
def test_after_all_that_the_gateway_still_serves(gateway: _Gateway) -> None:
    for ws in _conn.values():
        ws.close()
    _conn.clear()
    time.sleep(0.5)
    start = time.monotonic()
    with connect(f"{gateway.base}/v1/streams/hall/captions?lang=en&since=0") as ws:
        assert recv_json(ws)["seq"] == 1
    with connect(f"{gateway.base}/v1/realtime?stream=hall", additional_headers=AUTH) as ws:
        assert recv_json(ws)["type"] == "session.created"
    assert time.monotonic() - start < 30
