"""Failover benchmark: an ASR actor killed mid-sentence, against one that is not, in one run.

    python -m bench.failover --json [--kill-at 14] [--model tiny.en]

A local Redis and a local Ray; the five reference utterances (28.7 s) played twice, at
real time, into three streams at once, each on an ASR actor of its own (the embedded
engine, one thread each):
- `control`: never killed;
- `resume`: its actor is killed (`ray.kill`, Ray restarts the process) `--kill-at` seconds
  into the talk; the stream resumes from its ASR cursor in Redis (the default);
- `live_edge`: killed at the same moment, with resuming off (`max_catchup_s: 0`): the new
  session starts at the live edge, as Babelcast did before.
The supervisor runs as `babelcast run` runs it (Ray's death signal plus a 5 s poll).
Reported per killed stream: seconds from the kill to the stream back on an actor and to
its first new caption, the audio seconds spanned by the outage, and, against the control
stream's words in the same run, words lost (deletions beyond the control's) and doubled
(insertions beyond the control's), plus each stream's WER.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import jiwer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STREAMS = ("control", "resume", "live_edge")


def _words(ref: str, hyp: str) -> dict[str, int]:
    out = jiwer.process_words(ref, hyp)
    return {"deletions": out.deletions, "insertions": out.insertions,
            "substitutions": out.substitutions}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from redis.asyncio import Redis

    from orchestrator.config import parse_event
    from orchestrator.router import Router
    from orchestrator.runtime import AsrActor, EventRuntime
    from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize, reference_text
    from workers.asr import AsrHostOptions
    from workers.bus import RedisBus
    from workers.engines.embedded import EmbeddedEngineOptions
    from workers.events import SAMPLE_RATE, AudioChunk

    talk = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    pcm = talk * 2 + bytes(3 * 2 * SAMPLE_RATE)
    reference = normalize(" ".join([reference_text()] * 2))
    streams = "\n".join(f"  - {{id: {s}, source: push, language: en}}" for s in STREAMS)
    cfg = parse_event(f'event: failover\nredis: {{url: "{args.redis_url}"}}\n'
                      f"streams:\n{streams}\n")
    runtime = EventRuntime(cfg, redis_url=args.redis_url)
    cls = ray.remote(num_cpus=0, max_restarts=-1)(AsrActor)
    for i, sid in enumerate(STREAMS):
        runtime.asr[sid] = cls.options(name=f"bench-failover-{sid}").remote(
            AsrHostOptions(actor_id=f"asr-{i}", redis_url=args.redis_url, max_streams=1,
                           max_catchup_s=0.0 if sid == "live_edge" else 15.0),
            EmbeddedEngineOptions(model=args.model, cpu_threads=1))
    runtime.router = Router(budget=1, actors=list(STREAMS))
    redis = Redis.from_url(args.redis_url)
    bus = RedisBus(redis)
    chunk = SAMPLE_RATE // 10
    fed = [0]
    at_kill = asyncio.Event()
    out: dict[str, Any] = {"model": args.model, "kill_at_s": args.kill_at,
                           "talk_s": round(len(pcm) / 2 / SAMPLE_RATE, 1)}

    async def feed() -> None:
        t0 = time.monotonic()
        for i in range(0, len(pcm), chunk * 2):
            await asyncio.sleep(max(0.0, t0 + (i // 2 + chunk) / SAMPLE_RATE
                                    - time.monotonic()))
            now = time.time()
            for sid in STREAMS:
                await bus.add_audio(AudioChunk(sid, i // 2, pcm[i:i + chunk * 2], now))
            fed[0] = i // 2 + chunk
            if fed[0] >= args.kill_at * SAMPLE_RATE:
                at_kill.set()

    try:
        await runtime.place_all()
        pids = {sid: (await runtime.asr[sid].state.remote())["pid"] for sid in STREAMS[1:]}
        supervisor = asyncio.create_task(runtime.supervise())
        feeder = asyncio.create_task(feed())
        await at_kill.wait()
        seq_at_kill = {sid: await bus.last_seq(sid, "en") for sid in STREAMS[1:]}
        killed_wall, killed_audio = time.monotonic(), fed[0] / SAMPLE_RATE
        for sid in STREAMS[1:]:
            ray.kill(runtime.asr[sid], no_restart=False)
        back: dict[str, dict[str, float]] = {}
        while len(back) < 2 * len(STREAMS[1:]) and time.monotonic() - killed_wall < 60:
            for sid in STREAMS[1:]:
                if f"{sid}:back" not in back:
                    try:
                        st = await asyncio.wait_for(runtime.asr[sid].state.remote(), 2)
                        if st["pid"] != pids[sid] and await runtime.asr[sid].streams.remote():
                            back[f"{sid}:back"] = {"wall": time.monotonic() - killed_wall,
                                                   "audio": fed[0] / SAMPLE_RATE}
                    except Exception:
                        pass
                if f"{sid}:caption" not in back and \
                        await bus.last_seq(sid, "en") > seq_at_kill[sid]:
                    back[f"{sid}:caption"] = {"wall": time.monotonic() - killed_wall}
            await asyncio.sleep(0.05)
        await feeder
        await asyncio.sleep(8)  # the last sentence closes
        supervisor.cancel()
        texts = {}
        for sid in STREAMS:
            caps = await bus.captions_after(sid, "en", 0, count=100_000)
            texts[sid] = normalize(" ".join(c.text for c in caps if c.is_final))
            seqs = [c.seq for c in caps]
            finals = [c.segment_id for c in caps if c.is_final]
            out[sid] = {"wer": round(float(jiwer.wer(reference, texts[sid])), 4),
                        **_words(reference, texts[sid]),
                        "seq_contiguous": seqs == list(range(1, len(seqs) + 1)),
                        "finals_doubled": len(finals) - len(set(finals)),
                        "captions_left_open": len({c.segment_id for c in caps}
                                                  - set(finals))}
        control = out["control"]
        for sid in STREAMS[1:]:
            status = await bus.get_status(sid)
            row = out[sid]
            row["back_on_actor_s"] = round(back.get(f"{sid}:back", {}).get("wall", -1), 2)
            row["first_caption_after_kill_s"] = round(
                back.get(f"{sid}:caption", {}).get("wall", -1), 2)
            row["outage_audio_s"] = round(back.get(f"{sid}:back", {}).get("audio", 0)
                                          - killed_audio, 2)
            row["words_lost_vs_control"] = row["deletions"] - control["deletions"]
            row["words_doubled_vs_control"] = row["insertions"] - control["insertions"]
            row["resumes"] = int(float(status.get("resumes", 0)))
            row["resume_skipped_s"] = float(status.get("resume_skipped_s", 0))
    finally:
        for handle in runtime.asr.values():
            ray.kill(handle, no_restart=True)
        await redis.aclose()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-at", type=float, default=14.0,
                    help="seconds into the talk (14: inside its third sentence)")
    ap.add_argument("--model", default="tiny.en")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import ray

    from orchestrator.redis_server import LocalRedisServer

    server = LocalRedisServer()
    args.redis_url = server.start()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(run(args))
    finally:
        ray.shutdown()
        server.stop()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
