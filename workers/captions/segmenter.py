"""Turn an engine's transcript deltas into caption segments.

One open segment at a time. Committed words extend its stable text; the
engine's tentative words are shown after them (a partial). The segment closes
(a final, never revised again) at sentence punctuation in the committed words,
at the end of an utterance (a pause), or at a length cap. `seq` grows by one
with every publication on (stream, lang); `revision` counts publications of
one segment.

A final always has text and audio times inside the stream. An utterance that ends
with a partial on screen but no committed word (the session was replaced, failed or
ended before confirming it) is *withdrawn* (`CaptionSegment.withdrawn`): an empty
final with times 0/0 once overwrote visible text on overlays and read as a caption
with no audio to every consumer of finals (archive, translation, cursors).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from workers.captions.linebreak import WEB, LineProfile, break_lines
from workers.events import CaptionSegment, TranscriptDelta, Word

_SENTENCE_END = (".", "?", "!", "…", "。", "？", "！")
_CLOSERS = "\"')]»”’"


def ends_sentence(word: str) -> bool:
    w = word.strip().rstrip(_CLOSERS)
    # "Mr." and friends end with a dot but not a sentence.
    if w.lower() in {"mr.", "mrs.", "ms.", "dr.", "st.", "m.", "mme."}:
        return False
    return w.endswith(_SENTENCE_END)


def join_words(words: list[Word] | tuple[Word, ...]) -> str:
    return "".join(w.text for w in words).strip()


class Segmenter:
    def __init__(
        self,
        stream: str,
        lang: str,
        *,
        next_seq: int = 1,
        next_segment_id: int = 1,
        max_chars: int = 160,
        profile: LineProfile = WEB,
        wall_of: Callable[[float], float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stream = stream
        self.lang = lang
        self.next_seq = next_seq
        self.segment_id = next_segment_id
        self.max_chars = max_chars
        self.profile = profile
        self._wall_of = wall_of or (lambda _t: clock())
        self._clock = clock
        self._stable: list[Word] = []
        self._tentative: list[Word] = []
        self._revision = 0
        self._last_text: str | None = None
        self._last_span = (0.0, 0.0)  # audio times of the latest partial

    def resume(self, open_seg: CaptionSegment) -> None:
        """Go on with a caption a previous owner of the stream left open: its audio is
        decoded again, so the next publication replaces it (same segment id) and it is
        made final once."""
        self.segment_id = open_seg.segment_id
        self._revision = open_seg.revision
        self._last_text = open_seg.text
        self._last_span = (open_seg.audio_start_s, open_seg.audio_end_s)

    def close(self, open_seg: CaptionSegment) -> CaptionSegment:
        """Close, as it was shown, a caption a previous owner left open and whose audio
        will not be decoded again."""
        seg = replace(open_seg, seq=self.next_seq, revision=open_seg.revision + 1,
                      is_final=True, stable_prefix_len=len(open_seg.text),
                      emit_time=self._clock())
        self.next_seq += 1
        self.segment_id = open_seg.segment_id + 1
        return seg

    def feed(self, delta: TranscriptDelta) -> list[CaptionSegment]:
        out: list[CaptionSegment] = []
        for word in delta.committed:
            self._stable.append(word)
            text = join_words(self._stable)
            if ends_sentence(word.text) or len(text) >= self.max_chars:
                self._tentative = []
                out.append(self._publish(final=True))
        self._tentative = list(delta.tentative)
        if delta.end_of_utterance:
            self._tentative = []
            if join_words(self._stable):
                out.append(self._publish(final=True))
            elif self._last_text:
                # A partial was shown but the utterance produced no committed word:
                # take it off screen explicitly, so no stale text stays there.
                out.append(self._withdraw())
            else:
                self._stable = []  # only blank words: nothing to show or close
        elif self._stable or self._tentative:
            text = join_words(self._stable + self._tentative)
            if text and text != self._last_text:
                out.append(self._publish(final=False))
        if delta.skipped is not None:
            out.append(self._gap(*delta.skipped))
        return out

    def _gap(self, start_s: float, end_s: float) -> CaptionSegment:
        """A gap event for audio skipped: after whatever was open (closed by the same
        delta's end of utterance), under a segment id of its own."""
        seg = CaptionSegment(
            stream=self.stream, lang=self.lang, segment_id=self.segment_id,
            seq=self.next_seq, revision=1, is_final=False, text="", stable_prefix_len=0,
            lines=(), audio_start_s=start_s, audio_end_s=end_s,
            audio_end_wall=self._wall_of(end_s), emit_time=self._clock(),
            gap_s=round(end_s - start_s, 3))
        self.next_seq += 1
        self.segment_id += 1
        return seg

    def _withdraw(self) -> CaptionSegment:
        """The open partial, taken back: no text, the partial's audio times, and the
        segment closed (its id is not published again)."""
        self._revision += 1
        start_s, end_s = self._last_span
        seg = CaptionSegment(
            stream=self.stream, lang=self.lang, segment_id=self.segment_id,
            seq=self.next_seq, revision=self._revision, is_final=False, text="",
            stable_prefix_len=0, lines=(), audio_start_s=start_s, audio_end_s=end_s,
            audio_end_wall=self._wall_of(end_s) if end_s else self._clock(),
            emit_time=self._clock(), withdrawn=True,
        )
        self.next_seq += 1
        self.segment_id += 1
        self._stable = []
        self._revision = 0
        self._last_text = None
        self._last_span = (0.0, 0.0)
        return seg

    def _publish(self, *, final: bool) -> CaptionSegment:
        words = self._stable + ([] if final else self._tentative)
        assert words, "a caption has words: a partial with none is withdrawn instead"
        stable_text = join_words(self._stable)
        text = join_words(words)
        self._revision += 1
        # A word has a duration; a stamp of none (an engine's rounding) is widened to
        # 10 ms, so every caption spans audio inside the stream.
        end_s = max(words[-1].end_s, words[0].start_s + 0.01)
        seg = CaptionSegment(
            stream=self.stream,
            lang=self.lang,
            segment_id=self.segment_id,
            seq=self.next_seq,
            revision=self._revision,
            is_final=final,
            text=text,
            stable_prefix_len=len(stable_text) if not final else len(text),
            lines=break_lines(text, self.profile, self.lang),
            audio_start_s=words[0].start_s,
            audio_end_s=end_s,
            audio_end_wall=self._wall_of(end_s),
            emit_time=self._clock(),
        )
        self.next_seq += 1
        if final:
            self.segment_id += 1
            self._stable = []
            self._revision = 0
            self._last_text = None
            self._last_span = (0.0, 0.0)
        else:
            self._last_text = text
            self._last_span = (seg.audio_start_s, end_s)
        return seg
