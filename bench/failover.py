"""Failover benchmark: ASR actors killed mid-sentence and a Ray node lost, against a
stream that is not touched, in one run.

    python -m bench.failover --json [--kill-at 14] [--model tiny.en]

A local Redis and a Ray cluster of two nodes on this machine (Ray's cluster utilities);
the five reference utterances (28.7 s) played twice, at real time, into four streams at
once, each on an ASR actor of its own (the embedded engine, one thread each), plus a spare
actor with no stream:
- `control` (node a): never touched;
- `resume` (node a): its actor's process is killed `--kill-at` seconds into the talk
  (`ray.kill`; Ray restarts it); the stream resumes from its ASR cursor (the default);
- `live_edge` (node a): killed the same way, with resuming off (`max_catchup_s` 0): the
  new session starts at the live edge, as Babelcast did before;
- `node_loss` (node b): node b's raylet is killed (SIGKILL by pid) at the same moment; the
  stream moves to the spare actor on node a.
The supervisor runs as `babelcast run` runs it (Ray's death signal plus a 5 s poll).
Reported per touched stream: seconds from the kill to the stream on a live actor, the
longest stretch without a caption from the kill on, and, against the control stream's
words in the same run, words lost (deletions beyond the control's) and doubled
(insertions beyond the control's), plus each stream's WER.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jiwer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STREAMS = ("control", "resume", "live_edge", "node_loss")
TOUCHED = STREAMS[1:]


def _words(ref: str, hyp: str) -> dict[str, int]:
    out = jiwer.process_words(ref, hyp)
    return {"deletions": out.deletions, "insertions": out.insertions,
            "substitutions": out.substitutions}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from orchestrator.config import parse_event
    from orchestrator.ray_actors import AsrActor
    from orchestrator.router import Router
    from orchestrator.runtime import EventRuntime
    from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize, reference_text
    from workers.asr import AsrHostOptions
    from workers.bus import RedisBus, connect_redis
    from workers.engines.embedded import EmbeddedEngineOptions
    from workers.events import SAMPLE_RATE, AudioChunk

    talk = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    pcm = talk * 2 + bytes(3 * 2 * SAMPLE_RATE)
    reference = normalize(" ".join([reference_text()] * 2))
    streams = "\n".join(f"  - {{id: {s}, source: push, language: en}}" for s in STREAMS)
    cfg = parse_event(f'event: failover\nredis: {{url: "{args.redis_url}"}}\n'
                      f"engine: {{actors: 5, streams_per_actor: 1}}\nstreams:\n{streams}\n")
    runtime = EventRuntime(cfg, redis_url=args.redis_url)
    cls = ray.remote(num_cpus=0, max_restarts=-1)(AsrActor)
    for i, sid in enumerate((*STREAMS, "spare")):
        node = "node_b" if sid == "node_loss" else "node_a"
        runtime.asr[sid] = cls.options(name=f"bench-failover-{sid}",
                                       resources={node: 1}).remote(
            AsrHostOptions(actor_id=f"asr-{i}", redis_url=args.redis_url, max_streams=1,
                           max_catchup_s=0.0 if sid == "live_edge" else 15.0),
            EmbeddedEngineOptions(model=args.model, cpu_threads=1))
    runtime.router = Router(budget=1, actors=[*STREAMS, "spare"])
    redis = connect_redis(args.redis_url)
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
        await runtime.warm_spares()
        pids = {sid: (await runtime.asr[sid].state.remote())["pid"] for sid in TOUCHED}
        supervisor = asyncio.create_task(runtime.supervise())
        feeder = asyncio.create_task(feed())
        await at_kill.wait()
        killed_wall, killed_epoch = time.monotonic(), time.time()
        killed_audio = fed[0] / SAMPLE_RATE
        for sid in ("resume", "live_edge"):
            ray.kill(runtime.asr[sid], no_restart=False)
        os.kill(args.raylet_b, signal.SIGKILL)
        back: dict[str, float] = {}
        while len(back) < len(TOUCHED) and time.monotonic() - killed_wall < 60:
            for sid in TOUCHED:
                owner = runtime.router.pins[sid]
                if sid in back:
                    continue
                try:
                    st = await asyncio.wait_for(runtime.asr[owner].state.remote(), 2)
                    if (owner != sid or st["pid"] != pids[sid]) and \
                            sid in await runtime.asr[owner].streams.remote():
                        back[sid] = time.monotonic() - killed_wall
                except Exception:
                    pass
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
        out["killed_at_audio_s"] = round(killed_audio, 2)
        for sid in TOUCHED:
            status = await bus.get_status(sid)
            caps = await bus.captions_after(sid, "en", 0, count=100_000)
            times = [killed_epoch, *sorted(c.emit_time for c in caps
                                           if c.emit_time > killed_epoch)]
            row = out[sid]
            row["owner_after"] = runtime.router.pins[sid]
            row["on_a_live_actor_after_s"] = round(back.get(sid, -1), 2)
            row["longest_caption_silence_s"] = round(
                max(b - a for a, b in itertools.pairwise(times)), 2)
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
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from orchestrator.redis_server import LocalRedisServer

    server = LocalRedisServer()
    args.redis_url = server.start()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "resources": {"node_a": 8},
                                      "include_dashboard": False})
    node_b = cluster.add_node(num_cpus=1, resources={"node_b": 8})
    args.raylet_b = node_b.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        result = asyncio.run(run(args))
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        server.stop()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
