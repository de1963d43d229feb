"""A Redis restart loses nothing: a real redis-server (append-only file, as `babelcast run`
keeps its local one) is SIGKILLed for 20 s and started again on the same port while a
caption publisher, a client of the real gateway, file ingest and the readiness probe
run; and a Redis that comes back empty neither gives a seq twice nor loses the
translation job group."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import websockets
from redis.asyncio import Redis

from orchestrator.epoch import EpochGuard
from orchestrator.gateway.app import GatewayStream
from orchestrator.redis_server import LocalRedisServer, free_port
from tests.outputs_support import caption, running_gateway
from tests.speech import AUDIO
from translation.jobs import JobQueue
from workers.bus import RedisBus, captions_key, retry_redis
from workers.events import StreamOptions, TranslationJob
from workers.ingest import IngestHost, IngestHostOptions

pytestmark = pytest.mark.integration

OUTAGE_S = 20.0
BACK_WITHIN_S = 10.0


def hall() -> list[GatewayStream]:
    return [GatewayStream(StreamOptions(stream_id="hall", name="Hall", source="push",
                                        language="en"), "push")]


async def test_a_20_s_redis_outage_loses_no_caption_and_readiness_says_so(
    tmp_path: Path,
) -> None:
    import json
    import logging

    logging.getLogger("workers.bus").setLevel(logging.ERROR)
    server = LocalRedisServer(port=free_port(), data_dir=tmp_path / "redis")
    url = server.start()
    redis = Redis.from_url(url)
    bus = RedisBus(redis)
    published: list[int] = []
    received: list[int] = []
    stop = asyncio.Event()

    async def publisher() -> None:  # what the ASR side does: hold a caption until it is in
        seq = 0
        while not stop.is_set():
            seq += 1
            seg = caption(seq, seq, f"sentence {seq}", seq, seq + 1.0, stream="hall")
            await retry_redis(lambda s=seg: bus.publish_caption(s), what="test",
                              log=logging.getLogger("test"))
            published.append(seq)
            await asyncio.sleep(0.1)

    ingest = IngestHost(IngestHostOptions(actor_id="ingest-t", redis_url=url))
    await ingest.start()
    await ingest.add_stream(StreamOptions(stream_id="room", name="room",
                                          source=str(AUDIO / "room-a.flac"), language="en",
                                          loop=True))
    async with running_gateway(url, hall()) as gw:
        ws_url = gw.base.replace("http://", "ws://") + "/v1/streams/hall/captions?since=0"

        async def client() -> None:
            async with websockets.connect(ws_url) as ws:
                quiet_since = time.monotonic()
                while not stop.is_set() or len(received) < len(published):
                    try:
                        msg = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
                    except TimeoutError:
                        assert time.monotonic() - quiet_since < 60, "no caption for 60 s"
                        continue
                    quiet_since = time.monotonic()
                    assert msg["type"] == "caption", msg
                    received.append(msg["seq"])

        pub = asyncio.create_task(publisher())
        reader = asyncio.create_task(client())
        async with httpx.AsyncClient(base_url=gw.base) as http:
            await asyncio.sleep(3)
            assert (await http.get("/healthz")).status_code == 200
            before_outage = len(published)
            assert before_outage >= 10
            os.kill(server.pid or 0, signal.SIGKILL)
            t_down = time.monotonic()
            ready_codes = []
            while time.monotonic() - t_down < OUTAGE_S:
                ready_codes.append((await http.get("/healthz")).status_code)
                assert (await http.get("/livez")).status_code == 200
                await asyncio.sleep(1)
            assert set(ready_codes) == {503}, ready_codes
            server.spawn()  # same port, same append-only file
            t_back = time.monotonic()
            while len(published) < before_outage + 5:
                assert time.monotonic() - t_back < BACK_WITHIN_S, "captions did not resume"
                await asyncio.sleep(0.1)
            while received[-1:] != published[-1:]:
                assert time.monotonic() - t_back < BACK_WITHIN_S, "the client did not catch up"
                await asyncio.sleep(0.1)
            caught_up_s = time.monotonic() - t_back
            audio_back = False
            while time.monotonic() - t_back < BACK_WITHIN_S and not audio_back:
                audio_back = (await redis.xlen("audio:room")) > 0 and (
                    time.time() - (await bus.last_audio_end("room"))[1] < 1.0)
                await asyncio.sleep(0.2)
            assert audio_back, "file ingest did not come back"
            assert "room" in ingest.streams()
            while (await http.get("/healthz")).status_code != 200:
                assert time.monotonic() - t_back < BACK_WITHIN_S
                await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(pub, 10)
        await asyncio.wait_for(reader, 30)
        # Finals from before the outage are still there to replay.
        replay = await bus.captions_after("hall", "en", 0)
        assert [s.seq for s in replay][:before_outage] == list(range(1, before_outage + 1))
    await ingest.stop()
    await redis.aclose()
    server.stop()
    assert received == published == list(range(1, len(published) + 1)), "gap or duplicate"
    print(f"client caught up {caught_up_s:.1f} s after Redis returned")


async def test_an_emptied_redis_gives_no_seq_twice_and_translators_wait_for_the_floor(
    redis_url: str,
) -> None:
    redis = Redis.from_url(redis_url)
    bus = RedisBus(redis)
    for seq in range(1, 6):
        await bus.publish_caption(caption(seq, seq, "s", 0, 1, stream="hall"))
    fr = caption(0, 1, "t", 0, 1, stream="hall", lang="fr")
    guard = EpochGuard(redis, [("hall", "en"), ("hall", "fr")], every_s=0.05)
    old = await guard.start()
    assert await bus.publish_translation(fr, epoch=old) == 1
    await guard.check()
    await redis.flushall()  # Redis came back empty
    assert await bus.publish_translation(fr, epoch=old) == -1  # refused: wait
    await guard.check()
    new = await bus.epoch()
    assert new and new != old and guard.resets == 1
    assert await bus.last_seq("hall", "en") == 5 and await bus.last_seq("hall", "fr") == 1
    assert await bus.captions_after("hall", "en", 0) == []
    later = caption(0, 2, "t", 0, 1, stream="hall", lang="fr")
    assert await bus.publish_translation(later, epoch=new) == 2  # not 1 again
    with pytest.raises(Exception, match="equal or smaller"):
        await redis.xadd(captions_key("hall", "en"), {"d": "x"}, id="3-0")
    await bus.publish_caption(caption(6, 6, "s", 0, 1, stream="hall"))  # the ASR goes on
    assert [s.seq for s in await bus.captions_after("hall", "en", 0)] == [6]
    await redis.aclose()


async def test_translator_recreates_its_job_group_and_does_not_redo_done_jobs(
    redis_url: str,
) -> None:
    redis = Redis.from_url(redis_url)
    bus = RedisBus(redis)
    queue = JobQueue(redis, "translator-0")
    await queue.ensure_group()

    def job(n: int) -> TranslationJob:
        return TranslationJob(stream="hall", segment_id=n, seq=n, text=f"s{n}",
                              source_lang="en", targets=("fr",), context=(), audio_start_s=0.0,
                              audio_end_s=1.0, audio_end_wall=0.0, source_emit_time=0.0)

    for n in (1, 2):
        await bus.enqueue_job(job(n))
    first = await queue.read(10, 100)
    assert [d.job.segment_id for d in first if d.job] == [1, 2]
    await queue.ack([d.entry_id for d in first])
    await redis.xgroup_destroy("mt:jobs", "translators")  # lost with a Redis restart
    await bus.enqueue_job(job(3))
    assert await queue.read(10, 100) == []  # NOGROUP: the group is made again
    again = await queue.read(10, 100)
    assert [d.job.segment_id for d in again if d.job] == [3]
    assert queue.groups_recreated == 1
    await redis.aclose()


def test_two_runs_never_share_one_append_only_folder(tmp_path: Path) -> None:
    """Two redis-servers writing one append-only file corrupt it, and then neither starts
    again ("Bad file format reading the append only file"): the second run is refused with
    what to do, the first keeps its data, and the folder is free once the first stops."""
    from orchestrator.config import parse_event
    from orchestrator.redis_server import RedisServerError

    first = LocalRedisServer(data_dir=tmp_path / "aof")
    first.start()
    try:
        second = LocalRedisServer(data_dir=tmp_path / "aof")
        with pytest.raises(RedisServerError, match="another babelcast run uses"):
            second.start()
        assert first.alive() and first.ready()
    finally:
        first.stop()
    again = LocalRedisServer(data_dir=tmp_path / "aof")
    again.start()
    again.stop()
    # Without a redis section the folder is beside the event file, not where babelcast
    # was started from (every run started in one folder used to share one).
    cfg = parse_event("event: e\nstreams: [{id: a, source: push}]", base_dir=tmp_path)
    assert cfg.redis.resolved_data_dir == str(tmp_path / ".babelcast" / "redis")
