"""Live caption fan-out inside the gateway: one Redis pub/sub connection for all clients.

Each client gets a bounded queue. When a client reads too slowly its queue
fills; then interims are dropped (the next interim or final of the same
segment supersedes them anyway) and finals are always kept, so a slow overlay
may skip a flicker but never a sentence.

A publication is decoded once and its JSON text, as published, travels with it
to every client's queue: serializing it again for each client took a third of
the gateway's time (bench.delivery).

Finals are bounded too, in count: a client that holds `max_finals` of them unread is
so far behind that it is better served by closing (1013) and resuming with `since`,
which replays from the Redis Stream at its own pace, than by a queue in the gateway's
memory that grows for as long as it stays connected.

What a delivery costs, and what would lower it (measured on 2 shared cores, one process
pushing one ~400-byte text to 2,000 local WebSocket clients at 23,000 messages/s, server
CPU per message): this design, a queue and a pump task per client sending through
Starlette and uvicorn, 22 µs; the same text awaited straight from the publishing loop into
each socket, 12 µs (half the cost is waking one task per client); picows sending to each
client, 6.3 µs; one frame built once and its bytes written to every socket through picows,
6.3 µs too (framing per client costs nothing worth saving). The straight path needs to
know whether a socket's buffer is full, which uvicorn does not show through ASGI, so it
waits for a move off uvicorn for the caption sockets; until then `gateway.workers` spreads
the cost over cores.

When the pub/sub connection breaks (Redis restarted), redis-py reconnects and
subscribes again on the next read; whatever was published in between never reaches
the hub, so once the subscriptions are back every client queue is told to resync:
its connection reads the Stream after the last seq it sent, so nothing is missed
and nothing is sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from orchestrator import metrics
from workers.aio import wait_for
from workers.bus import caption_from_json
from workers.events import CaptionSegment

log = logging.getLogger(__name__)

CLIENT_QUEUE_MAX = 256
CLIENT_FINALS_MAX = 1_000
SUBSCRIBE_TIMEOUT_S = 10.0


class SlowClient(Exception):
    """The client left `max_finals` finals unread: close it; it resumes with `since`."""


class Resync(Exception):
    """The hub's pub/sub connection was re-established: read the Stream after the
    last seq sent before taking live messages again."""


class ClientQueue:
    def __init__(self, maxsize: int = CLIENT_QUEUE_MAX,
                 max_finals: int = CLIENT_FINALS_MAX) -> None:
        self.maxsize = maxsize
        self.max_finals = max_finals
        # (segment, its JSON text as published, when the hub has it)
        self._items: deque[tuple[CaptionSegment, str | None]] = deque()
        self._ready = asyncio.Event()
        self.dropped = 0
        self.overflowed = False
        self._resync = False

    def resync(self) -> None:
        self._resync = True
        self._ready.set()

    def put(self, seg: CaptionSegment, text: str | None = None) -> None:
        if self.overflowed:
            return
        if seg.is_final and len(self._items) >= self.max_finals:
            # Only finals can be left at this length (interims go first, below).
            self.overflowed = True
            self._items.clear()
            self._ready.set()
            return
        if len(self._items) >= self.maxsize:
            kept = deque(item for item in self._items if item[0].is_final)
            self.dropped += len(self._items) - len(kept)
            metrics.GATEWAY_SLOW_DROPS.inc(len(self._items) - len(kept))
            self._items = kept
            if not seg.is_final and len(self._items) >= self.maxsize:
                self.dropped += 1
                metrics.GATEWAY_SLOW_DROPS.inc()
                return
        self._items.append((seg, text))
        self._ready.set()

    async def get(self) -> CaptionSegment:
        return (await self.get_with_text())[0]

    async def get_with_text(self) -> tuple[CaptionSegment, str | None]:
        """The next publication; raises SlowClient or Resync (see their docs)."""
        while True:
            if self.overflowed:
                raise SlowClient
            if self._resync:
                self._resync = False
                raise Resync
            if self._items:
                return self._items.popleft()
            self._ready.clear()
            await self._ready.wait()


class CaptionHub:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pubsub: PubSub | None = None
        self._clients: dict[str, set[ClientQueue]] = {}
        self._confirmed: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._broken = False
        self.reconnects = 0
        self.last_seq_seen: dict[str, int] = {}
        """Newest seq delivered per key (orchestrator.epoch's floor after Redis empties)."""

    async def start(self) -> None:
        self._pubsub = self._redis.pubsub()
        # A pub/sub connection needs a subscription before it can be read from.
        await self._pubsub.subscribe("babelcast:hub")
        self._reader = asyncio.create_task(self._read(), name="caption-hub")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._pubsub is not None:
            await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2

    async def subscribe(self, key: str, queue: ClientQueue) -> None:
        """Returns once Redis has confirmed the subscription: anything published
        after this call reaches `queue`, so a replay read afterwards leaves no gap."""
        assert self._pubsub is not None
        try:
            async with self._lock:
                clients = self._clients.setdefault(key, set())
                clients.add(queue)
                event = self._confirmed.get(key)
                if event is None:
                    event = self._confirmed[key] = asyncio.Event()
                    await self._pubsub.subscribe(key)
            await wait_for(event.wait(), SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            # A subscribe that failed (Redis down) leaves nothing behind: a key whose
            # confirmation never came would make every later client of it wait in vain.
            await self._forget(key, queue)
            raise

    async def _forget(self, key: str, queue: ClientQueue) -> None:
        async with self._lock:
            clients = self._clients.get(key)
            if clients is not None:
                clients.discard(queue)
                if clients:
                    return
                del self._clients[key]
            event = self._confirmed.pop(key, None)
            if event is not None and self._pubsub is not None:
                with contextlib.suppress(Exception):
                    await self._pubsub.unsubscribe(key)

    async def unsubscribe(self, key: str, queue: ClientQueue) -> None:
        assert self._pubsub is not None
        async with self._lock:
            clients = self._clients.get(key)
            if clients is None:
                return
            clients.discard(queue)
            if not clients:
                del self._clients[key]
                self._confirmed.pop(key, None)
                with contextlib.suppress(Exception):  # Redis down: nothing to undo there
                    await self._pubsub.unsubscribe(key)

    async def _read(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                metrics.REDIS_ERRORS.labels(component="gateway").inc()
                if not self._broken:
                    log.warning("pub/sub read failed: %s", type(exc).__name__)
                self._broken = True
                await asyncio.sleep(0.5)
                continue
            if msg is None:
                continue
            channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg[
                "channel"]
            if self._broken:
                # redis-py subscribed everything again before this first reply, so from
                # here on nothing is missed: clients catch up from the Stream.
                self._broken = False
                self.reconnects += 1
                log.warning("pub/sub reconnected; %d clients resync from the Streams",
                            sum(len(c) for c in self._clients.values()))
                for queues in list(self._clients.values()):
                    for queue in list(queues):
                        queue.resync()
            if msg["type"] == "subscribe":
                event = self._confirmed.get(channel)
                if event is not None:
                    event.set()
                continue
            if msg["type"] != "message":
                continue
            try:
                data = msg["data"]
                text = data.decode() if isinstance(data, bytes) else data
                seg = caption_from_json(text)
            except (ValueError, TypeError, KeyError):
                metrics.UNDECODABLE.labels(component="gateway").inc()
                continue
            if seg.seq > self.last_seq_seen.get(channel, 0):
                self.last_seq_seen[channel] = seg.seq
            for queue in list(self._clients.get(channel, ())):
                queue.put(seg, text)
