"""Translation benchmark: real speech, real ASR, real embedded translators, end to end.

    python -m bench.translation --json [--repeats 6] [--plot FILE]

Starts `babelcast run` on a generated event of two rooms that each play the reference
LibriVox talk `--repeats` times (no loop, so the sources end and the queue drains):
room A translated into fr and pt, room B into es and pt, with the embedded backends
(Bergamot for pt, Apertium for es, and fr through es). Whisper runs on the same two
cores, as in the demo. Once both sources have ended and the translation queue is
empty, it reads what was published straight from Redis and reports:

- `jobs`: translation jobs enqueued (one per source final);
- `cost_ratio`: characters handed to translation backends ÷ characters of the final
  source captions, per target language (`cost_ratio_max` is the worst language). The
  numerator is counted by the translators, the denominator from the caption Streams, so
  a translator re-translating partials or repeating jobs would show here;
  `prompt_ratio` is the same with everything actually sent (LLM prompts and context;
  equal to cost_ratio for the sentence engines, which get no context);
- `lag_p50_s` / `lag_p95_s`: source final published → its translation published;
- `lost`: source finals (with text) without a final translation in a target language;
  `duplicates`: final translations beyond one per segment; `errors`: ones published
  with an error marker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import wave
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, pct  # noqa: E402
from tests.speech import AUDIO, decode_pcm16  # noqa: E402

ROOMS = {"room-a": ("fr", "pt"), "room-b": ("es", "pt")}


def _room_wav(room: str, repeats: int, path: Path) -> float:
    pcm = decode_pcm16(AUDIO / f"{room}.flac")
    gap = bytes(2 * 16000)  # a second of silence between passes: a sentence end
    data = (pcm + gap) * repeats
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(data)
    return len(data) / 32000


def _entries(redis: Any, key: str) -> list[dict[str, Any]]:
    return [json.loads(fields["d"]) for _, fields in redis.xrange(key)]


async def run(repeats: int, timeout_s: float) -> tuple[dict[str, Any], dict[str, list[float]]]:
    with tempfile.TemporaryDirectory(prefix="bench-mt-") as tmpdir:
        tmp = Path(tmpdir)
        audio_s = 0.0
        lines = ["event: translation bench",
                 "engine: {kind: embedded, model: whisper-base, actors: 1, "
                 "streams_per_actor: 2, cpu_threads: 2}",
                 "translation: {actors: 1, default: embedded}",
                 "outputs: {archive: {dir: null}}",
                 "streams:"]
        for room, targets in ROOMS.items():
            wav = tmp / f"{room}.wav"
            audio_s = max(audio_s, _room_wav(room, repeats, wav))
            lines.append(f"  - {{id: {room}, source: \"{wav}\", language: en, "
                         f"targets: [{', '.join(targets)}]}}")
        started = time.monotonic()
        async with babelcast_run(lines, tmp) as ev:
            redis = ev.redis
            deadline = time.monotonic() + audio_s + timeout_s
            # Until both sources ended and their last sentence was closed...
            while time.monotonic() < deadline:
                states = [redis.hget(f"status:{r}", "source_state") for r in ROOMS]
                if all(s == "ended" for s in states) and \
                        time.monotonic() - started > audio_s + 5:
                    break
                await asyncio.sleep(1.0)
            # ...and every job is translated (nothing waiting or pending).
            drained_at = None
            while time.monotonic() < deadline:
                t = redis.hgetall("actor:translator-0")
                if t and float(t.get("queue_pending", 1)) == 0 and \
                        float(t.get("queue_lag", 1)) == 0:
                    drained_at = drained_at or time.monotonic()
                    if time.monotonic() - drained_at > 3:
                        break
                else:
                    drained_at = None
                await asyncio.sleep(0.5)
            translator = redis.hgetall("actor:translator-0")
            jobs = int(redis.xlen("mt:jobs"))
            source = {r: _entries(redis, f"captions:{r}:en") for r in ROOMS}
            published = {(r, lang): _entries(redis, f"captions:{r}:{lang}")
                         for r, targets in ROOMS.items() for lang in targets}
            cpu_s = ev.cpu_s()

    lags: dict[str, list[float]] = defaultdict(list)
    source_chars: dict[str, int] = defaultdict(int)
    lost = duplicates = errors = 0
    finals_total = 0
    for room, targets in ROOMS.items():
        finals = {m["segment_id"]: m for m in source[room] if m["is_final"] and m["text"]}
        finals_total += len(finals)
        for lang in targets:
            source_chars[lang] += sum(len(m["text"]) for m in finals.values())
            seen: set[int] = set()
            for m in published[(room, lang)]:
                if not m["is_final"]:
                    continue
                if m["segment_id"] in seen:
                    duplicates += 1
                    continue
                seen.add(m["segment_id"])
                if m.get("error"):
                    errors += 1
                src = finals.get(m["segment_id"])
                if src is not None:
                    lags[lang].append(m["emit_time"] - src["emit_time"])
            lost += len(set(finals) - seen)
    sent = {lang: sum(float(v) for k, v in translator.items()
                      if k.endswith(f"_chars_in_{lang}")) for lang in source_chars}
    prompt = sum(float(v) for k, v in translator.items() if k.endswith("_prompt_chars"))
    cost = {lang: round(sent[lang] / source_chars[lang], 3) if source_chars[lang] else None
            for lang in source_chars}
    all_lags = [x for v in lags.values() for x in v]
    result: dict[str, Any] = {
        "rooms": len(ROOMS), "audio_s_per_room": round(audio_s, 1), "jobs": jobs,
        "source_finals": finals_total,
        "translations": sum(len(v) for v in lags.values()),
        "cost_ratio": cost,
        "cost_ratio_max": max((c for c in cost.values() if c is not None), default=None),
        "prompt_ratio": round(prompt / max(1, sum(source_chars.values())), 3),
        "lag_p50_s": pct(all_lags, 0.5), "lag_p95_s": pct(all_lags, 0.95),
        "lag_by_lang": {lang: {"p50_s": pct(v, 0.5), "p95_s": pct(v, 0.95), "n": len(v)}
                        for lang, v in sorted(lags.items())},
        "lost": lost, "duplicates": duplicates, "errors": errors,
        "backend_calls": {k.removesuffix("_calls"): int(float(v))
                          for k, v in translator.items() if k.endswith("_calls")},
        "cpu_s_per_audio_s": round(cpu_s / (audio_s * len(ROOMS)), 3),
        "backends": {"fr": "apertium (en→es→fr)", "es": "apertium", "pt": "bergamot"},
    }
    return result, dict(lags)


def _plot(lags: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lang, values in sorted(lags.items()):
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                label=f"{lang} (n={len(xs)})")
    ax.set_xlabel("source final → translation published (s)")
    ax.set_ylabel("fraction of finals")
    ax.set_title("Translation lag, embedded backends, 2 cores (Whisper running)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6,
                        help="passes of the room's reference audio (~19 s each)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds past the audio's end to wait for the queue to drain")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="FILE", help="write a lag CDF as PNG")
    args = parser.parse_args()
    result, lags = asyncio.run(run(args.repeats, args.timeout))
    if args.plot:
        _plot(lags, args.plot)
    emit(result, args.json)


if __name__ == "__main__":
    main()
