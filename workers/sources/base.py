"""The source seam: something that yields PCM16 16 kHz mono audio for one stream.

A source yields `bytes` chunks of PCM16 LE mono 16 kHz, each a multiple of 2
bytes (normally ~100 ms), and between them, `SourceEvent`s: what a listener or
an HLS reader knows that audio cannot say (the encoder left, segments were
skipped, a sender was refused). It paces itself: it never yields audio faster
than real time (a file is read at wall-clock pace; a live source is paced by
its sender). It raises `SourceError` when the source fails; the ingest host then
reconnects with backoff and records the gap. Returning normally means the
source ended for good (a file played once, an HLS playlist's `#EXT-X-ENDLIST`).

The ingest host makes one source object per stream and calls `chunks()` again
after a failure, so a source may keep what it learned across attempts (the
HLS reader's media sequence, so a segment is never read twice).

A source that can be opened again where it stopped (a file) says so with
`resumable`: the ingest host records `position()` in Redis after every entry it
writes, and a restarted ingest actor calls `resume_at()` before `chunks()`, so
no audio is heard twice. A live source is heard from its current position
whenever it is opened (the host's audio clock records the hole).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["idle", "gap", "refused"]


@dataclass(frozen=True, slots=True)
class SourceEvent:
    """Not audio: something the source knows about its audio.

    - `idle`: the source is up and nobody sends (a listener waits for its encoder;
      an HLS playlist stopped advancing). The audio that follows comes after a hole.
    - `gap`: the audio that follows is not contiguous with the audio before
      (HLS segments that were gone before they could be read, a restarted playlist).
    - `refused`: a sender was turned away (a wrong stream key); nothing it sent is used.

    `reason` is a short fixed word (a metric label: `rtmp-disconnect`, `hls-skipped`,
    ...); `detail` is for operators and never holds a secret.
    """

    kind: EventKind
    reason: str
    detail: str = ""


SourceItem = bytes | SourceEvent


class SourceError(RuntimeError):
    """A source failed. The message is for operators: it names what to check."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class AudioSource(ABC):
    """One stream's audio input. Constructed cheaply; opens on iteration."""

    url: str
    gap_reasons: tuple[str, ...] = ()
    """Every `reason` its `idle` and `gap` events may carry (metric series made at zero)."""

    @abstractmethod
    def chunks(self) -> AsyncIterator[SourceItem]:
        """Yield PCM16 chunks (and events) until the source ends; raise SourceError on failure."""

    resumable: bool = False
    """Whether `position()` / `resume_at()` work (a file); False for live sources."""

    def position(self) -> int:
        """Samples into the source at the end of the audio yielded last (resumable
        sources only): where `resume_at` would go on."""
        raise NotImplementedError(f"{type(self).__name__} is a live source")

    def resume_at(self, samples: int) -> None:
        """Make the next `chunks()` start `samples` into the source (resumable only)."""
        raise NotImplementedError(f"{type(self).__name__} is a live source")

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release anything the source holds (processes, sockets)."""
