"""End to end on real parts: `babelcast run` (local Ray, real redis-server, the embedded
Whisper engine) captions the reference speech; clients read it over the gateway.

One event runs for the whole module (starting Ray and loading the model costs
~15 s); the tests read it from different angles while it plays:
- `talk` plays the five LibriVox utterances once, from a file;
- `broken` points at a port where nothing listens;
- `pushed` takes PCM16 frames over the push WebSocket.
`talk` is also translated into Portuguese (Bergamot) and Spanish (Apertium).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jiwer
import pytest
import websockets

from orchestrator.redis_server import LocalRedisServer, free_port
from tests.event_support import Event, start_event, stop_event
from tests.speech import AUDIO, decode_pcm16, normalize, reference_text, write_reference_wav

pytestmark = pytest.mark.integration

RECV_TIMEOUT_S = 30.0
ADMIN_TOKEN = "pipeline-admin-token-0123456789"
PUSH_TOKEN = "pipeline-publish-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PUBLISH = {"Authorization": f"Bearer {PUSH_TOKEN}"}
# Captions are public here (tests/test_auth.py covers viewer tokens); pushing and the
# event status need their tokens, which `babelcast run` reads from these variables.
AUTH = """
auth:
  admin_token_env: PIPELINE_ADMIN_TOKEN
  publish_token_env: {pushed: PIPELINE_PUSH_TOKEN}
  viewers: public
"""
ENV = {"PIPELINE_ADMIN_TOKEN": ADMIN_TOKEN, "PIPELINE_PUSH_TOKEN": PUSH_TOKEN}


@pytest.fixture(scope="module")
def event(redis_server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Event]:
    tmp = tmp_path_factory.mktemp("event")
    talk = write_reference_wav(tmp / "talk.wav")
    port = free_port()
    dead = free_port()  # nothing listens here
    cfg = tmp / "event.yaml"
    cfg.write_text(f"""
event: pipeline test
redis: {{url: "{redis_server.url}"}}
engine: {{kind: embedded, model: whisper-base, actors: 1, streams_per_actor: 3}}
streams:
  - {{id: talk, source: "{talk}", language: en, targets: [pt, es]}}
  - {{id: broken, source: "http://127.0.0.1:{dead}/live.mp3", language: en}}
  - {{id: pushed, source: push, language: en}}
# gateway.workers as by default ('auto': one per core): clients, pushes and the realtime
# endpoint land on any of them
gateway: {{host: 127.0.0.1, port: {port}}}
""" + AUTH)
    ev = start_event(cfg, port, ENV)
    yield ev
    stop_event(ev)


async def messages(url: str) -> AsyncIterator[dict[str, Any]]:
    async with websockets.connect(url) as ws:
        while True:
            raw = await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
            yield json.loads(raw)


async def collect_talk_finals(event: Event) -> list[dict[str, Any]]:
    """All publications of `talk` from the first, until its source has ended and
    nothing new has come for a few seconds."""
    out: list[dict[str, Any]] = []
    url = f"{event.ws}/v1/streams/talk/captions?lang=en&since=0"
    async with websockets.connect(url) as ws, httpx.AsyncClient(base_url=event.base) as http:
        while True:
            try:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 4.0))
            except TimeoutError:
                status = (await http.get("/v1/streams/talk")).json()["status"]
                if status.get("source_state") == "ended" and out and (
                        out[-1]["is_final"] or out[-1]["type"] == "withdraw"):
                    return out
                continue
            # A withdraw takes back a partial never confirmed (segmenter.py).
            assert msg["type"] in ("caption", "withdraw"), msg
            out.append(msg)


@pytest.fixture(scope="module")
def talk_messages(event: Event) -> list[dict[str, Any]]:
    return asyncio.run(asyncio.wait_for(collect_talk_finals(event), 180))


def test_finals_of_reference_speech_have_low_wer(talk_messages: list[dict[str, Any]]) -> None:
    finals = [m["text"] for m in talk_messages if m["is_final"]]
    hyp = normalize(" ".join(finals))
    wer = jiwer.wer(normalize(reference_text()), hyp)
    assert wer <= 0.10, f"WER {wer:.3f}"


def test_seq_is_contiguous_and_finals_are_never_revised(
    talk_messages: list[dict[str, Any]],
) -> None:
    seqs = [m["seq"] for m in talk_messages]
    assert seqs == list(range(1, len(seqs) + 1))
    final_ids = set()
    for m in talk_messages:
        assert m["segment_id"] not in final_ids, "a final segment was published again"
        if m["is_final"]:
            final_ids.add(m["segment_id"])
            # Never an empty or untimed final (issue 36).
            assert m["text"] and 0 <= m["audio_start_s"] < m["audio_end_s"], m["seq"]
        if m["type"] == "withdraw":
            final_ids.add(m["segment_id"])
            assert not m["text"] and not m["is_final"]
        for line in m["lines"]:
            assert len(line) <= 42
        assert len(m["lines"]) <= 2
    assert len(final_ids) >= 5


_STOPWORDS = {"pt": {"o", "a", "de", "que", "não", "um", "uma", "ele", "para", "e"},
              "es": {"el", "la", "de", "que", "no", "un", "una", "él", "para", "y"}}


def test_every_final_reaches_the_pt_and_es_subscribers_once(
    event: Event, talk_messages: list[dict[str, Any]]
) -> None:
    source = {m["segment_id"]: m for m in talk_messages if m["is_final"] and m["text"]}
    assert len(source) >= 4

    async def read(lang: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        url = f"{event.ws}/v1/streams/talk/captions?lang={lang}&since=0"
        async with websockets.connect(url) as ws:
            while {m["segment_id"] for m in out} < source.keys():
                out.append(json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)))
        return out

    for lang in ("pt", "es"):
        got = asyncio.run(read(lang))
        finals = [m for m in got if m["is_final"]]
        assert sorted(m["segment_id"] for m in finals) == sorted(source), f"{lang}: once each"
        for m in finals:
            src = source[m["segment_id"]]
            assert m["lang"] == lang and m["source_lang"] == "en" and m["error"] is None
            assert m["text"] and m["text"] != src["text"]
            assert m["audio_end_s"] == src["audio_end_s"]
            assert m["emit_time"] >= src["emit_time"]
        words = " ".join(m["text"].lower() for m in finals).split()
        assert sum(w in _STOPWORDS[lang] for w in words) >= len(words) / 10, f"{lang}: {lang}?"


def test_broken_source_is_reported_and_does_not_disturb_others(
    event: Event, talk_messages: list[dict[str, Any]]
) -> None:
    # `talk` was captioned in full above while `broken` kept failing.
    status = httpx.get(f"{event.base}/v1/streams/broken").json()["status"]
    assert status["source_state"] in {"reconnecting", "connecting"}
    assert float(status["source_reconnects"]) >= 2
    assert "127.0.0.1" in status["source_error"]
    listing = {s["id"]: s for s in httpx.get(f"{event.base}/v1/streams").json()}
    assert set(listing) == {"talk", "broken", "pushed"}
    # Its source has ended (the fixture waited for it): so has its captioning, and the
    # counts are numbers.
    assert listing["talk"]["status"]["asr_state"] == "ended"
    assert listing["talk"]["status"]["state"] == "ended"
    assert isinstance(listing["talk"]["status"]["finals"], int)


def test_client_reconnecting_with_since_gets_exactly_what_it_missed(
    event: Event, talk_messages: list[dict[str, Any]]
) -> None:
    everything = [(m["seq"], m["text"], m["is_final"]) for m in talk_messages]

    async def run() -> list[tuple[int, str, bool]]:
        got: list[tuple[int, str, bool]] = []
        url = f"{event.ws}/v1/streams/talk/captions?lang=en&since=0"
        async for msg in messages(url):
            got.append((msg["seq"], msg["text"], msg["is_final"]))
            if len(got) == 7:
                break
        url = f"{event.ws}/v1/streams/talk/captions?lang=en&since={got[-1][0]}"
        async for msg in messages(url):
            got.append((msg["seq"], msg["text"], msg["is_final"]))
            if msg["seq"] == everything[-1][0]:
                break
        return got

    assert asyncio.run(asyncio.wait_for(run(), 60)) == everything


def test_bad_query_and_unknown_stream_get_error_events(event: Event) -> None:
    async def first(url: str) -> dict[str, Any]:
        async with websockets.connect(url) as ws:
            return dict(json.loads(await asyncio.wait_for(ws.recv(), 10)))

    assert asyncio.run(first(f"{event.ws}/v1/streams/nope/captions"))["code"] == "unknown_stream"
    bad = asyncio.run(first(f"{event.ws}/v1/streams/talk/captions?lang=en&since=x"))
    assert bad["code"] == "invalid_since"
    assert httpx.get(f"{event.base}/v1/streams/nope").status_code == 404
    assert httpx.get(f"{event.base}/metrics").status_code == 401
    assert "babelcast_gateway_messages_total" in httpx.get(f"{event.base}/metrics",
                                                           headers=ADMIN).text


def test_pushed_audio_is_captioned_and_bad_frames_get_errors(event: Event) -> None:
    pcm = decode_pcm16(AUDIO / "room-b.flac")

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        finals: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []

        async def listen() -> None:
            async for msg in messages(f"{event.ws}/v1/streams/pushed/captions?lang=en"):
                if msg["is_final"] and msg["text"]:
                    finals.append(msg)
                    if "himself" in msg["text"]:
                        return

        listener = asyncio.create_task(listen())
        await asyncio.sleep(0.5)
        async with websockets.connect(f"{event.ws}/v1/streams/pushed/audio",
                                      additional_headers=PUBLISH) as ws:
            await ws.send(b"\x00\x01\x02")  # odd length: not PCM16
            errors.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            await ws.send("hello")  # text frame
            errors.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            t0 = time.monotonic()
            for i in range(0, len(pcm), 3200):  # the socket survived: real audio follows
                await ws.send(pcm[i : i + 3200])
                await asyncio.sleep(max(0.0, t0 + (i + 3200) / 32000 - time.monotonic()))
            silence = bytes(3200)
            for _ in range(15):
                await ws.send(silence)
                await asyncio.sleep(0.1)
            await asyncio.wait_for(listener, 30)
        return finals, errors

    finals, errors = asyncio.run(asyncio.wait_for(run(), 90))
    assert [e["code"] for e in errors] == ["invalid_audio", "invalid_audio"]
    ref = normalize((AUDIO / "room-b.txt").read_text())
    wer = jiwer.wer(ref, normalize(" ".join(m["text"] for m in finals)))
    assert wer <= 0.15, f"WER {wer:.3f}"


def test_push_to_a_pulled_stream_is_refused(event: Event) -> None:
    async def run() -> dict[str, Any]:
        async with websockets.connect(f"{event.ws}/v1/streams/talk/audio",
                                      additional_headers=PUBLISH) as ws:
            return dict(json.loads(await asyncio.wait_for(ws.recv(), 10)))

    assert asyncio.run(run())["code"] == "not_push"


def test_tail_prints_captions_as_a_client(
    event: Event, talk_messages: list[dict[str, Any]]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "tail", "talk", "--url", event.base,
         "--lang", "en", "--since", "0", "--finals", "--json", "--limit", "3"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    got = [json.loads(line) for line in result.stdout.splitlines()]
    want = [m for m in talk_messages if m["is_final"]][:3]
    assert [(m["seq"], m["text"]) for m in got] == [(m["seq"], m["text"]) for m in want]
    # Translations read the same way (the operator's `babelcast tail STREAM --lang pt`).
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "tail", "talk", "--url", event.base,
         "--lang", "pt", "--since", "0", "--finals", "--limit", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line[:10] for line in lines] == ["[     1] ■", "[     2] ■"]
    assert all(len(line) > 12 and "not translated" not in line for line in lines)


def test_realtime_ws_engine_captions_speech_through_babelcasts_own_endpoint(
    event: Event, talk_messages: list[dict[str, Any]]
) -> None:
    """The `realtime-ws` engine (behind the session manager, as in an ASR actor) as a
    client of the gateway's `/v1/realtime`, which feeds the event's push stream."""
    from workers.captions.segmenter import Segmenter
    from workers.engines.base import SessionOptions
    from workers.engines.realtime_ws import RealtimeWsEngine, RealtimeWsOptions
    from workers.events import SAMPLE_RATE, AudioChunk
    from workers.sessions.manager import SessionManager

    pcm = decode_pcm16(AUDIO / "room-a.flac") + bytes(2 * SAMPLE_RATE * 2)
    engine = RealtimeWsEngine(RealtimeWsOptions(
        url=f"{event.ws}/v1/realtime?stream=pushed", model="anything", delay_s=1.5,
        token=PUSH_TOKEN, text_lag_s=25.0))

    async def run() -> list[str]:
        manager = SessionManager(engine, SessionOptions("rt", "en"))
        manager.start()
        finals: list[str] = []

        async def feed() -> None:
            t0 = time.monotonic()
            for i in range(0, len(pcm), 3200):
                await asyncio.sleep(max(0.0, t0 + (i + 3200) / 32000 - time.monotonic()))
                await manager.push(AudioChunk("rt", i // 2, pcm[i : i + 3200], time.time()))
            await manager.end_input()

        async def consume() -> None:
            seg = Segmenter("rt", "en")
            async for delta in manager:
                finals.extend(c.text for c in seg.feed(delta) if c.is_final)

        await asyncio.gather(feed(), consume())
        return finals

    finals = asyncio.run(asyncio.wait_for(run(), 90))
    out = jiwer.process_words(normalize((AUDIO / "room-a.txt").read_text()),
                              normalize(" ".join(finals)))
    # Which side failed: words the engine missed (deletions: audio shed or skipped under
    # load, see the stream's status) or words it added (insertions: captions of other
    # audio), and what the pushed stream's status says it skipped.
    status = httpx.get(f"{event.base}/v1/streams/pushed").json()["status"]
    skipped = {k: v for k, v in status.items() if "skip" in k or "shed" in k or "lag" in k}
    assert out.wer <= 0.15, (
        f"WER {out.wer:.3f}: {out.substitutions} substituted, {out.deletions} deleted, "
        f"{out.insertions} inserted; stream status {skipped}")
    assert not engine.server_errors


def test_realtime_protocol_errors_are_answered_and_the_socket_stays_usable(
    event: Event,
) -> None:
    async def run() -> tuple[list[str], dict[str, Any]]:
        codes: list[str] = []
        async with websockets.connect(f"{event.ws}/v1/realtime?stream=pushed",
                                      additional_headers=PUBLISH) as ws:

            async def recv() -> dict[str, Any]:
                return dict(json.loads(await asyncio.wait_for(ws.recv(), 20)))

            assert (await recv())["type"] == "session.created"
            for bad in ("{not json", json.dumps({"type": "input_audio_buffer.commit"}),
                        json.dumps({"type": "no.such.event"}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}),
                        json.dumps({"type": "session.update"})):
                await ws.send(bad)
                reply = await recv()
                assert reply["type"] == "error"
                codes.append(reply["code"])
            # Still usable: a whole (short) session works after all of that.
            await ws.send(json.dumps({"type": "session.update", "model": "any-model"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": False}))
            silence = base64.b64encode(bytes(3200)).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            done = await recv()
            while done["type"] == "transcription.delta":
                # The stream's captions of earlier audio (another test's) may still come.
                done = await recv()
        return codes, done

    codes, done = asyncio.run(run())
    assert codes == ["invalid_json", "model_not_validated", "unknown_event", "invalid_audio",
                     "invalid_event"]
    assert done["type"] == "transcription.done"
    assert done["usage"]["audio_seconds"] == 0.1


def test_realtime_endpoint_refuses_a_stream_that_is_not_push(event: Event) -> None:
    async def run() -> dict[str, Any]:
        async with websockets.connect(f"{event.ws}/v1/realtime?stream=talk",
                                      additional_headers=PUBLISH) as ws:
            return dict(json.loads(await asyncio.wait_for(ws.recv(), 10)))

    reply = asyncio.run(run())
    assert reply["type"] == "error" and "push" in reply["error"]


def test_an_event_with_the_realtime_ws_engine_captions_through_another_events_endpoint(
    event: Event, redis_server: LocalRedisServer, tmp_path: Path,
    talk_messages: list[dict[str, Any]],
) -> None:
    """Event B's ASR actor runs the realtime-ws engine against event A's /v1/realtime
    (A's push stream, A's Whisper); B's own clients get captions as usual."""
    port = free_port()
    cfg = tmp_path / "relay.yaml"
    cfg.write_text(f"""
event: relay test
redis: {{url: "{redis_server.url[:-2]}/1"}}
engine:
  kind: realtime-ws
  model: whisper-base
  url: "{event.ws}/v1/realtime?stream=pushed"
  delay_s: 1.5
  text_lag_s: 25
  token_env: PIPELINE_PUSH_TOKEN
streams:
  - {{id: relay, source: "{AUDIO / 'room-a.flac'}", language: en}}
gateway: {{host: 127.0.0.1, port: {port}, workers: 1}}  # the main event runs 'auto'; one here
auth: {{admin_token_env: PIPELINE_ADMIN_TOKEN, viewers: public}}
""")
    relay = start_event(cfg, port, ENV)
    try:
        async def finals() -> list[str]:
            out: list[str] = []
            async for msg in messages(f"{relay.ws}/v1/streams/relay/captions?lang=en&since=0"):
                if msg["is_final"] and msg["text"]:
                    out.append(msg["text"])
                    # room-a ends with "... is to be ill disposed".
                    if "unless" in " ".join(out).lower() and "dispos" in msg["text"].lower():
                        return out
            return out

        got = asyncio.run(asyncio.wait_for(finals(), 120))
    finally:
        stop_event(relay)
    ref = normalize((AUDIO / "room-a.txt").read_text())
    wer = jiwer.wer(ref, normalize(" ".join(got)))
    assert wer <= 0.2, f"WER {wer:.3f}"
