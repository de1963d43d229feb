"""A ring buffer of a stream's most recent audio, for warm rollovers."""

from __future__ import annotations

from collections import deque

from workers.events import SAMPLE_RATE, AudioChunk


class AudioRing:
    """Keeps the last `keep_s` seconds of contiguous audio as chunks."""

    def __init__(self, keep_s: float) -> None:
        self.keep = int(keep_s * SAMPLE_RATE)
        self._chunks: deque[AudioChunk] = deque()
        self._samples = 0

    def add(self, chunk: AudioChunk) -> None:
        self._chunks.append(chunk)
        self._samples += chunk.samples
        while self._chunks and self._samples - self._chunks[0].samples >= self.keep:
            self._samples -= self._chunks.popleft().samples

    def since(self, pos: int) -> list[AudioChunk]:
        """Chunks covering stream positions ≥ pos (the first one cut to start at pos)."""
        out: list[AudioChunk] = []
        for c in self._chunks:
            end = c.pos + c.samples
            if end <= pos:
                continue
            if c.pos < pos:
                cut = (pos - c.pos) * 2
                # The frames that completed in the cut part are unknown: none are
                # counted (at most one chunk's worth of voice activity, once).
                c = AudioChunk(c.stream, pos, c.pcm[cut:], c.wall,
                               None if c.speech is None else ())
            out.append(c)
        return out

    def replay(self, pos: int, chunk_s: float = 1.0) -> list[AudioChunk]:
        """`since(pos)` joined into chunks of up to `chunk_s`: a replacement re-reads up to
        the whole ring, which in 100 ms chunks would overflow a session's input queue
        (INPUT_QUEUE_MAX chunks, which drops the oldest)."""
        limit = int(chunk_s * SAMPLE_RATE)
        out: list[AudioChunk] = []
        for c in self.since(pos):
            last = out[-1] if out else None
            if (last is not None and last.samples + c.samples <= limit
                    and (last.speech is None) == (c.speech is None)):
                speech = None if c.speech is None else (last.speech or ()) + c.speech
                # Where the last completed frame ends: in `c` if one completed there.
                end = c.speech_end if c.speech or c.speech is None else (
                    last.speech_end if last.speech_end is not None
                    else last.pos + last.samples)
                out[-1] = AudioChunk(c.stream, last.pos, last.pcm + c.pcm, c.wall, speech,
                                     end)
            else:
                out.append(c)
        return out

    @property
    def start_pos(self) -> int | None:
        return self._chunks[0].pos if self._chunks else None

    def clear(self) -> None:
        self._chunks.clear()
        self._samples = 0
