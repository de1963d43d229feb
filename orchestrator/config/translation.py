"""The translator pool, its backends' settings and routes, and the glossary."""

from __future__ import annotations

import re
import typing
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from orchestrator.config.base import Loc, _check_lang, _fail, _raise_at, _Strict
from translation.backends import KINDS as TRANSLATION_KINDS
from translation.backends import Routes

BackendKind = Literal["embedded", "bergamot", "apertium", "openai-chat", "vllm"]
assert set(typing.get_args(BackendKind)) == set(TRANSLATION_KINDS)
_ROUTE_KEY = re.compile(r"^([a-z]{2}|\*)-([a-z]{2}|\*)$")


class OpenAIChatConfig(_Strict):
    url: str = Field(description="base URL of an OpenAI-compatible API, e.g. http://host:8000/v1")
    model: str = Field(description="model name the endpoint serves")
    api_key_env: str | None = Field(
        default=None, description="environment variable holding the API key (not the key)")
    timeout_s: float = Field(default=10.0, gt=0, description="per request")
    max_retries: int = Field(default=2, ge=0, description="retries of a failed request")
    batch_size: int = Field(default=16, ge=1, description="sentences per request")
    concurrency: int = Field(default=4, ge=1, description="requests in flight per translator")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise _fail(f"must start with http:// or https://; got {v!r}")
        return v


class VllmTranslationConfig(_Strict):
    model: str = Field(description="instruction-tuned chat model (folder or name)")
    max_model_len: int = Field(default=8192, ge=512, description="context length")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1,
                                          description="share of the GPU vLLM may take")
    batch_size: int = Field(default=16, ge=1, description="sentences per prompt")


class TranslationConfig(_Strict):
    """The translator pool: how many actors, and which backend translates which pair."""

    actors: int = Field(default=1, ge=1,
                        description="translation actors (job consumers). On the embedded "
                                    "engines each translates on one core: plan about 100 "
                                    "stream-target pairs per actor (validate and run warn "
                                    "past it; orchestrator/capacity.py says why)")
    default: BackendKind = Field(default="embedded",
                                 description="backend for pairs no route names")
    routes: dict[str, BackendKind] = Field(
        default_factory=dict,
        description='backend per pair: "en-pt", or "*-fr" / "en-*" for all sources/targets')
    context_sentences: int = Field(default=3, ge=0, le=10,
                                   description="previous sentences sent as context (LLMs)")
    partials_every_s: float | None = Field(
        default=None, gt=0,
        description="also translate the open sentence (non-final) at most this often; "
                    "null: finals only")
    batch_size: int = Field(default=32, ge=1, description="jobs a translator takes at once")
    timeout_s: float = Field(default=15.0, gt=0,
                             description="longest a backend may take for one batch")
    claim_idle_s: float = Field(
        default=10.0, gt=0,
        description="a job pending this long with a dead translator is taken over")
    openai: OpenAIChatConfig | None = Field(default=None,
                                            description="openai-chat backend settings")
    vllm: VllmTranslationConfig | None = Field(default=None,
                                               description="vllm backend settings")

    @field_validator("routes")
    @classmethod
    def _route_keys(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _ROUTE_KEY.match(k) or k == "*-*"]
        if bad:
            raise _fail(f"route keys look like 'en-pt', '*-pt' or 'en-*'; got {bad[0]!r} "
                        "(use translation.default for every pair)")
        return v

    @model_validator(mode="after")
    def _settings(self) -> Self:
        kinds = {self.default, *self.routes.values()}
        problems: list[tuple[Loc, str, object]] = []
        if "openai-chat" in kinds and self.openai is None:
            problems.append((("openai",), "backend openai-chat is routed but has no settings; "
                             "add translation.openai with url and model", None))
        if "vllm" in kinds and self.vllm is None:
            problems.append((("vllm",), "backend vllm is routed but has no settings; add "
                             "translation.vllm with model", None))
        _raise_at("TranslationConfig", problems)
        return self

    @property
    def routing(self) -> Routes:
        return Routes(default=self.default, pairs=dict(self.routes))


class GlossaryEntry(_Strict):
    term: str = Field(min_length=1, description="the term as spoken in the source")
    keep: bool = Field(default=False,
                       description="do not translate (in languages without a translation)")
    translations: dict[str, str] = Field(
        default_factory=dict, description="forced translation per target language code")
    case_sensitive: bool = Field(default=False, description="match the term's case exactly")

    @field_validator("translations", mode="before")
    @classmethod
    def _langs(cls, v: object) -> object:
        if isinstance(v, dict):
            for k in v:
                _check_lang(k, allow_auto=False)
        return v

    @model_validator(mode="after")
    def _something(self) -> Self:
        if not self.keep and not self.translations:
            raise _fail(f"glossary term {self.term!r} needs keep: true or translations")
        return self
