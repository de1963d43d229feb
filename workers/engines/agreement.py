"""LocalAgreement-2: commit the words on which two consecutive hypotheses agree.

Whisper is not a streaming model: it re-reads a rolling window and may change
its mind about the last words. A word is committed once two consecutive
hypotheses of the growing window agree on it (and on everything before it);
committed words are never taken back. At a pause the caller may `commit_all()`
the latest hypothesis, since no more audio will change it.

Times are absolute (stream audio seconds).
"""

from __future__ import annotations

import re

from workers.events import Word

DEDUPE_WINDOW_S = 1.0
"""Repeated words this close to the last committed word are the same words seen again."""

_NORM = re.compile(r"[^\w']+", re.UNICODE)


def norm(word: str) -> str:
    """Words are compared without case and punctuation ("be." == "Be")."""
    return _NORM.sub("", word).lower()


class LocalAgreement:
    def __init__(self, max_ngram: int = 5) -> None:
        self.max_ngram = max_ngram
        self.committed: list[Word] = []
        self._previous: list[Word] = []
        self._last_end = 0.0

    @property
    def last_committed_end(self) -> float:
        return self._last_end

    @property
    def tentative(self) -> list[Word]:
        return list(self._previous)

    def _fresh(self, hypothesis: list[Word]) -> list[Word]:
        """The part of `hypothesis` that lies after what is committed."""
        words = [w for w in hypothesis if w.start_s > self._last_end - 0.1 and norm(w.text)]
        # The window may start inside the last committed words: drop a repeated n-gram,
        # but only right at the boundary; a word said again after a pause is new speech.
        if words and self.committed and words[0].start_s - self._last_end < DEDUPE_WINDOW_S:
            tail = [norm(w.text) for w in self.committed[-self.max_ngram :]]
            for n in range(min(self.max_ngram, len(words), len(tail)), 0, -1):
                if tail[-n:] == [norm(w.text) for w in words[:n]]:
                    words = words[n:]
                    break
        return words

    def fresh(self, hypothesis: list[Word]) -> list[Word]:
        """The words of `hypothesis` after the committed ones (a repeat at the seam dropped)."""
        return self._fresh(hypothesis)

    def insert(self, hypothesis: list[Word]) -> list[Word]:
        """Add a hypothesis of the current window; return the newly committed words."""
        fresh = self._fresh(hypothesis)
        agreed: list[Word] = []
        for new, old in zip(fresh, self._previous, strict=False):
            if norm(new.text) != norm(old.text):
                break
            agreed.append(new)
        self._previous = fresh[len(agreed) :]
        self._commit(agreed)
        return agreed

    def commit_all(self, hypothesis: list[Word]) -> list[Word]:
        """Commit the whole hypothesis (the speaker paused: nothing will change it)."""
        fresh = self._fresh(hypothesis)
        self._previous = []
        self._commit(fresh)
        return fresh

    def commit(self, words: list[Word]) -> None:
        """Commit exactly these words (already fresh: the caller took them from `fresh()`)."""
        self._previous = []
        self._commit(words)

    def follow(self, other: LocalAgreement) -> None:
        """Start over right after what `other` committed (another pass decided those words)."""
        self.committed = list(other.committed[-self.max_ngram :])
        self._last_end = other.last_committed_end
        self._previous = []

    def clear_tentative(self) -> None:
        self._previous = []

    def _commit(self, words: list[Word]) -> None:
        if words:
            self.committed.extend(words)
            self._last_end = max(self._last_end, words[-1].end_s)
            # Only the tail is needed for n-gram matching.
            del self.committed[: -64]
