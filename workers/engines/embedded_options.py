"""The embedded engine's options (`EmbeddedEngineOptions`): what its sessions do with a
stream (`workers.engines.embedded_session` describes the policy they set) and what the
engine itself does at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinalPass = Literal["utterance", "agreement"]
FINAL_PASSES: tuple[FinalPass, ...] = ("utterance", "agreement")

PART_EDGE_S: dict[str, float] = {"en": 0.75}
"""`part_edge_s` where the event leaves it unset, per language. English at 0.75 s: on held-out
English its finals came 0.26-0.32 s sooner at the same WER in real time beside WhisperLive
(bench.peer, 2026-12-05, three runs: final p50 1.79 / 2.05 s in the last, the same 8.30 %);
on the reference talk, whose finals come at pauses, it changed neither; in lock step it
cost 1 error in 312 English words but 8 in 456 French, Spanish and Italian ones, so other
languages keep 1.0 s (bench/results/embedded_accuracy/lockstep_part075.json). It decodes
more: the host calibration (English speech, lock step) read 0.34-0.37 s of decode per audio
s against 0.29-0.31 s at 1.0 s, four runs each on the 2-core development host, which put
that host's figure at the edge between 1 and 2 streams per actor (two streams held final
p50 1.39 s and no stalls, bench/results/embedded_accuracy/e2e_two_streams_english_edge.json)."""
PART_EDGE_DEFAULT_S = 1.0
"""`part_edge_s` for a language not in `PART_EDGE_S`, and while `auto` has not detected one."""


def part_edge_for(part_edge_s: float | None, language: str | None) -> float:
    """The `part_edge_s` a session uses: the option where it is set, else its language's."""
    if part_edge_s is not None:
        return part_edge_s
    return PART_EDGE_S.get(language or "", PART_EDGE_DEFAULT_S)


@dataclass(frozen=True, slots=True)
class EmbeddedEngineOptions:
    model: str = "whisper-base"
    cpu_threads: int = 2
    beam_size: int = 1
    final_beam_size: int = 1
    step_s: float = 1.0
    pause_s: float = 0.6
    max_window_s: float = 10.0
    lead_in_s: float = 0.3
    final_pass: FinalPass = "utterance"
    max_utterance_s: float = 20.0
    part_edge_s: float | None = None
    """Utterance mode: a sentence end the interims show inside running speech is final
    once the audio is this many seconds past it. None: per language (`part_edge_for`),
    0.75 s for English, 1.0 s otherwise."""
    part_on_time: bool = True
    """Utterance mode: when an interim shows a sentence end less than `part_edge_s` before
    the newest audio, the next interim is decoded as soon as the audio is `part_edge_s`
    past it, not at its step (up to `step_s` later), and finalises the part then if it
    still shows the sentence end."""
    edge_s: float = 0.0
    min_word_p: float = 0.0
    final_encode_s: float = 30.0
    """Encoder input of the final pass, in seconds of audio (the utterance padded with
    silence): Whisper's own 30 s. Interims pad to 10 s (2.4x less CPU); for the final that
    shortcut cost words ('ill sposed' for 'ill disposed' from 4 of 5 start points of the
    same sentence on the reference set, 1 of 5 with 30 s, measured)."""
    final_prompt_words: int = 0
    """Utterance mode: the final pass is prompted with up to this many words the session
    committed before the audio it decodes (Whisper's `initial_prompt`, as its own long-form
    decoding conditions each window on the text before it). 0: no prompt."""
    final_context_s: float = 0.0
    """Utterance mode: the final pass also reads up to this many seconds of the audio
    before the utterance (already final); the words it finds there are dropped by their
    times and by the seam's n-gram check. 0: the utterance alone."""
    unfinished_pause_s: float | None = None
    """Utterance mode: a pause of `pause_s` ends an utterance only when its newest
    hypothesis ends a sentence; one that does not runs on until a pause this long (or a
    sentence end inside it is finalised as a part). None: every `pause_s` pause ends it."""
    final_early_s: float = 0.3
    """Utterance mode: the final pass starts this long before a pause reaches `pause_s`,
    on the audio up to that moment, and is committed when the pause completes with no
    speech in between (the utterance's words are all in what it read; the rest is
    silence). Speech before then drops it, and its decode was spent for nothing. No
    interim is decoded while it waits. 0: the final pass starts when the pause is whole.
    0.3 by default since 2026-12-04 (bench.e2e, 1 stream: final p50 1.55 / 1.29 s against
    1.74 / 1.62 s without, the same words; bench/results/embedded_accuracy/)."""
    final_beam_max_busy: float | None = None
    """The final pass uses `final_beam_size` only while the engine's decode thread was
    busy at most this fraction of the last `embedded.BUSY_WINDOW_S` (headroom, measured as it
    runs), else greedy. None: always `final_beam_size`."""
    calibrate: bool = False
    """At start, measure (or read from the host's cache) how many streams this engine
    keeps in real time here (`workers.engines.calibrate`); `describe()` reports it."""
