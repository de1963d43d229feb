"""Other languages: Whisper base streamed on real speech in French, Spanish and Italian.

    python -m bench.languages --json [--languages fr,es,it] [--seconds 45]

For each language, held-out human speech (`tests.speech.prompts_talk`: Debian's Asterisk
prompt recordings, one speaker per language, with their text) is played in real time
through the embedded engine (multilingual Whisper base, the default final pass) behind
the session manager, twice at once on one engine, as two streams of one ASR actor: one
stream declares the language, the other says `language: auto`. Per stream:

- `wer`: joined finals against the text, both normalised by `tests.speech.normalize_any`
  (lower case, accents folded, punctuation removed);
- `engine_offline_wer`: the same model on the whole recording with the language given
  (greedy), not streamed;
- `detected`: for `auto`, the languages the engine reported, with how many updates each;
- `final_latency_p50_s`: as in bench.accuracy (the sender's clock).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.accuracy import Leg, play_leg  # noqa: E402
from bench.report import emit  # noqa: E402
from bench.system import pct  # noqa: E402
from tests.speech import Talk, normalize_any, prompts_talk  # noqa: E402
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine  # noqa: E402
from workers.events import SAMPLE_RATE  # noqa: E402


def offline_wer(talk: Talk, threads: int) -> float:
    import jiwer
    import numpy as np

    from workers.engines.models import load_whisper

    whisper = load_whisper("whisper-base", cpu_threads=threads)
    audio = np.frombuffer(talk.pcm, dtype="<i2").astype(np.float32) / 32768.0
    segments, _ = whisper.transcribe(audio, language=talk.language, beam_size=1,
                                     vad_filter=False, condition_on_previous_text=False)
    return float(jiwer.wer(normalize_any(talk.text),
                           normalize_any(" ".join(s.text for s in segments))))


def summary(leg: Leg, talk: Talk) -> dict[str, Any]:
    import jiwer

    hyp = normalize_any(" ".join(text for *_, text in leg.finals))
    lat = [arrival - leg.sent_wall(end) for arrival, _, end, _ in leg.finals]
    return {"wer": round(float(jiwer.wer(normalize_any(talk.text), hyp)), 4),
            "finals": len(leg.finals), "final_latency_p50_s": pct(lat, 0.5),
            "detected": leg.languages}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(cpu_threads=args.threads))
    await engine.start()
    out: dict[str, Any] = {"model": "whisper-base", "threads": args.threads,
                           "load_avg_before": [round(x, 2) for x in os.getloadavg()],
                           "languages": {}}
    talks = [prompts_talk(lang, args.seconds) for lang in args.languages.split(",")]
    for talk in talks:
        gap = bytes(2 * SAMPLE_RATE)
        pcm = gap + talk.pcm + gap
        declared, auto = await asyncio.gather(
            play_leg("default", pcm, args.threads, "whisper-base", language=talk.language,
                     engine=engine),
            play_leg("default", pcm, args.threads, "whisper-base", language="auto",
                     engine=engine))
        out["languages"][talk.language] = {
            "talk": {"name": talk.name, "seconds": round(talk.seconds, 1),
                     "source": talk.source},
            "declared": summary(declared, talk),
            "auto": summary(auto, talk),
        }
    await engine.aclose()
    for talk in talks:
        out["languages"][talk.language]["engine_offline_wer"] = round(
            offline_wer(talk, args.threads), 4)
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--languages", default="fr,es,it")
    ap.add_argument("--seconds", type=float, default=45.0, help="speech per language")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
