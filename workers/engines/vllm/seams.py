"""What a `VllmVoxtralSession` takes from its engine and from vLLM, as protocols.

The engine opens sessions, so it imports the session module; the session needs only these
few names back, not the engine class, and the two modules stay out of each other's way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import numpy as np

from workers.engines.vllm.options import StreamGeometry, VllmEngineOptions


class VllmBackend(Protocol):
    """What a session needs from vLLM (the real one wraps AsyncLLM; tests use a fake)."""

    @property
    def errored(self) -> bool: ...

    def prompts(self, audio: AsyncIterator[np.ndarray],
                tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]: ...

    def direct_prompts(self, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]: ...

    def generate(self, prompts: AsyncIterator[Any], request_id: str,
                 reanchor_every: int | None) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    async def reanchor_stats(self) -> dict[str, Any] | None: ...

    def shutdown(self) -> None: ...


class SessionHost(Protocol):
    """What a session needs from its engine (`VllmVoxtralEngine`): its backend, options and
    geometry, the re-anchor shift of a request, and the counters the session adds to."""

    overruns: int
    request_errors: int
    aborts: int

    @property
    def backend(self) -> VllmBackend: ...

    @property
    def options(self) -> VllmEngineOptions: ...

    @property
    def geometry(self) -> StreamGeometry: ...

    @property
    def reanchoring(self) -> bool: ...

    @property
    def direct_input(self) -> bool: ...

    @property
    def feed_grid(self) -> Any: ...

    def shifted(self, request_id: str) -> int: ...
