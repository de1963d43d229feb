"""`/v1/status` and `babelcast status`: the headline figures, from the status hashes the
actors keep in a real Redis, through the real gateway, printed as an operator runs it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import websockets

from orchestrator.gateway.app import GatewayStream
from orchestrator.redis_server import free_port
from orchestrator.status import register_actors, render
from tests.outputs_support import ADMIN, ADMIN_TOKEN, caption, running_gateway
from workers.bus import RedisBus
from workers.events import StreamOptions

pytestmark = pytest.mark.integration

SECRET = "Caption words never reach status output"
INT4 = "KV cache dtype 'int4_per_token_head' is stored as bytes this plugin cannot rotate"


def streams() -> list[GatewayStream]:
    return [
        GatewayStream(StreamOptions(stream_id="hall", name="Main hall", source="x.flac",
                                    language="en", targets=("pt", "es")), "file"),
        GatewayStream(StreamOptions(stream_id="annex", name="Annex", source="push",
                                    language="en"), "push"),
    ]


async def seed(bus: RedisBus, now: float) -> None:
    """What the actors and the runtime write while an event runs."""
    await bus.set_status("hall", placement="asr-0", asr_state="captioning", asr_actor="asr-0",
                         source_state="live", last_caption_at=now - 2.0,
                         last_final_latency_s=1.25, speech_without_caption_s=0.0,
                         rollovers_rut=1, rollovers_budget=2, gaps=3, caption_lag_s=23.4)
    for _ in range(7):
        await bus.incr_status("hall", "finals")
    await bus.set_status("annex", placement="unplaced")
    await bus.publish_caption(caption(1, 1, SECRET, 0.0, 1.0, stream="hall"))
    pt = caption(1, 1, SECRET, 0.0, 1.0, stream="hall", lang="pt", wall=now - 1.5)
    await bus.publish_caption(pt)
    await bus.set_actor_status("asr-0", {"streams": 1, "max_streams": 2, "decode_busy_s": 30.0,
                                         "audio_s": 120.0, "max_caption_lag_s": 23.4,
                                         "streams_behind": 1})
    await bus.set_actor_status("translator-0", {
        "kind": "translator", "finals_published": 14, "errors": 1, "lag_p50_s": 0.4,
        "lag_p95_s": 0.9, "lag_p50_s_pt": 0.5, "lag_p95_s_pt": 1.1, "queue_lag": 3,
        "queue_pending": 1, "queue_oldest_age_s": 2.5})
    # asr-9 has stopped reporting; asr-7 belongs to an earlier event; asr-3 runs vLLM
    # with re-anchoring, and its engine has died.
    await bus.redis.hset("actor:asr-9", mapping={"streams": 1, "max_streams": 2,
                                                  "updated": repr(now - 600)})
    await bus.set_actor_status("asr-3", {"streams": 2, "max_streams": 16, "engine_ok": 0,
                                         "engine_mode": "reanchor", "reanchors": 12,
                                         "reanchoring": 1.0, "engine_mode_why": ""})
    await bus.set_actor_status("asr-7", {"streams": 1, "max_streams": 2})
    # asr-4 asked for re-anchoring and its engine's probe refused: it rolls over.
    await bus.set_actor_status("asr-4", {"streams": 1, "max_streams": 16, "engine_ok": 1,
                                         "engine_mode": "rollover", "reanchoring": 0.0,
                                         "engine_mode_why": INT4})
    await register_actors(bus, ["asr-7"])
    await register_actors(bus, ["asr-0", "asr-3", "asr-4", "asr-9", "translator-0"])


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", *args],
                          capture_output=True, text=True, timeout=60)


async def test_status_reports_rooms_translation_actors_and_clients(
    redis_url: str, bus: RedisBus
) -> None:
    now = time.time()
    await seed(bus, now)
    async with running_gateway(redis_url, streams()) as gw:
        ws_url = gw.base.replace("http://", "ws://") + "/v1/streams/hall/captions?lang=pt"
        async with websockets.connect(ws_url), httpx.AsyncClient(base_url=gw.base,
                                                                 headers=ADMIN) as http:
            async def one_client() -> dict[str, Any]:
                while True:
                    body: dict[str, Any] = (await http.get("/v1/status")).json()
                    if body["clients"]["total"] == 1:
                        return body
                    await asyncio.sleep(0.05)

            body = await asyncio.wait_for(one_client(), 10)
            text, as_json = await asyncio.gather(
                asyncio.to_thread(cli, "--url", gw.base, "--token", ADMIN_TOKEN),
                asyncio.to_thread(cli, "--url", gw.base, "--json", "--token", ADMIN_TOKEN))
    rooms = {s["id"]: s for s in body["streams"]}
    hall, annex = rooms["hall"], rooms["annex"]
    assert hall["state"] == "captioning" and hall["actor"] == "asr-0"
    assert 1.5 <= hall["last_caption_age_s"] <= 10
    assert hall["last_final_latency_s"] == 1.25 and hall["finals"] == 7
    assert hall["rollovers"] == 3 and hall["gaps"] == 3 and hall["clients"] == 1
    assert hall["caption_lag_s"] == 23.4 and hall["behind"] is True
    assert hall["translations"]["pt"]["speech_to_translation_s"] == pytest.approx(1.5, abs=0.2)
    assert hall["translations"]["es"]["last_age_s"] is None
    assert annex["state"] == "unplaced"
    actors = {a["id"]: a for a in body["actors"]}
    assert set(actors) == {"asr-0", "asr-3", "asr-4", "asr-9", "translator-0"}
    assert actors["asr-3"]["engine_ok"] is False
    assert actors["asr-3"]["engine_mode"] == "reanchor" and actors["asr-3"]["reanchors"] == 12
    assert actors["asr-0"]["engine_ok"] is None  # an engine that says nothing
    # why an engine asked to re-anchor rolls over; nothing where it re-anchors
    assert actors["asr-4"]["engine_mode_why"] == INT4
    assert actors["asr-3"]["engine_mode_why"] is None
    assert actors["asr-0"]["rtf"] == 0.25 and not actors["asr-0"]["silent"]
    # A fast engine (rtf 0.25) whose stream is 23 s behind does not read healthy.
    assert actors["asr-0"]["streams_behind"] == 1
    assert actors["asr-0"]["max_caption_lag_s"] == 23.4
    assert actors["asr-9"]["silent"]
    assert actors["translator-0"]["queue_waiting"] == 3
    assert body["translation"]["languages"] == {"pt": {"lag_p50_s": 0.5, "lag_p95_s": 1.1}}
    assert body["translation"]["queue"] == {"waiting": 3, "pending": 1, "oldest_age_s": 2.5}
    assert body["clients"]["by_stream"] == {"hall": {"pt": 1}}

    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "Babelcast — Test event" in out
    hall_line = next(line for line in out.splitlines() if line.startswith("hall "))
    assert "captioning" in hall_line and "asr-0" in hall_line and "1.25 s" in hall_line
    assert any(line.startswith("annex ") and "unplaced" in line for line in out.splitlines())
    assert "3 waiting, 1 in progress" in out
    assert any(line.split()[:4] == ["hall", "pt", "0.50", "s"] for line in out.splitlines())
    assert "1/2 streams" in out and "rtf 0.25" in out and "SILENT" in out
    assert "1 behind (max lag 23 s)" in out
    assert "23.4 s BEHIND" in hall_line
    behind = next(line for line in out.splitlines() if line.startswith("Behind real time:"))
    assert "hall 23 s (on asr-0)" in behind and "streams_per_actor" in behind
    asr3 = next(line for line in out.splitlines() if line.startswith("asr-3 "))
    assert "ENGINE DEAD" in asr3 and "reanchor" in asr3 and "12 re-anchors" in asr3
    assert "re-anchoring off" not in asr3
    asr4 = next(line for line in out.splitlines() if line.startswith("asr-4 "))
    assert f"rollover (re-anchoring off: {INT4})" in asr4
    assert "Clients: 1 connected; hall: pt 1" in out
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout)["streams"][0]["id"] == "hall"
    assert SECRET not in out and SECRET not in as_json.stdout


def test_status_says_what_to_do_when_no_gateway_answers() -> None:
    result = cli("--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "cannot reach the gateway" in result.stderr and "--url" in result.stderr


def test_render_of_an_event_that_just_started() -> None:
    body = {"event": "e", "streams": [{
        "id": "hall", "state": "waiting", "source_state": "-", "source_error": "",
        "actor": None, "last_caption_age_s": None, "last_final_latency_s": None, "finals": 0,
        "speech_without_caption_s": None, "rollovers": 0, "clients": 0, "translations": {}}],
        "actors": [], "translation": {"languages": {}, "queue": {}},
        "clients": {"total": 0, "by_stream": {}}}
    out = render(body)
    assert "hall  waiting" in out and "Clients: 0 connected" in out
    assert "Translation" not in out


async def test_ingest_actors_say_live_and_idle_and_a_room_fed_only_filler_is_source_lost(
    redis_url: str, bus: RedisBus
) -> None:
    from orchestrator.status import collect
    from tests.speech import AUDIO
    from workers.ingest import IngestHost, IngestHostOptions

    hall = StreamOptions(stream_id="hall", name="Hall", source=str(AUDIO / "room-a.flac"),
                         language="en")
    obs = StreamOptions(stream_id="obs", name="OBS", language="en", key="k",
                        source=f"rtmp://127.0.0.1:{free_port()}/live?listen=1")
    host = IngestHost(IngestHostOptions(actor_id="ingest-0", redis_url=redis_url))
    await host.start()
    try:
        await register_actors(bus, ["ingest-0"])
        for opts in (hall, obs):
            await host.add_stream(opts)
        # What the ASR side writes for a room that captioned, then got only filler.
        await bus.set_status("obs", asr_state="captioning", source_silent_s=4.2, stalls=3,
                             gap_fill_s=4.2, late_audio_dropped_s=0.0)

        async def reported() -> dict[str, Any]:
            while True:
                body = await collect(bus, [hall, obs], "Test event", {})
                actor = body["actors"][0]
                if actor.get("live") == 1 and actor.get("idle") == 1:
                    return body
                await asyncio.sleep(0.1)

        body = await asyncio.wait_for(reported(), 10)
    finally:
        await asyncio.wait_for(host.stop(), 15)
    actor = body["actors"][0]
    assert (actor["id"], actor["role"], actor["silent"]) == ("ingest-0", "ingest", False)
    rooms = {s["id"]: s for s in body["streams"]}
    assert rooms["hall"]["source_state"] == "live"
    assert rooms["obs"]["source_state"] == "idle" and rooms["obs"]["state"] == "source lost"
    assert "waiting for an encoder" in rooms["obs"]["source_note"]
    out = render(body)
    assert "ingest-0  ingest  2 streams: 1 live, 1 idle" in out
    header = next(line for line in out.splitlines() if line.startswith("ROOM "))
    assert "STALLS" in header and "FILLER" in header and "DROPPED" in header
    obs_line = next(line for line in out.splitlines() if line.startswith("obs "))
    assert "source lost" in obs_line and "4.2 s" in obs_line and "0.0 s" in obs_line


def test_room_state_tells_the_truth_about_the_source() -> None:
    from orchestrator.status import room_state

    assert room_state({"asr_state": "captioning", "source_state": "live"}) == "captioning"
    assert room_state({"asr_state": "captioning", "source_state": "live",
                       "source_silent_s": "2.5"}) == "source lost"
    assert room_state({"asr_state": "captioning", "source_state": "reconnecting"}) == \
        "source lost"
    assert room_state({"asr_state": "listening", "source_state": "idle"}) == \
        "waiting for source"
    assert room_state({"asr_state": "captioning", "source_state": "ended",
                       "source_silent_s": "30"}) == "ended"
    assert room_state({"placement": "unplaced", "source_state": "idle"}) == "unplaced"


def test_the_stream_json_has_numbers_and_says_ended_once_the_source_ended() -> None:
    from orchestrator.status import typed_status

    st = typed_status({"rollovers_rut": "2.0", "finals": "12", "caption_lag_s": "3.0",
                       "last_final_latency_s": "1.25", "asr_state": "captioning",
                       "source_state": "ended", "asr_actor": "asr-0", "source_note": ""})
    assert st["rollovers_rut"] == 2 and isinstance(st["rollovers_rut"], int)
    assert st["finals"] == 12 and st["caption_lag_s"] == 3.0
    assert isinstance(st["caption_lag_s"], float) and st["last_final_latency_s"] == 1.25
    assert st["asr_state"] == "ended" and st["state"] == "ended"
    assert st["asr_actor"] == "asr-0" and st["source_note"] == ""
    assert typed_status({"asr_state": "captioning", "source_state": "live"})["asr_state"] == \
        "captioning"
