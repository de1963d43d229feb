"""What the gateway's endpoints share: the event's streams, Redis, the caption hub, the
push streams' audio clocks, admission, and the counts `/v1/status` shows."""

from __future__ import annotations

import collections
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
