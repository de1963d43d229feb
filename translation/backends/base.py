"""The translator seam: what a backend is given and what it returns.

A backend translates a batch of requests, possibly of several language pairs and
streams, and returns one result per request in order: the translated text, or the
exception that made that one request fail (one bad request never fails the others).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field

from translation.glossary import Glossary


class BackendError(RuntimeError):
    """A backend could not translate a request (after its own retries)."""


class BackendInterrupted(BackendError):
    """The backend's process was killed by a signal while it translated: its host is going
    down (Ray kills an actor's children before the actor itself) or the kernel's OOM
    killer chose it. Not the request's fault: the host tries the job again instead of
    publishing it as failed (translation/host.py, `MAX_INTERRUPTS`)."""


class BackendTimeout(BackendError):
    """A backend took longer than its bound: a load problem, not a broken backend. Its own
    type so that a published error (`"{backend}: BackendTimeout"`) tells the two apart."""


@dataclass(frozen=True, slots=True)
class TranslationRequest:
    text: str
    source: str
    """ISO-639-1 code, or "auto" (LLM backends only)."""
    target: str
    context: tuple[str, ...] = ()
    """Previous sentences of the same stream, oldest first (for backends that use it)."""


Result = str | BaseException


@dataclass
class BackendStats:
    requests: int = 0
    chars_in: int = 0
    """Characters of sentences handed to the backend (what a metered API bills as text)."""
    prompt_chars: int = 0
    """Characters actually sent, prompts and context included (LLM backends)."""
    errors: int = 0
    glossary_misses: int = 0
    calls: int = 0
    by_target: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_fields(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {
            f"{prefix}_requests": self.requests, f"{prefix}_chars_in": self.chars_in,
            f"{prefix}_prompt_chars": self.prompt_chars, f"{prefix}_errors": self.errors,
            f"{prefix}_glossary_misses": self.glossary_misses, f"{prefix}_calls": self.calls,
        }
        for lang, n in self.by_target.items():
            out[f"{prefix}_chars_in_{lang}"] = n
        return out


class Translator(ABC):
    """One translation backend. `start` loads models or opens clients; `translate`
    may be called concurrently only by one host (hosts call it batch by batch)."""

    name: str = "translator"
    uses_context: bool = False

    def __init__(self) -> None:
        self.stats = BackendStats()

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    @abstractmethod
    async def translate(self, requests: list[TranslationRequest],
                        glossary: Glossary) -> list[Result]: ...

    def _count(self, requests: list[TranslationRequest]) -> None:
        self.stats.requests += len(requests)
        for r in requests:
            self.stats.chars_in += len(r.text)
            self.stats.by_target[r.target] += len(r.text)


class SentenceEngine(Translator):
    """A backend that translates bare sentences of fixed pairs (no context, no prompt).

    Groups a batch by pair, protects glossary terms with placeholders, and calls
    `_translate_pair` once per pair; if a whole pair fails, each of its sentences is
    tried alone so one unlucky sentence cannot take the others with it.
    """

    @abstractmethod
    async def _translate_pair(self, texts: list[str], source: str,
                              target: str) -> list[str]: ...

    async def translate(self, requests: list[TranslationRequest],
                        glossary: Glossary) -> list[Result]:
        self._count(requests)
        results: list[Result] = [BackendError("not translated")] * len(requests)
        by_pair: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            by_pair[(r.source, r.target)].append(i)

        async def one_pair(pair: tuple[str, str], idx: list[int]) -> None:
            source, target = pair
            protected = [glossary.protect(requests[i].text, target) for i in idx]
            texts = [p.text for p in protected]
            self.stats.prompt_chars += sum(len(t) for t in texts)
            try:
                self.stats.calls += 1
                outs: list[Result] = list(await self._translate_pair(texts, source, target))
            except Exception as exc:
                if len(texts) == 1 or isinstance(exc, BackendInterrupted):
                    # An interrupted pair is nobody's sentence's fault: no one-by-one retry.
                    outs = [exc] * len(texts)
                else:
                    outs = []
                    for t in texts:
                        try:
                            self.stats.calls += 1
                            outs.extend(await self._translate_pair([t], source, target))
                        except Exception as one_exc:
                            outs.append(one_exc)
            for i, p, out in zip(idx, protected, outs, strict=True):
                if isinstance(out, BaseException):
                    self.stats.errors += 1
                    results[i] = out
                    continue
                text, missing = p.restore(out)
                self.stats.glossary_misses += missing
                results[i] = text

        await asyncio.gather(*(one_pair(p, idx) for p, idx in by_pair.items()))
        return results
