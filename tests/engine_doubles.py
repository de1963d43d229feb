"""TEST DOUBLE base for speech engines whose sessions a test scripts itself."""

from __future__ import annotations

from workers.engines.base import EngineCapabilities, SpeechEngine


class IdleEngine(SpeechEngine):
    """Nothing to load or free; sessions unbounded (no rollovers), one language. A
    subclass says what its sessions do (`open_session`)."""

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(max_session_s=None, reanchors_natively=True,
                                  multilingual=False)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
