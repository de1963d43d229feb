"""From final captions to timed cues, the unit every file and sink output shares.

A final's text is cut into screens of its output's line profile (`pages`); the
final's audio span is shared among its screens in proportion to their length,
so a long sentence becomes several cues that follow the speech. Times are
stream audio seconds (the stream's audio clock starts at 0 with the event).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from workers.captions.linebreak import LineProfile, pages
from workers.events import CaptionSegment


def as_note(seg: CaptionSegment) -> CaptionSegment:
    """A gap event (audio skipped to catch up: `CaptionSegment.gap_s`) as the final an
    archive or a subtitle track shows where it happened; any other publication as it is."""
    if not seg.gap_s:
        return seg
    note = f"[{seg.gap_s:.0f} s not captioned]"
    return replace(seg, is_final=True, text=note, lines=(note,), stable_prefix_len=len(note))

# A final whose audio span is empty or negative (an engine that stamps no times) still
# gets a cue long enough to read; 1 s per screen is below any reading-speed norm but
# keeps the cue from overlapping the next sentence by much.
MIN_SCREEN_S = 1.0


@dataclass(frozen=True, slots=True)
class Cue:
    """One screen of one final: `lines` shown from `start_s` to `end_s` (audio time)."""

    seq: int
    segment_id: int
    page: int  # 1-based index of this screen within its final
    start_s: float
    end_s: float
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _lang_rules(lang: str) -> str:
    # "src" (auto-detected source language) has no rules of its own: English ones apply.
    return lang if len(lang.split("-")[0]) == 2 else "en"


def final_cues(seg: CaptionSegment, profile: LineProfile) -> list[Cue]:
    """The cues of a final caption; none for an empty text."""
    screens = pages(seg.text, profile, _lang_rules(seg.lang))
    if not screens:
        return []
    start = max(0.0, seg.audio_start_s)
    span = seg.audio_end_s - start
    if span <= 0:
        span = MIN_SCREEN_S * len(screens)
    weights = [sum(len(line) for line in screen) for screen in screens]
    total = sum(weights)
    cues: list[Cue] = []
    at = start
    for k, screen in enumerate(screens, start=1):
        end = start + span * sum(weights[:k]) / total if k < len(screens) else start + span
        cues.append(Cue(seq=seg.seq, segment_id=seg.segment_id, page=k, start_s=at,
                        end_s=end, lines=screen))
        at = end
    return cues


class FinalFilter:
    """Lets each segment's final through once, and nothing else.

    Translations may be published again for a segment (a re-claimed job); a
    final is never revised, so the first one wins. Caption with `error` set carry
    no text in the target language and are not shown by any output. The memory
    of segment ids is bounded: only recent segments can be repeated.
    """

    def __init__(self, remember: int = 4096) -> None:
        self._order: deque[int] = deque()
        self._seen: set[int] = set()
        self._remember = remember
        self.duplicates = 0
        self.errors = 0

    def seen(self, segment_id: int) -> bool:
        return segment_id in self._seen

    def mark(self, segment_id: int) -> None:
        if segment_id in self._seen:
            return
        self._seen.add(segment_id)
        self._order.append(segment_id)
        if len(self._order) > self._remember:
            self._seen.discard(self._order.popleft())

    def accept(self, seg: CaptionSegment) -> bool:
        if not seg.is_final:
            return False
        if seg.segment_id in self._seen:
            self.duplicates += 1
            return False
        self.mark(seg.segment_id)
        if seg.error is not None:
            self.errors += 1
            return False
        return bool(seg.text.strip())
