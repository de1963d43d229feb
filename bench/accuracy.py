"""Accuracy benchmark: the embedded engine's final-caption options, compared in one run.

    python -m bench.accuracy --json [--rounds 2] [--options utterance,agreement,...]
        [--speech reference,heldout,fr,es,it] [--pace realtime|lockstep]

Plays speech (100 ms chunks) through the real embedded engine (Whisper base, `--threads`
CPU threads), in-process, once per option and speech set, one at a time, in alternating
order over `--rounds` rounds (round 1 in the listed order, round 2 reversed, ...), so a slow
minute of the shared machine does not land on one option only. Speech sets (`--speech`):
`reference` (the five LibriVox utterances the project was tuned on), `heldout`
(`tests.speech.heldout_talks()`: English recordings in no file of this repository),
`fr` / `es` / `it` (`tests.speech.prompts_talk`, 45 s, played with that language declared).
The English sets are one program (2 s of silence before each talk), each other language
its own.

Pace (`--pace`):
- `realtime` (default): wall-clock pace, behind the session manager, as a stream runs;
- `lockstep`: each chunk is pushed once the engine session has decoded everything before
  it (no session manager: the session's own Silero), as on a host with unlimited CPU.
  WER and where finals fall then do not depend on how busy the machine is (other work on
  a shared host changes the timings, not the text); wall-clock latency is not measured.

Per option (pooled over rounds), and per talk:
- `wer`: joined finals against the reference text (`tests.speech.normalize`; other
  languages `normalize_any`);
- `engine_offline_wer`: the same model on the whole recording, not streamed (greedy;
  `engine_offline_wer_beam5` with beam 5), measured after the run;
- `final_latency_p50_s` / `_p95_s` (realtime): emission of a final minus the wall time at
  which the chunk holding the end of its last word was pushed (the sender's clock);
- `final_audio_lag_p50_s` / `_p95_s`: audio pushed when a final was emitted minus the end
  of its last word, in audio seconds: the latency the policy itself adds (pauses waited
  for, parts held back), without the decode time (in lockstep, the whole latency but CPU);
- `hyp_per_round`: the joined finals of each round, normalised as the WER reads them;
- `words_per_final`; `cpu_s_per_audio_s`: CPU seconds of this process (decode thread,
  Silero, event loop) per second of audio; `decode_busy_s_per_audio_s`: the decode thread
  alone; `final_beam_share`: final passes decoded with the beam (of all final passes).
Options (names → `EmbeddedEngineOptions`) are listed in OPTIONS.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.system import pct  # noqa: E402
from tests.speech import (  # noqa: E402
    Talk,
    heldout_talks,
    normalize,
    normalize_any,
    prompts_talk,
    reference_talk,
)
from workers.captions.segmenter import Segmenter  # noqa: E402
from workers.engines.base import RecognizeSession, SessionOptions  # noqa: E402
from workers.engines.embedded import (  # noqa: E402
    EmbeddedEngineOptions,
    EmbeddedWhisperEngine,
    EmbeddedWhisperSession,
)
from workers.events import SAMPLE_RATE, AudioChunk  # noqa: E402
from workers.sessions.manager import SessionManager, SessionPolicy  # noqa: E402

CHUNK = SAMPLE_RATE // 10
GAP_S = 2.0

OPTIONS: dict[str, dict[str, Any]] = {
    # What shipped before issue 15: LocalAgreement-2 commits finals.
    "agreement": {"final_pass": "agreement"},
    # Agreement that never commits a word ending within 1 s of the window's end or with a
    # probability under 0.5 (word timestamps and probabilities at the edge).
    "agreement-edge": {"final_pass": "agreement", "edge_s": 1.0, "min_word_p": 0.5},
    # A whole-utterance decode at each pause is the final; agreement drives partials only.
    "utterance": {"final_pass": "utterance"},
    "utterance-beam5": {"final_pass": "utterance", "final_beam_size": 5},
    # The final pass on the interims' 10 s encoder input instead of Whisper's 30 s.
    "utterance-10s": {"final_pass": "utterance", "final_encode_s": 10.0},
    # Issue 37's levers, each alone, then together.
    # The final pass prompted with the words committed before it (as Whisper's long-form
    # decoding and WhisperLive condition on the previous text): about one final's worth,
    # and three.
    "prompt": {"final_prompt_words": 20},
    "prompt-60": {"final_prompt_words": 60},
    # The final pass also reads the 5 s of (already final) audio before the utterance.
    "context": {"final_context_s": 5.0},
    "context-prompt": {"final_context_s": 5.0, "final_prompt_words": 20},
    # A short pause ends an utterance only at a sentence end; else 1.5 s does.
    "sentences": {"unfinished_pause_s": 1.5},
    # A longer pause for every utterance (the blunt alternative to `sentences`).
    "pause-1.0": {"pause_s": 1.0},
    # Sentences inside running speech finalised once 0.5 s (not 1 s) behind the newest
    # audio: read speech with few 0.6 s pauses gets its finals from these parts.
    "part-0.5": {"part_edge_s": 0.5},
    # The same with part_on_time (on by default since 2026-12-04): 0.75 s (English's
    # default since 2026-12-05, so the same as `default` there), and 1.0 s (the default
    # for every language before, still for the others).
    "part-0.75": {"part_edge_s": 0.75},
    "part-1.0": {"part_edge_s": 1.0},
    # Beam 5 on the final pass while the decode thread was busy at most half the time
    # (in lock step it always is: measure this one in real time).
    "beam5-headroom": {"final_beam_size": 5, "final_beam_max_busy": 0.5},
    # The policy before 2026-12-04's two latency levers (both on by default since), and
    # each of them off alone.
    "before-levers": {"final_early_s": 0.0, "part_on_time": False},
    "pause-whole": {"final_early_s": 0.0},
    "part-at-step": {"part_on_time": False},
    # The final pass started 0.3 s (0.4 s) before the pause is whole, on the audio so far:
    # latency, not words (the same speech with less trailing silence); speech that comes
    # back before the pause is whole costs the decode (in lock step: its CPU).
    "early-0.3": {"final_early_s": 0.3},
    "early-0.4": {"final_early_s": 0.4},
    # A sentence end the interims showed is finalised once the audio is part_edge_s past
    # it, not at the next interim step (up to step_s later).
    "part-on-time": {"part_on_time": True},
    "part-on-time-early-0.3": {"part_on_time": True, "final_early_s": 0.3},
    "context-beam5": {"final_context_s": 5.0, "final_beam_size": 5},
    "context-pause-1.0-beam5": {"final_context_s": 5.0, "pause_s": 1.0, "final_beam_size": 5},
    "context-prompt-beam5": {"final_context_s": 5.0, "final_prompt_words": 20,
                             "final_beam_size": 5},
    "context-prompt-beam5-headroom": {"final_context_s": 5.0, "final_prompt_words": 20,
                                      "final_beam_size": 5, "final_beam_max_busy": 0.5},
}
SPEECH_SETS = ("reference", "heldout", "fr", "es", "it")
OTHER_LANGUAGE_S = 45.0


@dataclass
class Leg:
    option: str
    finals: list[tuple[float, float, float, str]] = field(default_factory=list)
    """(arrival wall, audio start s, audio end s, text)"""
    sent_ends: list[int] = field(default_factory=list)
    sent_walls: list[float] = field(default_factory=list)
    final_pushed: list[float] = field(default_factory=list)
    """Audio seconds pushed when each final (of `finals`) was emitted."""
    cpu_s: float = 0.0
    busy_s: float = 0.0
    final_beam_calls: int = 0
    final_greedy_calls: int = 0
    revised: int = 0
    program: str = "en"
    """The language of the speech set this leg played (one program per language)."""
    languages: dict[str, int] = field(default_factory=dict)
    """Deltas per language the engine reported (detected, for `language: auto`)."""

    def sent_wall(self, t_s: float) -> float:
        i = bisect.bisect_left(self.sent_ends, round(t_s * SAMPLE_RATE))
        return self.sent_walls[min(i, len(self.sent_walls) - 1)]


def program(talks: list[Talk]) -> tuple[bytes, list[tuple[Talk, float, float]]]:
    """The talks one after the other, with GAP_S of silence before each; and where each
    one lies in stream seconds."""
    pcm = b""
    spans = []
    gap = bytes(2 * int(GAP_S * SAMPLE_RATE))
    for t in talks:
        pcm += gap
        start = len(pcm) / 2 / SAMPLE_RATE
        pcm += t.pcm
        spans.append((t, start, len(pcm) / 2 / SAMPLE_RATE))
    return pcm + gap, spans


async def play_leg(option: str, pcm: bytes, threads: int, model: str, *,
                   language: str = "en", engine: EmbeddedWhisperEngine | None = None,
                   lockstep: bool = False) -> Leg:
    """Play `pcm` through a session manager on `engine` (its own one, with `option`'s
    settings, when none is given); `lockstep`: straight into an engine session, each
    chunk once the one before it is decoded."""
    own = engine is None
    if engine is None:
        engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model=model, cpu_threads=threads,
                                                             **OPTIONS[option]))
        await engine.start()
    before = engine.stats()
    session: RecognizeSession
    if lockstep:
        session = engine.open_session(SessionOptions("bench", language))
    else:
        session = SessionManager(engine, SessionOptions("bench", language), SessionPolicy())
        session.start()
    leg = Leg(option)

    async def feed() -> None:
        t0 = time.time() + 0.2
        for i in range(0, len(pcm), CHUNK * 2):
            end = i // 2 + CHUNK
            if lockstep:
                assert isinstance(session, EmbeddedWhisperSession)
                await session.decoded()
            else:
                await asyncio.sleep(max(0.0, t0 + end / SAMPLE_RATE - time.time()))
            leg.sent_ends.append(min(end, len(pcm) // 2))
            leg.sent_walls.append(time.time())
            await session.push(AudioChunk("bench", i // 2, pcm[i : i + CHUNK * 2],
                                          time.time()))
        await session.end_input()

    async def consume() -> None:
        seg = Segmenter("bench", "en")
        final_ids: set[int] = set()
        async for delta in session:
            now = time.time()
            pushed = (leg.sent_ends[-1] if leg.sent_ends else 0) / SAMPLE_RATE
            if delta.language:
                leg.languages[delta.language] = leg.languages.get(delta.language, 0) + 1
            for cap in seg.feed(delta):
                if cap.segment_id in final_ids:
                    leg.revised += 1
                if cap.is_final:
                    final_ids.add(cap.segment_id)
                    if cap.text:
                        leg.finals.append((now, cap.audio_start_s, cap.audio_end_s, cap.text))
                        leg.final_pushed.append(pushed)

    cpu0 = time.process_time()
    await asyncio.gather(feed(), consume())
    leg.cpu_s = time.process_time() - cpu0
    after = engine.stats()
    leg.busy_s = after["decode_busy_s"] - before["decode_busy_s"]
    leg.final_beam_calls = int(after["final_beam_calls"] - before["final_beam_calls"])
    leg.final_greedy_calls = int(after["final_greedy_calls"] - before["final_greedy_calls"])
    if lockstep:
        await session.aclose()
    if own:
        await engine.aclose()
    return leg


def offline_wer(talk: Talk, model: str, threads: int, beam: int) -> float:
    import jiwer
    import numpy as np

    from workers.engines.models import load_whisper

    whisper = load_whisper(model, cpu_threads=threads)
    audio = np.frombuffer(talk.pcm, dtype="<i2").astype(np.float32) / 32768.0
    segments, _ = whisper.transcribe(audio, language=talk.language, beam_size=beam,
                                     vad_filter=False, condition_on_previous_text=False)
    norm = normalizer(talk)
    return float(jiwer.wer(norm(talk.text), norm(" ".join(s.text for s in segments))))


def normalizer(talk: Talk) -> Callable[[str], str]:
    return normalize if talk.language == "en" else normalize_any


def summarize(legs: list[Leg], spans: list[tuple[Talk, float, float]],
              audio_s: float, *, lockstep: bool = False) -> dict[str, Any]:
    """Legs of one option (over rounds and speech sets; `spans` names each set's talks)."""
    import jiwer

    out: dict[str, Any] = {}
    lat = [arrival - leg.sent_wall(end) for leg in legs for arrival, _, end, _ in leg.finals]
    lag = [pushed - end for leg in legs
           for (_, _, end, _), pushed in zip(leg.finals, leg.final_pushed, strict=True)]
    words = [len(text.split()) for leg in legs for *_, text in leg.finals]
    per_talk: dict[str, Any] = {}
    for talk, start, end in spans:
        norm = normalizer(talk)
        refs, hyps = [], []
        for leg in legs:
            if leg.program != talk.language:
                continue
            texts = [text for _, a, _, text in leg.finals if start - 1.0 <= a < end + 1.0]
            refs.append(norm(talk.text))
            hyps.append(norm(" ".join(texts)))
        counts = jiwer.process_words(refs, hyps)
        per_talk[talk.name] = {
            "wer": round(float(counts.wer), 4),
            "wer_per_round": [round(float(jiwer.wer(r, h)), 4) for r, h in zip(refs, hyps,
                                                                                 strict=True)],
            "sub_del_ins": [counts.substitutions, counts.deletions, counts.insertions],
            # What was said, normalised: to audit a figure (a digit written for a spoken
            # number counts as an error) without running the bench again.
            "hyp_per_round": hyps,
        }
    out["talks"] = per_talk
    if not lockstep:
        out["final_latency_p50_s"] = pct(lat, 0.5)
        out["final_latency_p95_s"] = pct(lat, 0.95)
        out["final_latency_mean_s"] = round(statistics.fmean(lat), 3) if lat else None
    out["final_audio_lag_p50_s"] = pct(lag, 0.5)
    out["final_audio_lag_p95_s"] = pct(lag, 0.95)
    out["finals"] = len(lat)
    out["words_per_final"] = round(statistics.fmean(words), 1) if words else None
    out["finals_revised"] = sum(leg.revised for leg in legs)
    rounds = len(legs) / max(1, len({leg.program for leg in legs}))
    out["cpu_s_per_audio_s"] = round(sum(leg.cpu_s for leg in legs) / (audio_s * rounds), 3)
    out["decode_busy_s_per_audio_s"] = round(
        sum(leg.busy_s for leg in legs) / (audio_s * rounds), 3)
    beams = sum(leg.final_beam_calls for leg in legs)
    greedy = sum(leg.final_greedy_calls for leg in legs)
    out["final_beam_share"] = round(beams / (beams + greedy), 3) if beams + greedy else None
    return out


def _commit() -> str | None:
    """The code measured: the checkout's HEAD, '+' if it has changes (None outside git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "workers", "bench"],
                               cwd=ROOT, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty.strip() else "")


def programs(speech: list[str]) -> dict[str, list[Talk]]:
    """The talks to play, per language: English sets are one program."""
    out: dict[str, list[Talk]] = {}
    if "reference" in speech:
        out.setdefault("en", []).append(reference_talk())
    if "heldout" in speech:
        out.setdefault("en", []).extend(heldout_talks())
    for lang in speech:
        if lang not in ("reference", "heldout"):
            out[lang] = [prompts_talk(lang, OTHER_LANGUAGE_S)]
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    speech = args.speech.split(",")
    if args.reference_only:
        speech = ["reference"]
    played = {lang: program(talks) for lang, talks in programs(speech).items()}
    spans = [span for _, sp in played.values() for span in sp]
    audio_s = sum(len(pcm) / 2 / SAMPLE_RATE for pcm, _ in played.values())
    options = args.options.split(",")
    load_before = [round(x, 2) for x in os.getloadavg()]
    legs: dict[str, list[Leg]] = {o: [] for o in options}
    order: list[str] = []
    lockstep = args.pace == "lockstep"
    for r in range(args.rounds):
        for option in (options if r % 2 == 0 else list(reversed(options))):
            order.append(option)
            for lang, (pcm, _) in played.items():
                leg = await play_leg(option, pcm, args.threads, args.model, language=lang,
                                     lockstep=lockstep)
                leg.program = lang
                legs[option].append(leg)
    results = {o: summarize(legs[o], spans, audio_s, lockstep=lockstep) for o in options}
    offline = {t.name: {"engine_offline_wer": round(offline_wer(t, args.model, args.threads, 1),
                                                    4),
                        "engine_offline_wer_beam5": round(
                            offline_wer(t, args.model, args.threads, 5), 4),
                        "language": t.language,
                        "seconds": round(t.seconds, 1), "source": t.source}
               for t, _, _ in spans}
    for res in results.values():
        for name, talk in res["talks"].items():
            talk["wer_minus_offline"] = round(talk["wer"] - offline[name]["engine_offline_wer"],
                                              4)
    return {
        "model": args.model,
        "threads": args.threads,
        "rounds": args.rounds,
        "pace": args.pace,
        "commit": _commit(),
        "speech": speech,
        "order": order,
        "load_avg_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
        "audio_s_per_leg": round(audio_s, 1),
        "talks": offline,
        "options": {o: OPTIONS[o] for o in options},
        "results": results,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference-only", action="store_true",
                    help="only the reference set (no held-out speech)")
    ap.add_argument("--speech", default="reference,heldout",
                    help=f"speech sets, comma-separated, of {', '.join(SPEECH_SETS)}")
    ap.add_argument("--pace", default="realtime", choices=["realtime", "lockstep"],
                    help="realtime: wall-clock pace behind the session manager; lockstep: "
                         "each chunk once the last is decoded (WER without CPU contention)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    unknown = set(args.options.split(",")) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options {sorted(unknown)}; choose from {sorted(OPTIONS)}")
    bad = set(args.speech.split(",")) - set(SPEECH_SETS)
    if bad:
        ap.error(f"unknown speech sets {sorted(bad)}; choose from {list(SPEECH_SETS)}")
    if args.model == "tiny.en" and set(args.speech.split(",")) - {"reference", "heldout"}:
        ap.error("tiny.en is English-only")
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
