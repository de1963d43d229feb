"""A push flood against a real event: `babelcast run` (real gateway, real redis-server,
local Ray, the embedded tiny.en engine) with two rooms on one ASR actor: `room` plays
real speech from a file, `booth` is a push stream. The booth's publisher floods real
speech as fast as its socket takes it: it is closed 1008 (`rate_limited`) after its burst
allowance, and the room's final latency after the flood stays within 2 × what it was
before. (Before issue 13 the same flood, unbounded, took the room from 0.8 s to 62 s.)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from redis.asyncio import Redis

from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.redis_server import LocalRedisServer, free_port
from tests.event_support import Event, start_event, stop_event
from tests.speech import AUDIO, decode_pcm16
from workers.bus import RedisBus

pytestmark = pytest.mark.integration

PUBLISH = "flood-publish-token-0123456789"
ENV = {"FLOOD_ADMIN": "flood-admin-token-0123456789", "FLOOD_PUBLISH": PUBLISH}
LIMITS = LimitsConfig()  # the event sets none: the defaults apply
BEFORE_FINALS = 3
"""Finals of the room that set its latency before the flood (after the first, which
includes the model's warm-up)."""
AFTER_S = 20.0
"""How long after the flood the room is watched: the booth's admitted audio (≈ the
burst) is decoded by the same actor meanwhile."""


@pytest.fixture(scope="module")
def event(redis_server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Event, str]]:
    tmp = tmp_path_factory.mktemp("flood")
    port = free_port()
    redis_url = f"{redis_server.url.rsplit('/', 1)[0]}/2"  # a database of its own
    cfg = tmp / "event.yaml"
    cfg.write_text(f"""
event: flood test
redis: {{url: "{redis_url}"}}
engine: {{kind: embedded, model: tiny.en, actors: 1, streams_per_actor: 2}}
streams:
  - {{id: room, source: "{AUDIO / 'room-a.flac'}", loop: true, language: en}}
  - {{id: booth, source: push, language: en}}
# One gateway process: the flood's pacing and caps are per process, and a second one
# would only compete for the 2 cores the flood saturates.
gateway: {{host: 127.0.0.1, port: {port}, workers: 1}}
auth: {{admin_token_env: FLOOD_ADMIN, publish_token_env: {{booth: FLOOD_PUBLISH}},
        viewers: public}}
""")
    ev = start_event(cfg, port, ENV, duration_s=300)
    yield ev, redis_url
    stop_event(ev)


class Finals:
    """The finals of one stream as a live client gets them, with their latency: the
    time from the end of the audio they transcribe to their publication."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    async def follow(self, url: str) -> None:
        async with websockets.connect(url) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg.get("type") == "caption" and msg["is_final"] and msg["text"]:
                    msg["latency_s"] = msg["emit_time"] - msg["audio_end_wall"]
                    self.got.append(msg)
                    self.changed.set()

    async def until(self, count: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.got) < count:
                self.changed.clear()
                await self.changed.wait()


def speech(seconds: float) -> bytes:
    """Real speech (room-b, repeated) of at least `seconds`."""
    pcm = decode_pcm16(AUDIO / "room-b.flac")
    return pcm * (int(seconds * 32_000 / len(pcm)) + 1)


async def flood(url: str) -> tuple[float, int, dict[str, Any], int | None]:
    """Send 2 s frames as fast as the socket takes them until the gateway closes it:
    (seconds it took, bytes sent, the error event, close code)."""
    pcm = speech(120)
    sent, error, code = 0, {}, None
    started = time.monotonic()
    async with websockets.connect(url, additional_headers={
            "Authorization": f"Bearer {PUBLISH}"}) as ws:
        receiver = asyncio.create_task(ws.recv())
        try:
            for i in range(0, len(pcm), 64_000):
                await ws.send(pcm[i:i + 64_000])
                sent += len(pcm[i:i + 64_000])
                if receiver.done():
                    break
            error = json.loads(await asyncio.wait_for(receiver, 10))
            await asyncio.wait_for(ws.recv(), 10)
        except websockets.ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
    return time.monotonic() - started, sent, error, code


async def test_a_push_flood_closes_that_publisher_and_the_other_room_keeps_its_latency(
    event: tuple[Event, str],
) -> None:
    ev, redis_url = event
    room, booth = Finals(), Finals()
    followers = [asyncio.create_task(room.follow(f"{ev.ws}/v1/streams/room/captions?lang=en")),
                 asyncio.create_task(booth.follow(f"{ev.ws}/v1/streams/booth/captions?lang=en"))]
    try:
        await room.until(1 + BEFORE_FINALS, timeout_s=120)
        before = [f["latency_s"] for f in room.got[1:]]

        flood_at = time.time()
        took_s, sent, error, code = await flood(f"{ev.ws}/v1/streams/booth/audio")
        assert error.get("code") == "rate_limited" and code == 1008, (error, code)
        bus = RedisBus(Redis.from_url(redis_url))
        taken_s = (await bus.last_audio_end("booth"))[0] / 16_000
        await bus.redis.aclose()
        # The gateway took its burst and its pace, no more; the client sent far more.
        assert taken_s <= LIMITS.push_burst_s + LIMITS.push_rate * took_s + 0.5, (
            taken_s, took_s)
        assert sent / 32_000 > 2 * taken_s

        await asyncio.sleep(AFTER_S)
        after = [f["latency_s"] for f in room.got if f["audio_end_wall"] >= flood_at]
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    print(f"\nroom final latency before the flood: {[round(x, 2) for x in before]}, "
          f"after: {[round(x, 2) for x in after]}; booth took {taken_s:.1f} s of audio, "
          f"{len(booth.got)} finals of it")
    assert len(after) >= 2, "the room kept captioning"
    assert booth.got, "the booth's admitted speech was captioned: the actor did that work"
    # Like with like: the worst of as many finals on each side. The suite's other worker
    # runs other tests on the same 2 cores meanwhile, so single finals vary on both
    # sides (a fresh-clone run: before 0.99, 1.13, 1.83 s, after 3.20, 1.35, 1.22 s;
    # alone, after ≤ 1.5 s in 3 of 3); the worst after the flood against the median
    # before set a max against a median. The unbounded flood this guards against took
    # the room from 0.8 s to 62 s.
    n = min(len(before), len(after))
    reference, worst = max(before[:n]), max(after[:n])
    assert worst <= 2 * reference, (
        f"the room's final latency went from {reference:.2f} s to {worst:.2f} s")

