"""Failover benchmark: an engine, an actor, a whole node (vanished or frozen) and an ingest
process lost mid-talk, each with `--streams` streams, against a control round of the same
streams untouched, in one run.

    python -m bench.failover --json [--modes engine_loss,node_vanish] [--streams 8]

A local Redis and a local Ray cluster (Ray's cluster utilities: a head node, and for the
node modes a second node started as processes of its own). Rounds run one after another
(2 cores cannot caption 48 streams at once); each round plays the five reference utterances
(28.7 s) once, at real time, into `--streams` streams that all sit on one ASR actor (the
embedded engine, `--cpu-threads` threads), next to a warm spare actor with room for all of
them. Streams never move for lag here (`move_after_lag_s: null`): on 2 cores 8 tiny.en
streams run behind real time, and the control's streams would move:
- `control`: never touched (its words are what the modes are judged against);
- `engine_loss`: the engine inside the actor dies: FAULT INJECTION (`KillableEngine`) unloads
  the real model and reports the engine dead, as a crashed vLLM engine core does (the
  embedded engine has no death of its own: it runs in the actor's process);
- `actor_loss`: the actor's process is SIGKILLed by pid (Ray restarts it);
- `node_vanish`: the actor runs on a second node; every process of that node (raylet,
  workers, agents: the node's processes and all their descendants) is SIGKILLed at once;
- `node_freeze`: the same node's processes are SIGSTOPped, and SIGCONTed `--freeze-s` later;
  the frozen processes' Redis commands after they wake are counted (Redis MONITOR, by
  their connections' ports): caption writes attempted after their streams moved;
- `ingest_loss`: the streams are files played by one ingest actor, whose process is
  SIGKILLed by pid (Ray restarts it; the files go on from the ingest cursor).
The supervisor runs as `babelcast run` runs it (Ray's death signal plus a 5 s poll).
`fault_happened` is true only when the process(es) were found and then seen dead (gone or
a zombie) or stopped (state T), or, for `engine_loss`, the model seen unloaded.

Reported per mode, over its streams: p50/p95/max of each stream's longest stretch without
a caption from the fault to the end of the speech or its last caption, whichever is later;
the seconds until each stream is on a live actor; words lost and doubled against the
control stream with the same index (deletions and insertions beyond the control's, jiwer);
finals made twice; whether each stream's caption seq numbers run 1..n without a gap or a
repeat; how many streams had a cursor (a final) at the fault. The control reports the
same silence measure from the same point of the talk: what the CPU alone costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import jiwer

log = logging.getLogger("bench.failover")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.failover_faults import (  # noqa: E402
    Fault,
    _killable_actor_class,
    node_pids,
    pid_state,
    redis_ports_of,
    signal_all,
)
from bench.failover_rules import (  # noqa: E402
    against_control,
    finals_doubled,
    longest_silence,
    percentile,
    seq_contiguous,
)

MODES = ("engine_loss", "actor_loss", "node_vanish", "node_freeze", "ingest_loss")
NODE_MODES = ("node_vanish", "node_freeze")
SETTLE_S = 45.0
"""After the speech: how long the streams get to finish their last sentence (a spare that
took over 8 streams replays their audio from the cursor on 2 cores)."""


# ---- one round -----------------------------------------------------------------------
def asr_options(cfg: Any, actor_id: str, args: argparse.Namespace) -> Any:
    """The ASR host's options as the runtime builds them from the event (its session
    policy and, where the code has one, its lease), so the bench judges the product's
    failover and not one of its own."""
    import dataclasses

    from orchestrator.actor_options import session_policy
    from workers.asr import AsrHostOptions

    extra: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(AsrHostOptions)}
    if "lease_ttl_s" in names:
        extra["lease_ttl_s"] = getattr(cfg.engine, "lease_ttl_s", None)
    return AsrHostOptions(actor_id=actor_id, redis_url=args.redis_url,
                          max_streams=args.streams, max_catchup_s=15.0,
                          session_policy=session_policy(cfg), **extra)


def talk_pcm() -> tuple[bytes, float]:
    from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16
    from workers.events import SAMPLE_RATE

    talk = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    return talk + bytes(3 * 2 * SAMPLE_RATE), len(talk) / 2 / SAMPLE_RATE


async def run_round(mode: str, args: argparse.Namespace, node: Any) -> dict[str, Any]:
    import ray

    from orchestrator.config import parse_event
    from orchestrator.ray_actors import AsrActor, IngestActor
    from orchestrator.router import Router
    from orchestrator.runtime import EventRuntime
    from tests.speech import normalize, reference_text
    from workers.bus import RedisBus, connect_redis
    from workers.engines.embedded import EmbeddedEngineOptions
    from workers.events import SAMPLE_RATE, AudioChunk
    from workers.ingest import IngestHostOptions

    pcm, speech_s = talk_pcm()
    reference = normalize(reference_text())
    ids = [f"{mode.replace('_', '-')}-{i}" for i in range(args.streams)]
    file_source = mode == "ingest_loss"
    if file_source:
        wav = Path(args.tmp) / "talk.wav"
        with wave.open(str(wav), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(pcm)
        src = f'"{wav}"'
    else:
        src = "push"
    lines = "\n".join(f"  - {{id: {s}, source: {src}, language: en}}" for s in ids)
    cfg = parse_event(f'event: failover-{mode}\nredis: {{url: "{args.redis_url}"}}\n'
                      f"engine: {{actors: 2, streams_per_actor: {args.streams}, "
                      # Failover alone: a stream behind real time (2 cores, 8 streams)
                      # would otherwise move for lag, the control's too.
                      "move_after_lag_s: null}\n"
                      f"ingest: {{actors: 1}}\nstreams:\n{lines}\n")
    runtime = EventRuntime(cfg, redis_url=args.redis_url)
    victim_cls = _killable_actor_class() if mode == "engine_loss" else AsrActor
    for role in ("victim", "spare"):
        cls = victim_cls if role == "victim" else AsrActor
        where = "node_b" if role == "victim" and mode in NODE_MODES else "node_a"
        runtime.asr[f"{mode}-{role}"] = ray.remote(num_cpus=0, max_restarts=-1)(cls).options(
            name=f"bench-failover-{mode}-{role}", resources={where: 1}).remote(
            asr_options(cfg, f"{mode}-{role}", args),
            EmbeddedEngineOptions(model=args.model, cpu_threads=args.cpu_threads))
    victim, spare = f"{mode}-victim", f"{mode}-spare"
    if file_source:
        runtime.ingest["ingest-0"] = ray.remote(num_cpus=0, max_restarts=-1)(
            IngestActor).options(name=f"bench-failover-{mode}-ingest",
                                 resources={"node_a": 1}).remote(
            IngestHostOptions(actor_id=f"{mode}-ingest", redis_url=args.redis_url))
    runtime.router = Router(budget=args.streams, actors=[victim, spare])
    runtime.router.pins.update({sid: victim for sid in ids})
    redis = connect_redis(args.redis_url)
    bus = RedisBus(redis)
    chunk = SAMPLE_RATE // 10
    fed = [0]
    out: dict[str, Any] = {"streams": args.streams}
    fault = Fault(kind="none")
    frozen_wake: dict[str, Any] = {}

    async def feed() -> None:
        t0 = time.monotonic()
        for i in range(0, len(pcm), chunk * 2):
            await asyncio.sleep(max(0.0, t0 + (i // 2 + chunk) / SAMPLE_RATE
                                    - time.monotonic()))
            now = time.time()
            for sid in ids:
                await bus.add_audio(AudioChunk(sid, i // 2, pcm[i:i + chunk * 2], now))
            fed[0] = i // 2 + chunk

    async def audio_s() -> float:
        if file_source:
            return (await bus.last_audio_end(ids[0]))[0] / SAMPLE_RATE
        return fed[0] / SAMPLE_RATE

    async def owner_state(actor: str, handle: Any) -> tuple[dict[str, Any], list[str]] | None:
        try:
            st = await asyncio.wait_for(handle.state.remote(), 2)
            return st, await asyncio.wait_for(handle.streams.remote(), 2)
        except Exception:
            return None

    supervisor = None
    feeder = None
    try:
        await runtime.place_all()
        await runtime.warm_spares()
        vstate = await runtime.asr[victim].state.remote()
        old_pid = vstate["pid"]
        if file_source:
            old_pid = (await runtime.ingest["ingest-0"].state.remote())["pid"]
        supervisor = asyncio.create_task(runtime.supervise())
        if not file_source:
            feeder = asyncio.create_task(feed())
        speech_start = time.time() if not file_source else None
        while await audio_s() < args.kill_at:  # noqa: ASYNC110 - a clock in Redis, polled
            await asyncio.sleep(0.05)
        if speech_start is None:  # the file's clock: where the ingest actor is now
            speech_start = time.time() - await audio_s()
        speech_end = speech_start + speech_s
        killed_audio = await audio_s()
        # A stream with no final yet has no cursor: a new owner starts it at the live edge.
        with_cursor = sum([await bus.load_cursor(sid) is not None for sid in ids])
        frozen_ports: set[int] = set()
        if mode == "control":
            fault = Fault(kind="none", at=time.time())
        elif mode == "engine_loss":
            at = time.time()
            res = await runtime.asr[victim].kill_engine.remote()
            fault = Fault(kind="engine", pids=[res["pid"]], at=at)
            fault.states = {res["pid"]: "engine unloaded" if res["unloaded"] else "loaded"}
            happened = bool(res["unloaded"]) and res["pid"] == old_pid
        elif mode in ("actor_loss", "ingest_loss"):
            fault = signal_all([old_pid], signal.SIGKILL, "dead")
            happened = fault.check("dead")
        elif mode == "node_vanish":
            pids = node_pids(node)
            fault = signal_all(pids, signal.SIGKILL, "dead")
            happened = fault.check("dead") and old_pid in pids
        else:  # node_freeze
            pids = node_pids(node)
            frozen_ports = redis_ports_of(pids, args.redis_port)
            fault = signal_all(pids, signal.SIGSTOP, "stopped")
            happened = fault.check("stopped") and old_pid in pids
        if mode != "control":
            out["fault_happened"] = happened
            out["fault_pids"] = len(fault.pids)
        killed_wall = time.monotonic()
        log.warning("%s: fault done (%d processes)", mode, len(fault.pids))

        back: dict[str, float] = {}
        ingest = runtime.ingest.get("ingest-0")
        monitor: asyncio.Task[None] | None = None
        late = {"commands": 0, "caption_writes": 0}

        async def watch_late() -> None:
            # MONITOR echoes every command with its arguments (caption text among them):
            # only the command name and the client's port are looked at, nothing is kept.
            async with connect_redis(args.redis_url) as conn, conn.monitor() as m:
                async for cmd in m.listen():
                    if int(cmd.get("client_port") or 0) in frozen_ports:
                        late["commands"] += 1
                        name = str(cmd.get("command", "")).split(" ", 1)[0].upper()
                        if name in ("EVALSHA", "EVAL", "XADD") and \
                                "caption" in str(cmd.get("command", ""))[:200]:
                            late["caption_writes"] += 1

        deadline = speech_end + SETTLE_S
        woke = False
        while time.time() < deadline:
            if mode == "node_freeze" and not woke and \
                    time.monotonic() - killed_wall >= args.freeze_s:
                woke = True
                monitor = asyncio.create_task(watch_late())
                await asyncio.sleep(0.2)  # MONITOR is on before the first late command
                cont = signal_all(fault.pids, signal.SIGCONT, "running", wait_s=2.0)
                frozen_wake["woke_after_s"] = round(time.monotonic() - killed_wall, 2)
                frozen_wake["resumed"] = sum(1 for s in cont.states.values()
                                             if s == "running")
            if mode != "control" and len(back) < len(ids):
                if file_source:
                    assert ingest is not None
                    got = await owner_state("ingest-0", ingest)
                    if got is not None and got[0]["pid"] != old_pid:
                        for sid in ids:
                            if sid in got[1] and sid not in back:
                                back[sid] = time.monotonic() - killed_wall
                else:
                    seen: dict[str, Any] = {}
                    for sid in ids:
                        owner = runtime.router.pins[sid]
                        if sid in back:
                            continue
                        if owner not in seen:
                            seen[owner] = await owner_state(owner, runtime.asr[owner])
                        got = seen[owner]
                        if got is None:
                            continue
                        st, streams = got
                        live = owner != victim or (st["pid"] != old_pid
                                                   and st.get("engine_ok") is not False)
                        if live and st.get("started") and sid in streams:
                            back[sid] = time.monotonic() - killed_wall
            if time.time() > speech_end + 3 and (mode != "node_freeze" or woke):
                done = True  # every stream finished its last sentence
                for sid in ids:
                    caps = await bus.captions_after(sid, "en", 0, count=100_000)
                    if not (caps and caps[-1].is_final
                            and caps[-1].audio_end_s >= speech_s - 2.0):
                        done = False
                        break
                if done and (mode == "control" or len(back) == len(ids)):
                    break
            await asyncio.sleep(0.25)
        if feeder is not None:
            await feeder
        if monitor is not None:
            await asyncio.sleep(2.0)
            monitor.cancel()
            with contextlib.suppress(BaseException):
                await monitor
            if monitor.cancelled() is False and monitor.exception() is not None:
                frozen_wake["monitor_error"] = type(monitor.exception()).__name__
            frozen_wake["late_commands"] = late["commands"]
            frozen_wake["late_caption_writes"] = late["caption_writes"]
            frozen_wake["alive_checked_after_wake_s"] = round(
                time.monotonic() - killed_wall - frozen_wake["woke_after_s"], 1)
            frozen_wake["alive_after_wake"] = sum(
                1 for p in fault.pids if pid_state(p) in ("running", "stopped"))
            frozen_wake["processes"] = len(fault.pids)
        supervisor.cancel()

        silences, backs, per_stream = [], [], []
        for sid in ids:
            caps = await bus.captions_after(sid, "en", 0, count=100_000)
            text = normalize(" ".join(c.text for c in caps if c.is_final))
            words = jiwer.process_words(reference, text)
            finals = [c.segment_id for c in caps
                      if c.is_final and not c.withdrawn and not c.gap_s]
            emitted = [c.emit_time for c in caps]
            # Up to the end of the speech (a stream never back is silent all that time),
            # or to its last caption when it runs behind real time (on 2 cores 8 streams
            # caption well after the speech: a gap there is a gap too).
            silence = longest_silence(emitted, fault.at, max(speech_end, *emitted[-1:]))
            silences.append(silence)
            if sid in back:
                backs.append(back[sid])
            status = await bus.get_status(sid)
            per_stream.append({
                "deletions": words.deletions, "insertions": words.insertions,
                "wer": float(jiwer.wer(reference, text)),
                "seq_contiguous": seq_contiguous([c.seq for c in caps]),
                "finals_doubled": finals_doubled(finals),
                # a withdrawn segment is closed; a gap event is no segment
                "captions_left_open": len({c.segment_id for c in caps
                                           if not c.gap_s} - set(finals)
                                          - {c.segment_id for c in caps if c.withdrawn}),
                "resumes": int(float(status.get("resumes", 0) or 0)),
                "skipped": float(status.get("resume_skipped_s", 0) or 0),
                "silence": silence})
        out.update(
            fault_at_audio_s=round(killed_audio, 2),
            longest_caption_silence_p50_s=_r(percentile(silences, 50)),
            longest_caption_silence_p95_s=_r(percentile(silences, 95)),
            longest_caption_silence_max_s=_r(max(silences)),
            finals_doubled=sum(p["finals_doubled"] for p in per_stream),
            seq_contiguous=all(p["seq_contiguous"] for p in per_stream),
            captions_left_open=sum(p["captions_left_open"] for p in per_stream),
            wer_mean=round(sum(p["wer"] for p in per_stream) / len(per_stream), 4),
            streams_with_cursor_at_fault=with_cursor,
            resumes=sum(p["resumes"] for p in per_stream),
            resume_skipped_s=round(sum(p["skipped"] for p in per_stream), 2))
        if mode != "control":
            out.update(on_a_live_actor_after_p50_s=_r(percentile(backs, 50)),
                       on_a_live_actor_after_p95_s=_r(percentile(backs, 95)),
                       on_a_live_actor_after_max_s=_r(max(backs, default=None)),
                       streams_never_on_a_live_actor=len(ids) - len(back),
                       moved_to_spare=sum(1 for s in ids if runtime.router.pins[s] == spare))
        if frozen_wake:
            out["frozen_node_after_wake"] = frozen_wake
        out["_per_stream"] = per_stream
    finally:
        if supervisor is not None:
            supervisor.cancel()
        for handle in [*runtime.asr.values(), *runtime.ingest.values()]:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        await redis.aclose()
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _commit() -> str | None:
    """The code measured: $BABELCAST_COMMIT (the lent H200's copy has a stale .git; its
    caller writes the commit there, scripts/h200.sh), the checkout's HEAD, or
    .stage/extra/COMMIT. The run of 2026-12-04 at aa5389c recorded 0261d45 from that
    stale .git before this read the variable."""
    from bench.capacity.results import commit_of

    full = commit_of()
    return full[:7] if full else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--kill-at", type=float, default=14.0,
                    help="seconds into the talk (14: inside its third sentence, after two "
                         "finals: a stream with no final yet has no cursor to resume from)")
    ap.add_argument("--freeze-s", type=float, default=25.0,
                    help="node_freeze: seconds frozen (Ray declares a silent node dead "
                         "after ~15-20 s)")
    ap.add_argument("--model", default="tiny.en")
    ap.add_argument("--cpu-threads", type=int, default=2,
                    help="decode threads per ASR actor (the product's default, 2)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    # Times on stderr: which came first, Ray's death signal or the lease's lapse, and how
    # long the moves took after the fault (the first H200 run's log had no times).
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s.%(msecs)03d %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s): {bad}")
    if args.streams < 1:
        ap.error("--streams must be at least 1")
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.redis_server import LocalRedisServer

    server = LocalRedisServer()
    args.redis_url = server.start()
    args.redis_port = int(args.redis_url.rsplit(":", 1)[1].split("/")[0])
    args.tmp = tempfile.mkdtemp(prefix="babelcast-failover-")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "resources": {"node_a": 100},
                                      "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "command": "python -m bench.failover " + " ".join(sys.argv[1:]),
                              "commit": _commit(), "model": args.model, "streams": args.streams,
                              "cpu_threads": args.cpu_threads, "cores": os.cpu_count(),
                              "kill_at_s": args.kill_at, "talk_s": round(talk_pcm()[1], 1),
                              "freeze_s": args.freeze_s, "modes": modes}
    started = time.monotonic()
    try:
        for mode in ["control", *modes]:
            node = None
            if mode in NODE_MODES:
                node = cluster.add_node(num_cpus=1, resources={"node_b": 100})
                cluster.wait_for_nodes()
            t0 = time.monotonic()
            try:
                result[mode] = asyncio.run(run_round(mode, args, node))
            except Exception as exc:  # one round failing still reports the others
                result[mode] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            result[mode]["round_s"] = round(time.monotonic() - t0, 1)
            if node is not None:
                with contextlib.suppress(Exception):
                    cluster.remove_node(node, allow_graceful=False)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        server.stop()
    control = result["control"]
    for mode in modes:
        if "_per_stream" in result[mode] and "_per_stream" in control:
            against_control(result[mode], control)
    for mode in ["control", *modes]:
        result[mode].pop("_per_stream", None)
    result["ran_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
