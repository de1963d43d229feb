"""One engine session of a managed stream (a generation) and what of its output is taken.

The session manager (`workers.sessions.manager`) runs one generation at a time, two
during a warm rollover. Each publishes only the words that start inside its window
(`accepted`: from where it took over, up to the switch point when it hands over), and
remembers the last of what it published (`took`), for the n-gram check at the seam.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from workers.aio import cancel_and_join
from workers.engines.agreement import norm
from workers.engines.base import RecognizeSession
from workers.events import TranscriptDelta, Word


@dataclass(eq=False)
class Generation:
    """One engine session and what of its output is taken."""

    n: int
    session: RecognizeSession
    reason: str
    start_pos: int
    budget_s: float | None = None
    fed: int = 0
    accept_from_s: float = 0.0
    accept_until_s: float | None = None
    last_end_s: float = 0.0
    last_start_s: float = 0.0
    last_words: list[str] = field(default_factory=list)
    held: list[TranscriptDelta] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    ended: bool = False

    def accepted(self, words: tuple[Word, ...]) -> tuple[Word, ...]:
        lo, hi = self.accept_from_s, self.accept_until_s
        return tuple(w for w in words if w.start_s >= lo - 1e-6 and (hi is None or w.start_s < hi))

    def took(self, committed: tuple[Word, ...]) -> None:
        """Remember the end of what was published of it (at least one word)."""
        self.last_end_s = max(self.last_end_s, committed[-1].end_s)
        self.last_start_s = max(self.last_start_s, committed[-1].start_s)
        self.last_words = ([*self.last_words, *(norm(w.text) for w in committed)])[-8:]

    async def pump(
        self, out: asyncio.Queue[tuple[Generation, TranscriptDelta | BaseException | None]],
    ) -> None:
        """The session's output into `out`, then None when it ends (or what it raised)."""
        try:
            async for delta in self.session:
                await out.put((self, delta))
            await out.put((self, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await out.put((self, exc))

    async def close(self) -> None:
        self.ended = True
        if self.task is not None:
            # Not cancel + `await` under suppress(CancelledError): that swallows a cancel
            # of the manager arriving meanwhile, and the manager went on ticking.
            await cancel_and_join(self.task)
        await self.session.aclose()


class Seam:
    """Where one generation took over from another: the old one's last words, so that the
    new one's first committed words do not repeat them (an n-gram check, up to 4 words)."""

    def __init__(self) -> None:
        self._gen = -1  # the generation whose first committed words are checked
        self._tail: list[str] = []
        self._end_s = 0.0

    def start(self, old: Generation, new: Generation) -> None:
        self._tail = list(old.last_words)
        self._end_s = old.last_end_s
        self._gen = new.n

    def cross(self, gen: Generation, committed: tuple[Word, ...],
              ) -> tuple[tuple[Word, ...], int]:
        """`gen`'s committed words less the leading ones that repeat the old generation's
        last words, and how many those were. The seam is crossed once real words follow it."""
        if gen.n != self._gen or not committed:
            return committed, 0
        self._gen = -1
        prev = self._tail
        if not prev or committed[0].start_s - self._end_s > 1.0:
            return committed, 0
        first = [norm(w.text) for w in committed]
        for n in range(min(len(prev), len(first), 4), 0, -1):
            if prev[-n:] == first[:n]:
                return committed[n:], n
        return committed, 0
