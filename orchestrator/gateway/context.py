"""What the gateway's endpoints share: the event's streams, Redis, the caption hub, the
push streams' audio clocks, admission, and the counts `/v1/status` shows."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from orchestrator.gateway.access import Access
from orchestrator.gateway.hub import CaptionHub
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.outputs.hls import HlsOptions, HlsService
from workers.bus import RedisBus
from workers.events import StreamOptions
from workers.ingest import AudioClock


async def cancel_all(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again those that carry on.
    On Python 3.11 `asyncio.wait_for` (under redis-py's reads) drops a cancellation that
    arrives as the awaited result does (CPython gh-86296): a caption client that closed
    during its replay read left its pump waiting for captions for good, and with it the
    handler, the client gauge, its caps and its hub subscription (half of 30 clients that
    closed right after connecting stayed counted). Every socket task of the gateway that
    may sit in a Redis read is ended through here."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # as before: the clean-up runs
            await asyncio.wait(pending, timeout=0.5)
        pending = {t for t in pending if not t.done()}
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: the caller reported what mattered


@dataclass(frozen=True, slots=True)
class GatewayStream:
    options: StreamOptions
    source_kind: str


class GatewayContext:
    def __init__(self, streams: list[GatewayStream], access: Access,
                 engine_profiles: tuple[str, ...]) -> None:
        self.by_id = {s.options.stream_id: s for s in streams}
        self.push_ids = [s.options.stream_id for s in streams if s.source_kind == "push"]
        self.access = access
        self.limits: LimitsConfig = access.security.limits
        self.engine_profiles = engine_profiles
        self.clients: collections.Counter[tuple[str, str]] = collections.Counter()
        self.clocks: dict[str, AudioClock] = {}
        self._redis: Redis | None = None
        self._bus: RedisBus | None = None
        self._hub: CaptionHub | None = None
        self.hls: HlsService | None = None
        self._removed: dict[str, asyncio.Event] = {}

    def bind(self, redis: Redis, hub: CaptionHub, hls: HlsOptions) -> None:
        self._redis, self._bus, self._hub = redis, RedisBus(redis), hub
        self.hls = HlsService(self._bus, hls)

    @property
    def redis(self) -> Any:
        assert self._redis is not None, "the gateway's lifespan has not started"
        return self._redis

    @property
    def bus(self) -> RedisBus:
        assert self._bus is not None, "the gateway's lifespan has not started"
        return self._bus

    @property
    def hub(self) -> CaptionHub:
        assert self._hub is not None, "the gateway's lifespan has not started"
        return self._hub

    def remove_streams(self, stream_ids: list[str]) -> None:
        """Streams a hot apply removed: no new sockets find them, and the open ones hear
        it (`until_removed`)."""
        for sid in stream_ids:
            self.by_id.pop(sid, None)
            event = self._removed.pop(sid, None)
            if event is not None:
                event.set()

    def removal(self, stream_id: str) -> asyncio.Event:
        """Set when a hot apply removes the stream (a stream added again gets a new one);
        already set for a stream removed before the socket asked (admitted meanwhile)."""
        if stream_id not in self.by_id:
            gone = asyncio.Event()
            gone.set()
            return gone
        return self._removed.setdefault(stream_id, asyncio.Event())

    async def until_removed(self, stream_id: str, work: Coroutine[Any, Any, None]) -> bool:
        """Run a socket's `work` until it ends (False) or the stream is removed from the
        event (True: the work is cancelled, and the caller closes the socket)."""
        task = asyncio.create_task(work)
        waiter = asyncio.create_task(self.removal(stream_id).wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return False
            return True
        finally:  # the work too, when the stream went or the socket's handler is cancelled
            await cancel_all({task, waiter})

    def languages(self, gs: GatewayStream) -> list[str]:
        return [gs.options.caption_lang, *gs.options.targets]

    def clock_for(self, stream_id: str) -> AudioClock:
        return self.clocks[stream_id]

    async def ensure_clock(self, stream_id: str) -> AudioClock:
        """The stream's clock for a new publisher. Read from Redis when this process has
        none, or when the stream's audio went past this process's clock: the publisher
        pushed through another gateway worker (or machine) meanwhile."""
        pos, wall = await self.bus.last_audio_end(stream_id)
        clock = self.clocks.get(stream_id)
        if clock is None or pos > clock.pos:
            clock = self.clocks[stream_id] = AudioClock(stream_id, pos, last_wall=wall,
                                                        reason="push-reconnected")
        return clock

    def accepts(self, model: str) -> bool:
        return len(self.engine_profiles) <= 1 or model in self.engine_profiles
