"""Rollover benchmark: captions across warm rollovers and rut recovery, real speech.

    python -m bench.rollover --json [--minutes 3] [--budget 20] [--model whisper-base]

Runs the real embedded engine in-process behind the session manager, fed at
wall-clock pace:

1. the same ~3-minute talk (the five LibriVox utterances, repeated) through two
   streams at once: one with a session budget of `--budget` seconds (warm
   rollovers), one without; WER of each against the reference, and the words
   lost and doubled at the seams: each run's words are aligned to the reference word
   by word (bench.alignment), and the deletions and insertions whose reference words lie
   within `--seam-window` seconds of a switch are counted, minus the run without
   rollovers' count in the same windows (signed, unclamped);
2. a stream whose engine goes mute after 30 s of audio (fault injection): seconds
   from the first speech after the mute to the next caption (`rut_recovery_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jiwer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.alignment import TimedToken, seam_errors  # noqa: E402
from bench.report import emit  # noqa: E402
from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize  # noqa: E402
from workers.captions.segmenter import Segmenter  # noqa: E402
from workers.engines.base import SessionOptions, SpeechEngine  # noqa: E402
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine  # noqa: E402
from workers.engines.faults import MuteAfterEngine  # noqa: E402
from workers.events import SAMPLE_RATE, AudioChunk, Word  # noqa: E402
from workers.sessions.manager import SessionManager, SessionPolicy  # noqa: E402

CHUNK = SAMPLE_RATE // 10


def talk(minutes: float) -> tuple[bytes, str]:
    """The reference utterances repeated to about `minutes` of audio, and its text."""
    one = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    text = " ".join(" ".join((AUDIO / f"{n}.txt").read_text().split()) for n in REFERENCE_FILES)
    reps = max(1, round(minutes * 60 / (len(one) / 2 / SAMPLE_RATE)))
    return one * reps, " ".join([text] * reps)


@dataclass
class Run:
    manager: SessionManager
    words: list[tuple[float, Word]] = field(default_factory=list)  # (wall, word)
    finals: list[str] = field(default_factory=list)
    first_text_wall: list[float] = field(default_factory=list)


async def feed(run: Run, pcm: bytes, t0: float) -> None:
    for i in range(0, len(pcm), CHUNK * 2):
        target = t0 + (i // 2 + CHUNK) / SAMPLE_RATE
        await asyncio.sleep(max(0.0, target - time.time()))
        await run.manager.push(AudioChunk("bench", i // 2, pcm[i : i + CHUNK * 2], time.time()))
    await run.manager.end_input()


async def consume(run: Run) -> None:
    seg = Segmenter("bench", "en")
    async for delta in run.manager:
        now = time.time()
        for w in delta.committed:
            run.words.append((now, w))
        if delta.committed or delta.tentative:
            run.first_text_wall.append(now)
        run.finals.extend(c.text for c in seg.feed(delta) if c.is_final)


async def play(engine: SpeechEngine, policy: SessionPolicy, pcm: bytes, t0: float) -> Run:
    manager = SessionManager(engine, SessionOptions("bench", "en"), policy)
    manager.start()
    run = Run(manager)
    await asyncio.gather(feed(run, pcm, t0), consume(run))
    return run


def seam_doubles(run: Run) -> int:
    """Words repeated across a rollover seam (an n-gram right before T again right after)."""
    words = [w for _, w in run.words]
    doubled = 0
    for _reason, t in run.manager.rollover_log:
        before = [normalize(w.text) for w in words if t - 3 <= w.end_s <= t]
        after = [normalize(w.text) for w in words if t <= w.start_s <= t + 3]
        for n in range(min(3, len(before), len(after)), 0, -1):
            if before[-n:] == after[:n]:
                doubled += n
                break
    return doubled


def timed_tokens(run: Run) -> list[TimedToken]:
    """The run's committed words as normalised tokens, each at its word's middle."""
    return [TimedToken(tok, (w.start_s + w.end_s) / 2)
            for _, w in run.words for tok in normalize(w.text).split()]


def counts(ref: str, hyp: str) -> dict[str, int]:
    out = jiwer.process_words(ref, hyp)
    return {"ins": out.insertions, "del": out.deletions, "sub": out.substitutions,
            "hits": out.hits}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model=args.model,
                                                         cpu_threads=args.threads))
    await engine.start()
    pcm, text = talk(args.minutes)
    ref = normalize(text)
    t0 = time.time() + 0.5
    with_policy = SessionPolicy(budget_s=args.budget, margin_s=args.margin,
                                overlap_s=args.overlap)
    with_r, without = await asyncio.gather(
        play(engine, with_policy, pcm, t0), play(engine, SessionPolicy(), pcm, t0)
    )
    hyp_with = normalize(" ".join(with_r.finals))
    hyp_without = normalize(" ".join(without.finals))
    c_with, c_without = counts(ref, hyp_with), counts(ref, hyp_without)
    seams = seam_errors(ref.split(), timed_tokens(with_r), timed_tokens(without),
                        [t for _, t in with_r.manager.rollover_log], args.seam_window)

    # Rut: the engine goes mute after 30 s of a session's audio; the watchdog must roll over.
    mute_engine = MuteAfterEngine(engine, after_s=30.0)
    rut_pcm = pcm[: 75 * SAMPLE_RATE * 2]
    t1 = time.time() + 0.5
    rut = await play(mute_engine, SessionPolicy(), rut_pcm, t1)
    mute_pos = 30.0
    speech_after = _first_speech(rut_pcm, mute_pos)
    onset_wall = t1 + speech_after
    recovered = next((w for w in rut.first_text_wall if w > onset_wall), None)
    await engine.aclose()
    m = with_r.manager.counters
    return {
        "model": args.model,
        "audio_s": round(len(pcm) / 2 / SAMPLE_RATE, 1),
        "budget_s": args.budget,
        "margin_s": args.margin,
        "overlap_s": args.overlap,
        "rollovers": int(m["rollovers_budget"]),
        "forced_switches": int(m["forced_switches"]),
        "wer_with_rollover": round(float(jiwer.wer(ref, hyp_with)), 4),
        "wer_without": round(float(jiwer.wer(ref, hyp_without)), 4),
        **seams,
        "seam_window_s": args.seam_window,
        "seam_doubles": seam_doubles(with_r),
        "seam_words_deduped": int(m["seam_words_deduped"]),
        "rut_rollovers": int(rut.manager.counters["rollovers_rut"]),
        "rut_recoveries": int(rut.manager.counters["rut_recoveries"]),
        "rut_recovery_s": round(recovered - onset_wall, 2) if recovered else None,
        "mute_sessions_opened": mute_engine.sessions_opened,
        "counts_with": c_with,
        "counts_without": c_without,
    }


def _first_speech(pcm: bytes, at_s: float) -> float:
    """Stream time of the first speech frame at or after `at_s` (Silero)."""
    from workers.engines.vad import FRAME_SAMPLES, VoiceActivity

    flags = VoiceActivity().feed_pcm16(pcm)
    start = int(at_s * SAMPLE_RATE) // FRAME_SAMPLES
    for i in range(start, len(flags)):
        if flags[i]:
            return i * FRAME_SAMPLES / SAMPLE_RATE
    return at_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--margin", type=float, default=6.0,
                    help="seconds before the budget a warm rollover starts")
    ap.add_argument("--overlap", type=float, default=3.0,
                    help="seconds the new session re-reads")
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seam-window", type=float, default=3.0,
                    help="seconds either side of a switch where errors count as the seam's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
