"""What the LLM backends share: batching into prompts, retries, and splitting a
batch whose answer does not line up into single-sentence prompts."""

from __future__ import annotations

import asyncio
from abc import abstractmethod

from translation.backends.base import BackendError, Result, TranslationRequest, Translator
from translation.backends.prompt import (
    PromptBatch,
    ReplyError,
    build_messages,
    parse_reply,
    plan_batches,
)
from translation.glossary import Glossary


class ChatTranslator(Translator):
    uses_context = True

    def __init__(self, *, batch_size: int = 16, max_retries: int = 2,
                 retry_backoff_s: float = 0.5, concurrency: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._slots = asyncio.Semaphore(concurrency)

    @abstractmethod
    async def _complete(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        """One chat completion: the assistant's text. Raise BackendError for answers
        that will not get better on retry, anything else for transient failures."""

    @staticmethod
    def _max_tokens(requests: list[TranslationRequest]) -> int:
        # Generous: a translation rarely has more than 2 tokens per source character
        # over 3 characters; JSON quoting adds a little per sentence.
        return 64 + sum(len(r.text) for r in requests)

    async def _ask(self, batch: PromptBatch, requests: list[TranslationRequest]) -> list[str]:
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            self.stats.calls += 1
            self.stats.prompt_chars += batch.chars
            try:
                async with self._slots:
                    content = await self._complete(list(batch.messages),
                                                   self._max_tokens(requests))
                return parse_reply(content, len(requests))
            except ReplyError as exc:
                last = exc
                if len(requests) > 1:
                    break  # a misaligned batch answer: try the sentences one by one
            except BackendError:
                raise  # refused for good: retrying would not help
            except Exception as exc:
                last = exc
        raise last if last is not None else BackendError("no answer")

    async def translate(self, requests: list[TranslationRequest],
                        glossary: Glossary) -> list[Result]:
        self._count(requests)
        results: list[Result] = [BackendError("not translated")] * len(requests)

        async def run(batch: PromptBatch) -> None:
            reqs = [requests[i] for i in batch.indices]
            try:
                outs: list[Result] = list(await self._ask(batch, reqs))
            except ReplyError:
                if len(reqs) == 1:
                    raise
                outs = []
                for r in reqs:
                    single = PromptBatch((0,), tuple(build_messages([r], glossary)))
                    try:
                        outs.extend(await self._ask(single, [r]))
                    except Exception as exc:
                        outs.append(exc)
            for i, out in zip(batch.indices, outs, strict=True):
                results[i] = out

        batches = plan_batches(requests, glossary, self.batch_size)
        done = await asyncio.gather(*(run(b) for b in batches), return_exceptions=True)
        for batch, outcome in zip(batches, done, strict=True):
            if isinstance(outcome, BaseException):
                for i in batch.indices:
                    results[i] = outcome
        self.stats.errors += sum(isinstance(r, BaseException) for r in results)
        return results
