"""Accuracy benchmark: the embedded engine's final-caption options, compared in one run.

    python -m bench.accuracy --json [--rounds 2] [--options utterance,agreement,...]

Plays a talk in real time (100 ms chunks, wall-clock pace) through the real embedded engine
(Whisper base, `--threads` CPU threads) behind the session manager, in-process, once per
option, one option at a time, in alternating order over `--rounds` rounds (round 1 in the
listed order, round 2 reversed, ...), so a slow minute of the shared machine does not land
on one option only. The talk is the reference set (the five LibriVox utterances the project
was tuned on) followed by held-out speech (`tests.speech.heldout_talks()`: recordings in
no file of this repository), 2 s of silence between them.

Per option (pooled over rounds), and per talk:
- `wer`: joined finals against the reference text (`tests.speech.normalize`);
- `engine_offline_wer`: the same model on the whole recording, not streamed (greedy;
  `engine_offline_wer_beam5` with beam 5), measured after the run;
- `final_latency_p50_s` / `_p95_s`: emission of a final minus the wall time at which the
  chunk holding the end of its last word was pushed (the sender's clock);
- `cpu_s_per_audio_s`: CPU seconds of this process (decode thread, Silero, event loop) per
  second of audio; `decode_busy_s_per_audio_s`: the decode thread alone.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.system import pct  # noqa: E402
from tests.speech import Talk, heldout_talks, normalize, reference_talk  # noqa: E402
from workers.captions.segmenter import Segmenter  # noqa: E402
from workers.engines.base import SessionOptions  # noqa: E402
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine  # noqa: E402
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
}


@dataclass
class Leg:
    option: str
    finals: list[tuple[float, float, float, str]] = field(default_factory=list)
    """(arrival wall, audio start s, audio end s, text)"""
    sent_ends: list[int] = field(default_factory=list)
    sent_walls: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    busy_s: float = 0.0
    revised: int = 0
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
                   language: str = "en", engine: EmbeddedWhisperEngine | None = None) -> Leg:
    """Play `pcm` through a session manager on `engine` (its own one, with `option`'s
    settings, when none is given)."""
    own = engine is None
    if engine is None:
        engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model=model, cpu_threads=threads,
                                                             **OPTIONS[option]))
        await engine.start()
    manager = SessionManager(engine, SessionOptions("bench", language), SessionPolicy())
    manager.start()
    leg = Leg(option)

    async def feed() -> None:
        t0 = time.time() + 0.2
        for i in range(0, len(pcm), CHUNK * 2):
            end = i // 2 + CHUNK
            await asyncio.sleep(max(0.0, t0 + end / SAMPLE_RATE - time.time()))
            leg.sent_ends.append(min(end, len(pcm) // 2))
            leg.sent_walls.append(time.time())
            await manager.push(AudioChunk("bench", i // 2, pcm[i : i + CHUNK * 2],
                                          time.time()))
        await manager.end_input()

    async def consume() -> None:
        seg = Segmenter("bench", "en")
        final_ids: set[int] = set()
        async for delta in manager:
            now = time.time()
            if delta.language:
                leg.languages[delta.language] = leg.languages.get(delta.language, 0) + 1
            for cap in seg.feed(delta):
                if cap.segment_id in final_ids:
                    leg.revised += 1
                if cap.is_final:
                    final_ids.add(cap.segment_id)
                    if cap.text:
                        leg.finals.append((now, cap.audio_start_s, cap.audio_end_s, cap.text))

    cpu0 = time.process_time()
    await asyncio.gather(feed(), consume())
    leg.cpu_s = time.process_time() - cpu0
    leg.busy_s = engine.stats()["decode_busy_s"]
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
    return float(jiwer.wer(normalize(talk.text), normalize(" ".join(s.text for s in segments))))


def summarize(legs: list[Leg], spans: list[tuple[Talk, float, float]],
              audio_s: float) -> dict[str, Any]:
    import jiwer

    out: dict[str, Any] = {}
    lat = [arrival - leg.sent_wall(end) for leg in legs for arrival, _, end, _ in leg.finals]
    per_talk: dict[str, Any] = {}
    for talk, start, end in spans:
        refs, hyps = [], []
        for leg in legs:
            texts = [text for _, a, _, text in leg.finals if start - 1.0 <= a < end + 1.0]
            refs.append(normalize(talk.text))
            hyps.append(normalize(" ".join(texts)))
        counts = jiwer.process_words(refs, hyps)
        per_talk[talk.name] = {
            "wer": round(float(counts.wer), 4),
            "wer_per_round": [round(float(jiwer.wer(r, h)), 4) for r, h in zip(refs, hyps,
                                                                                 strict=True)],
            "sub_del_ins": [counts.substitutions, counts.deletions, counts.insertions],
        }
    out["talks"] = per_talk
    out["final_latency_p50_s"] = pct(lat, 0.5)
    out["final_latency_p95_s"] = pct(lat, 0.95)
    out["final_latency_mean_s"] = round(statistics.fmean(lat), 3) if lat else None
    out["finals"] = len(lat)
    out["finals_revised"] = sum(leg.revised for leg in legs)
    out["cpu_s_per_audio_s"] = round(sum(leg.cpu_s for leg in legs) / (audio_s * len(legs)), 3)
    out["decode_busy_s_per_audio_s"] = round(
        sum(leg.busy_s for leg in legs) / (audio_s * len(legs)), 3)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    talks = [reference_talk(), *heldout_talks()] if not args.reference_only else [
        reference_talk()]
    pcm, spans = program(talks)
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    options = args.options.split(",")
    load_before = [round(x, 2) for x in os.getloadavg()]
    legs: dict[str, list[Leg]] = {o: [] for o in options}
    order: list[str] = []
    for r in range(args.rounds):
        for option in (options if r % 2 == 0 else list(reversed(options))):
            order.append(option)
            legs[option].append(await play_leg(option, pcm, args.threads, args.model))
    results = {o: summarize(legs[o], spans, audio_s) for o in options}
    offline = {t.name: {"engine_offline_wer": round(offline_wer(t, args.model, args.threads, 1),
                                                    4),
                        "engine_offline_wer_beam5": round(
                            offline_wer(t, args.model, args.threads, 5), 4),
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    unknown = set(args.options.split(",")) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options {sorted(unknown)}; choose from {sorted(OPTIONS)}")
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
