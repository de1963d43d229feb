"""The root of the event file: its sections, and the rules that span them."""

from __future__ import annotations

from typing import Any, Self

from pydantic import Field, model_validator

from orchestrator.config.base import Loc, _raise_at, _Strict
from orchestrator.config.engine import EngineConfig
from orchestrator.config.gateway import GatewayConfig
from orchestrator.config.services import RayConfig, RedisConfig
from orchestrator.config.streams import IngestConfig, StreamConfig
from orchestrator.config.translation import GlossaryEntry, TranslationConfig
from orchestrator.gateway.security_config import AuthConfig, auth_problems, origin_problems
from orchestrator.outputs.config import OutputsConfig, outputs_problems
from orchestrator.source_config import listen_port_problems
from translation.backends import concrete, no_backend_message


class EventConfig(_Strict):
    event: str = Field(description="event name, shown in the UI and logs")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="caption bus")
    ray: RayConfig = Field(default_factory=RayConfig, description="where actors run")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="ASR engine pool")
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="audio ingest pool")
    streams: list[StreamConfig] = Field(min_length=1, description="audio streams to caption")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway")
    auth: AuthConfig | None = Field(
        default=None,
        description="tokens for publishing, reading and administering; null: on a loopback "
                    "gateway, tokens made per run; elsewhere an error")
    translation: TranslationConfig = Field(default_factory=TranslationConfig,
                                           description="translator pool and backend routes")
    glossary: list[GlossaryEntry] = Field(
        default_factory=list, description="terms with forced translations or kept as is")
    outputs: OutputsConfig = Field(
        default_factory=OutputsConfig,
        description="caption outputs: archives, live HLS WebVTT, YouTube Live")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `redis:` with nothing under it is YAML null; treat it as "all defaults".
        sections = ("redis", "ray", "engine", "ingest", "gateway", "translation", "outputs")
        if isinstance(data, dict):
            data = {k: ({} if k in sections and v is None else v) for k, v in data.items()}
            # Validated (not defaulted) so that their relative folders (archives, the
            # local redis-server's append-only file) resolve against the event file, like
            # every other path in it, not against the folder babelcast was started from.
            data.setdefault("outputs", {})
            data.setdefault("redis", {})
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> Self:
        problems: list[tuple[Loc, str, object]] = []
        seen: dict[str, int] = {}
        for i, s in enumerate(self.streams):
            if s.id in seen:
                problems.append((("streams", i, "id"),
                                 f"duplicate stream id {s.id!r} (first used by streams"
                                 f"[{seen[s.id]}])", s.id))
            seen.setdefault(s.id, i)
            if (self.engine.kind == "embedded" and self.engine.model == "tiny.en"
                    and s.language != "en"):
                problems.append((("streams", i, "language"),
                                 f"model 'tiny.en' is English-only but language is "
                                 f"{s.language!r}; set language: en or engine.model: "
                                 "whisper-base", s.language))
            routes = self.translation.routing
            for j, target in enumerate(s.targets):
                kind = routes.kind_for(s.language, target)
                if concrete(kind, s.language, target) is None:
                    problems.append((("streams", i, "targets", j),
                                     no_backend_message(kind, s.language, target), target))
        n, e = len(self.streams), self.engine
        if (e.kind == "embedded" and "streams_per_actor" not in e.model_fields_set
                and n > e.actors * e.streams_per_actor):
            # The embedded default is what this host carries (measured here, or the
            # per-core estimate): a file must not be valid on one laptop and not on
            # another, or before and after a measurement. The budget fits the streams,
            # and the event says it is over (orchestrator/capacity.over_capacity).
            e._host_carries = e.streams_per_actor
            e.streams_per_actor = -(-n // e.actors)
            e.model_fields_set.discard("streams_per_actor")
        if n > e.actors * e.streams_per_actor:
            problems.append((("streams",), f"{n} streams configured but the engine pool fits "
                             f"{e.actors * e.streams_per_actor} (engine.actors {e.actors} × "
                             f"engine.streams_per_actor {e.streams_per_actor}); raise "
                             "engine.actors or engine.streams_per_actor", n))
        problems += [(("outputs", *loc), msg, v)
                     for loc, msg, v in outputs_problems(self.outputs, self.streams)]
        problems += auth_problems(self.auth, self.gateway.host, self.streams)
        problems += [(("gateway", "allowed_origins", *loc), msg, v)
                     for loc, msg, v in origin_problems(self.gateway.allowed_origins)]
        problems += listen_port_problems(self.streams)
        if self.ray.address is not None and self.redis.url is None:
            problems.append((("redis", "url"), "ray.address runs actors on other machines, "
                             "which cannot reach a redis-server started on this one (it "
                             "listens on 127.0.0.1): set redis.url to a Redis every node "
                             "reaches", None))
        _raise_at("EventConfig", problems)
        return self
