"""The gateway's caption fan-out: the slow-client queue policy, and the hub on a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from orchestrator.gateway.hub import CaptionHub, ClientQueue
from orchestrator.redis_server import LocalRedisServer
from workers.bus import RedisBus, captions_key
from workers.events import CaptionSegment

# Tiers are per test: the queue tests are pure logic, the hub tests need redis-server.
unit = pytest.mark.unit
integration = pytest.mark.integration

RECV_TIMEOUT_S = 5.0


def caption(seq: int, *, final: bool, segment_id: int = 1, stream: str = "hall") -> CaptionSegment:
    text = f"caption {seq}"
    now = time.time()
    return CaptionSegment(
        stream=stream, lang="en", segment_id=segment_id, seq=seq, revision=0, is_final=final,
        text=text, stable_prefix_len=0, lines=(text,), audio_start_s=0.0, audio_end_s=1.0,
        audio_end_wall=now, emit_time=now,
    )


async def drain(queue: ClientQueue, n: int) -> list[CaptionSegment]:
    return [await asyncio.wait_for(queue.get(), RECV_TIMEOUT_S) for _ in range(n)]


# --- ClientQueue --------------------------------------------------------------------------


@unit
async def test_queue_below_its_size_keeps_everything_in_order() -> None:
    queue = ClientQueue(maxsize=4)
    sent = [caption(1, final=False), caption(2, final=True), caption(3, final=False)]
    for seg in sent:
        queue.put(seg)
    assert await drain(queue, 3) == sent
    assert queue.dropped == 0


@unit
async def test_full_queue_drops_interims_and_keeps_finals_in_order() -> None:
    queue = ClientQueue(maxsize=4)
    queue.put(caption(1, final=False, segment_id=1))
    queue.put(caption(2, final=True, segment_id=1))
    queue.put(caption(3, final=False, segment_id=2))
    queue.put(caption(4, final=False, segment_id=2))
    queue.put(caption(5, final=False, segment_id=2))  # full: the queued interims go
    queue.put(caption(6, final=True, segment_id=2))

    got = await drain(queue, 3)
    assert [s.seq for s in got] == [2, 5, 6]
    assert queue.dropped == 3


@unit
async def test_final_arriving_at_a_queue_full_of_interims_replaces_them() -> None:
    queue = ClientQueue(maxsize=3)
    for seq in (1, 2, 3):
        queue.put(caption(seq, final=False))
    queue.put(caption(4, final=True))

    assert [s.seq for s in await drain(queue, 1)] == [4]
    assert queue.dropped == 3


@unit
async def test_final_is_never_dropped_even_when_the_queue_is_full_of_finals() -> None:
    queue = ClientQueue(maxsize=3)
    for seq in (1, 2, 3):
        queue.put(caption(seq, final=True, segment_id=seq))
    queue.put(caption(4, final=False, segment_id=4))  # nothing to make room: dropped
    queue.put(caption(5, final=True, segment_id=4))  # kept, beyond maxsize

    assert [s.seq for s in await drain(queue, 4)] == [1, 2, 3, 5]
    assert queue.dropped == 1


@unit
async def test_get_waits_for_the_next_put() -> None:
    queue = ClientQueue()
    waiting = asyncio.create_task(queue.get())
    await asyncio.sleep(0)  # let the getter block on the empty queue
    assert not waiting.done()
    queue.put(caption(1, final=True))
    assert (await asyncio.wait_for(waiting, RECV_TIMEOUT_S)).seq == 1


# --- CaptionHub on a real Redis -----------------------------------------------------------


@pytest.fixture
async def redis_client(redis_server: LocalRedisServer) -> AsyncIterator[Redis]:
    """A client of the session-wide server, emptied for this test."""
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
async def hub(redis_client: Redis) -> AsyncIterator[CaptionHub]:
    hub = CaptionHub(redis_client)
    await hub.start()
    yield hub
    await asyncio.wait_for(hub.stop(), 10)


@pytest.fixture
def bus(redis_client: Redis) -> RedisBus:
    return RedisBus(redis_client)


@integration
async def test_every_subscriber_of_a_key_receives_a_published_caption(
    hub: CaptionHub, bus: RedisBus
) -> None:
    key = captions_key("hall", "en")
    first, second = ClientQueue(), ClientQueue()
    await hub.subscribe(key, first)
    await hub.subscribe(key, second)

    await bus.publish_caption(caption(1, final=True))
    assert (await asyncio.wait_for(first.get(), RECV_TIMEOUT_S)).seq == 1
    assert (await asyncio.wait_for(second.get(), RECV_TIMEOUT_S)).seq == 1

    await hub.unsubscribe(key, first)
    await bus.publish_caption(caption(2, final=True, segment_id=2))
    assert (await asyncio.wait_for(second.get(), RECV_TIMEOUT_S)).seq == 2
    # The hub hands a message to all of a key's queues at once, so by now `first`
    # would hold seq 2 if it were still subscribed: the next thing it yields is ours.
    marker = caption(99, final=True, stream="marker")
    first.put(marker)
    assert await asyncio.wait_for(first.get(), RECV_TIMEOUT_S) is marker


@integration
async def test_subscriber_of_one_key_gets_nothing_of_another(
    hub: CaptionHub, bus: RedisBus
) -> None:
    hall, foyer = ClientQueue(), ClientQueue()
    await hub.subscribe(captions_key("hall", "en"), hall)
    await hub.subscribe(captions_key("foyer", "en"), foyer)

    await bus.publish_caption(caption(1, final=True, stream="foyer"))
    await bus.publish_caption(caption(1, final=True, stream="hall"))
    got = await asyncio.wait_for(hall.get(), RECV_TIMEOUT_S)
    assert (got.stream, got.seq) == ("hall", 1)
    assert (await asyncio.wait_for(foyer.get(), RECV_TIMEOUT_S)).stream == "foyer"


@integration
@pytest.mark.parametrize("fresh_key", [False, True], ids=["same-key", "new-key-each-time"])
async def test_caption_published_right_after_subscribe_returns_is_received(
    hub: CaptionHub, bus: RedisBus, fresh_key: bool
) -> None:
    # Repeated to catch a race between the SUBSCRIBE and its confirmation; on
    # one key this also goes through unsubscribe-then-resubscribe every round.
    for seq in range(1, 21):
        stream = f"room-{seq}" if fresh_key else "hall"
        key = captions_key(stream, "en")
        queue = ClientQueue()
        await asyncio.wait_for(hub.subscribe(key, queue), RECV_TIMEOUT_S)
        await bus.publish_caption(caption(seq, final=True, segment_id=seq, stream=stream))
        got = await asyncio.wait_for(queue.get(), RECV_TIMEOUT_S)
        assert (got.stream, got.seq) == (stream, seq)
        await hub.unsubscribe(key, queue)


@integration
async def test_concurrent_subscribes_to_many_keys_each_receive_their_own_caption(
    hub: CaptionHub, bus: RedisBus
) -> None:
    streams = [f"room-{i}" for i in range(20)]
    queues = {s: ClientQueue() for s in streams}
    await asyncio.wait_for(
        asyncio.gather(*(hub.subscribe(captions_key(s, "en"), q) for s, q in queues.items())),
        RECV_TIMEOUT_S,
    )
    for s in streams:
        await bus.publish_caption(caption(1, final=True, stream=s))
    for s, q in queues.items():
        assert (await asyncio.wait_for(q.get(), RECV_TIMEOUT_S)).stream == s


@integration
async def test_subscribe_racing_the_last_unsubscribe_of_its_key_still_receives(
    hub: CaptionHub, bus: RedisBus
) -> None:
    key = captions_key("hall", "en")
    leaving = ClientQueue()
    await hub.subscribe(key, leaving)
    for seq in range(1, 21):
        joining = ClientQueue()
        await asyncio.wait_for(
            asyncio.gather(hub.unsubscribe(key, leaving), hub.subscribe(key, joining)),
            RECV_TIMEOUT_S,
        )
        await bus.publish_caption(caption(seq, final=True, segment_id=seq))
        assert (await asyncio.wait_for(joining.get(), RECV_TIMEOUT_S)).seq == seq
        leaving = joining
