"""The source seam: something that yields PCM16 16 kHz mono audio for one stream.

A source yields `bytes` chunks of PCM16 LE mono 16 kHz, each a multiple of 2
bytes (normally ~100 ms). It paces itself: it never yields audio faster than
real time (a file is read at wall-clock pace; a live source is paced by its
sender). It raises `SourceError` when the source fails; the ingest host then
reconnects with backoff and records the gap. Returning normally means the
source ended for good (a file played once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator


class SourceError(RuntimeError):
    """A source failed. The message is for operators: it names what to check."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class AudioSource(ABC):
    """One stream's audio input. Constructed cheaply; opens on iteration."""

    url: str

    @abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """Yield PCM16 chunks until the source ends; raise SourceError on failure."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release anything the source holds (processes, sockets)."""
