"""Whole-product benchmark (issue 34): N push streams through everything `babelcast run` starts.

    python -m bench.product --json [--streams 2] [--seconds 300] [--translate fr|none]
        [--engine "{kind: embedded, model: whisper-base, actors: 1, streams_per_actor: 2}"]
        [--translation "{actors: 1}"] [--deadline-s 560] [--log-out run.log]

Starts `babelcast run` (bench.system: a local redis-server child, local Ray, the gateway,
ingest, ASR and translation actors) on a generated event with N `source: push` streams,
each in English with one translation target, waits until every actor of the event has
reported, opens one caption WebSocket per stream and language, and plays real speech into
every stream in real time over `/v1/streams/{id}/audio` with its publish token. The speech
is the reference utterances looped (tests.speech); stream i starts i/N of the way into the
loop so the streams do not pause in step, and an utterance cut by either end of a stream's
window is silenced, so each stream's reference text is exact. After its audio a stream
goes on sending silence at wall pace until the drain ends, as a live source would, so the
end is not a source stall. It measures, from the sender's clock (bench.e2e's definition:
arrival wall time minus the send time of the chunk holding the caption's audio end,
bench.playback.SendLog):

- `source.partial_latency_*`, `source.final_latency_*`, `translated.final_latency_*`
  (p50/p95); `open_at_end` per language (streams whose last caption is still a partial
  after the drain); finals per stream; `wer` of the source finals (tests.speech.normalize);
- `ready_s`: from `babelcast run` to every actor reported (engine loads included);
- `asr_cpu_s_parts`, `asr_us_per_chunk_parts`: `asr` split into the actors' own processes,
  vLLM's engine cores and the other children (VAD helpers), also per 80 ms of stream audio;
- `cpu`: CPU seconds per component over the played window (first chunk to last chunk),
  and per second of stream audio: `gateway` (the `babelcast run` process: gateway worker 0,
  control plane, Ray driver), `gateway_workers`, `ingest`, `asr` (with its children, e.g.
  vLLM's engine core), `translation` (with its children, e.g. apertium), `raylet`, `gcs`,
  `other` (Ray's dashboard, agents, monitors and idle workers; Babelcast's reaper),
  `redis`. A process's reaped children count with it. Push audio enters through the
  gateway, so the ingest actors idle here (they decode pulled sources);
- `session_counters`: summed over the streams' `status:{stream}` hashes;
- `actors`: every actor's status hash at the end (the engine's `describe()` included).

A device call is cut at its limit, and a bench killed there used to leave nothing (an
H200 call of 2026-12-05 came back with an empty file). So: `--deadline-s` plans the
playback to end, drain and stop inside it (`seconds_per_stream` is then what was played,
`seconds_asked` what was asked, `cut_by_deadline` says so); progress goes to stderr with
the time since the start (which actors have reported, while waiting for them); a run that
fails or is interrupted (SIGTERM from `timeout`) still prints one JSON object, with
`complete: false`, the phase it stopped in and what it had measured by then; `--log-out`
keeps `babelcast run`'s own log.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import websockets
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.host import host_fingerprint  # noqa: E402
from bench.capacity.results import stamp  # noqa: E402
from bench.e2e import _client  # noqa: E402 - the caption client e2e measures with
from bench.playback import (  # noqa: E402
    LEAD_IN_S,
    MAX_DRAIN_S,
    Leg,
    SendLog,
    drain,
    keep_live,
    play,
)
from bench.report import emit  # noqa: E402
from bench.system import CLK_TCK, babelcast_run, number_or_text, pct  # noqa: E402
from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16, normalize  # noqa: E402
from workers.events import SAMPLE_RATE  # noqa: E402

CHUNK = SAMPLE_RATE // 10
GAP_S = 1.5  # silence after each utterance in the loop: a pause the segmenter closes on
SOURCE_LANG = "en"
COUNTERS = ("stalls", "gap_fill_s", "late_audio_dropped_s", "rollovers_rut",
            "rollovers_engine_error", "rollovers_budget")
ACTOR_ROLES = (("asr", b"ray::AsrActor"), ("ingest", b"ray::IngestActor"),
               ("translation", b"ray::TranslatorActor"),
               ("gateway_workers", b"orchestrator.gateway.workers"))
OWN_ROLES = {"raylet": "raylet", "gcs_server": "gcs"}  # by the executable's name
COMPONENTS = ("gateway", "gateway_workers", "ingest", "asr", "translation", "raylet", "gcs",
              "other", "redis")
ASR_PARTS = ("asr_actor", "asr_engine_core", "asr_helpers")
"""`asr` split by process: the actors' own (one Python event loop each: Redis reads and
writes, session managers, segmenters, vLLM's AsyncLLM front end), vLLM's engine cores, and
the rest of their children (VAD helpers)."""
STOP_MARGIN_S = 75.0
"""What a deadline keeps back after the drain: `babelcast run` is given 60 s to stop
(bench.system.babelcast_run), then the figures are read and written."""
MIN_PLAY_S = 20.0  # less playback than this measures nothing worth a call: fail instead


def play_seconds(asked_s: float, deadline_s: float | None, elapsed_s: float) -> float:
    """Seconds of audio each stream can play, started `elapsed_s` into a run that must end
    (drain and stop included) by `deadline_s`: `asked_s` when it fits."""
    if deadline_s is None:
        return asked_s
    room = deadline_s - elapsed_s - MAX_DRAIN_S - STOP_MARGIN_S
    if room < min(asked_s, MIN_PLAY_S):
        raise RuntimeError(f"deadline: {elapsed_s:.0f} s of {deadline_s:.0f} s gone before "
                           f"playback, {max(room, 0):.0f} s left to play")
    return min(asked_s, room)


class Progress:
    """Where the run is, for stderr and for the JSON of a run that did not finish."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.phase = "starting"
        self.facts: dict[str, Any] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def enter(self, phase: str, **facts: Any) -> None:
        self.phase = phase
        self.facts.update(facts)
        detail = " ".join(f"{k}={v}" for k, v in facts.items())
        print(f"[bench.product {self.elapsed():6.1f} s] {phase} {detail}".rstrip(),
              file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Piece:
    """One utterance of the loop: its samples [start, end) and its reference text."""

    start: int
    end: int
    text: str


def loop_talk() -> tuple[bytes, list[Piece]]:
    """The reference utterances, each followed by GAP_S of silence: one pass of the loop."""
    pcm, pieces = b"", []
    gap = bytes(2 * int(GAP_S * SAMPLE_RATE))
    for name in REFERENCE_FILES:
        one = decode_pcm16(AUDIO / f"{name}.flac")
        start = len(pcm) // 2
        pieces.append(Piece(start, start + len(one) // 2,
                            " ".join((AUDIO / f"{name}.txt").read_text().split())))
        pcm += one + gap
    return pcm, pieces


def stream_audio(loop: bytes, pieces: list[Piece], offset: int, samples: int
                 ) -> tuple[bytes, str, float]:
    """`samples` of audio: LEAD_IN_S of silence, then the loop from sample `offset` on
    (looped), with every utterance that either end would cut left silent; the text of the
    utterances kept, in order, and their seconds of speech."""
    period = len(loop) // 2
    lead = int(LEAD_IN_S * SAMPLE_RATE)
    out = bytearray(2 * samples)
    texts, speech = [], 0
    for rep in range(offset // period, (offset + samples) // period + 1):
        for p in pieces:
            at = lead + rep * period + p.start - offset
            if at >= lead and at + (p.end - p.start) <= samples:
                out[2 * at: 2 * (at + p.end - p.start)] = loop[2 * p.start: 2 * p.end]
                texts.append(p.text)
                speech += p.end - p.start
    return bytes(out), " ".join(texts), speech / SAMPLE_RATE


def _scan() -> dict[int, tuple[int, str, float, bytes]]:
    """pid → (parent, executable name, CPU s of it and its reaped children, command line)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fb:
                cmdline = fb.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = sum(int(x) for x in fields[11:15]) / CLK_TCK  # utime stime cutime cstime
        out[int(entry)] = (int(fields[1]), comm, cpu, cmdline)
    return out


def component_cpu(run_pid: int, redis_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of each component of the run (see the module doc)."""
    procs = _scan()
    role: dict[int, str] = {run_pid: "gateway"}

    def role_of(pid: int) -> str:
        if pid in role:
            return role[pid]
        ppid, comm, _, cmdline = procs[pid]
        own = next((r for r, needle in ACTOR_ROLES if needle in cmdline), None)
        if own is None and comm in OWN_ROLES:
            own = OWN_ROLES[comm]
        if own is None:  # a helper of an actor or a gateway worker counts with it
            up = role_of(ppid) if ppid in procs and ppid != pid else "outside"
            own = up if up in dict(ACTOR_ROLES) or up == "outside" else "other"
        role[pid] = own
        return own

    totals = dict.fromkeys(COMPONENTS + ASR_PARTS, 0.0)
    for pid, (_, comm, cpu, cmdline) in procs.items():
        r = role_of(pid)
        if r in totals:
            totals[r] += cpu
        if r == "asr":
            part = ("asr_actor" if b"ray::AsrActor" in cmdline
                    else "asr_engine_core" if b"EngineCore" in cmdline or "EngineCor" in comm
                    else "asr_helpers")
            totals[part] += cpu
    if redis_pid in procs:
        totals["redis"] = procs[redis_pid][2]
    return totals


def _latencies(received: list[tuple[float, dict[str, Any]]], sent: SendLog
               ) -> tuple[list[float], list[float], list[str], dict[str, int]]:
    """(partial latencies, final latencies, final texts, captions whose audio ends in the
    silence after the talk: {"partials": n, "finals": n}) of one caption socket."""
    partial: list[float] = []
    final: list[float] = []
    texts: list[str] = []
    after = {"partials": 0, "finals": 0}
    for recv_t, msg in received:
        if msg.get("type") != "caption" or not msg["text"]:
            continue
        end_s = float(msg["audio_end_s"])
        latency = recv_t - sent.wall_of(end_s)
        if sent.past_end(end_s):
            after["finals" if msg["is_final"] else "partials"] += 1
        if msg["is_final"]:
            final.append(latency)
            texts.append(msg["text"])
        else:
            partial.append(latency)
    return partial, final, texts, after


async def _actors_ready(redis: Any, timeout_s: float, progress: Progress | None = None,
                        every_s: float = 30.0) -> list[str]:
    """Wait until every ASR actor and translator the runtime registered has written its
    status hash (an ASR actor once its engine is up, a translator once its backends are
    warm). Ingest actors start with their first pulled source: push audio enters through
    the gateway, so with push streams only they stay idle and never report. Every
    `every_s` it tells `progress` which have reported."""
    deadline = time.monotonic() + timeout_s
    told = time.monotonic()
    while True:
        ids = sorted(redis.smembers("babelcast:actors"))
        waited = [a for a in ids if not a.startswith("ingest-")]
        reported = [a for a in waited if redis.exists(f"actor:{a}")]
        if waited and len(reported) == len(waited):
            return ids
        if time.monotonic() > deadline:
            raise RuntimeError(f"actors not ready after {timeout_s:.0f} s: "
                               f"{len(reported)} of {len(waited)} reported: {reported}")
        if progress is not None and time.monotonic() - told >= every_s:
            told = time.monotonic()
            progress.enter("waiting for actors", reported=",".join(reported) or "none",
                           registered=len(waited))
        await asyncio.sleep(0.5)


def event_lines(ids: list[str], engine: str, target: str | None,
                translation: str | None) -> list[str]:
    targets = f", targets: [{target}]" if target else ""
    return [
        "event: bench product",
        f"engine: {engine}",  # the flag as given: the device passes its vllm section through
        *([f"translation: {translation}"] if translation and target else []),
        "streams:",
        *[f"  - {{id: {s}, source: push, language: {SOURCE_LANG}{targets}}}" for s in ids],
    ]


async def run(args: argparse.Namespace, tmp: Path, progress: Progress) -> dict[str, Any]:
    import jiwer

    ids = [f"room-{i}" for i in range(args.streams)]
    target = None if args.translate == "none" else args.translate
    langs = [SOURCE_LANG, *([target] if target else [])]
    loop, pieces = loop_talk()
    samples = int(args.seconds * SAMPLE_RATE)
    audio = {s: stream_audio(loop, pieces, (i * len(loop) // 2) // len(ids), samples)
             for i, s in enumerate(ids)}
    legs = {(s, lang): Leg(f"{s}:{lang}") for s in ids for lang in langs}
    for s in ids:  # a translated caption's audio end maps through its stream's send log
        for lang in langs[1:]:
            legs[(s, lang)].sent = legs[(s, SOURCE_LANG)].sent
    received: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {k: [] for k in legs}
    lines = event_lines(ids, args.engine, target, args.translation)
    started = time.monotonic()
    ready_timeout = args.ready_timeout
    if args.deadline_s is not None:  # the wait may not eat what the playback needs
        ready_timeout = min(ready_timeout, args.deadline_s - progress.elapsed() - MIN_PLAY_S
                            - MAX_DRAIN_S - STOP_MARGIN_S)
    progress.enter("starting babelcast run", streams=len(ids))
    async with babelcast_run(lines, tmp, ready_timeout_s=ready_timeout) as server:
        progress.enter("gateway and asr-0 up")
        actor_ids = await _actors_ready(server.redis, ready_timeout - (time.monotonic() - started),
                                        progress)
        ready_s = time.monotonic() - started  # `babelcast run` to every actor reported
        progress.enter("actors ready", ready_s=round(ready_s, 1), actors=len(actor_ids))
        seconds = play_seconds(args.seconds, args.deadline_s, progress.elapsed())
        if seconds < args.seconds:  # the talk, cut to what the deadline leaves
            samples = int(seconds * SAMPLE_RATE)
            audio = {s: stream_audio(loop, pieces, (i * len(loop) // 2) // len(ids), samples)
                     for i, s in enumerate(ids)}
        done = asyncio.Event()
        clients = [asyncio.create_task(_client(server.base, s, lang, legs[(s, lang)],
                                               received[(s, lang)], done))
                   for s, lang in legs]
        ws_base = server.base.replace("http://", "ws://")
        senders = {s: await websockets.connect(f"{ws_base}/v1/streams/{s}/audio",
                                               additional_headers=server.headers("publish", s))
                   for s in ids}
        await asyncio.sleep(0.5)  # the caption sockets are open before the first audio
        stop_silence = asyncio.Event()
        played = {s: asyncio.Event() for s in ids}

        async def leg(s: str) -> None:
            await play(senders[s].send, audio[s][0], CHUNK, legs[(s, SOURCE_LANG)].sent, bytes)
            played[s].set()
            await keep_live(senders[s].send, CHUNK, bytes, stop_silence)

        cpu0 = component_cpu(server.proc.pid, server.redis_pid)
        bench0 = time.process_time()
        t_play = time.time()
        progress.enter("playing", seconds=round(seconds, 1))
        feeders = [asyncio.create_task(leg(s)) for s in ids]
        for ev in played.values():
            await ev.wait()
        cpu1 = component_cpu(server.proc.pid, server.redis_pid)
        bench_cpu = time.process_time() - bench0
        played_s = time.time() - t_play
        audio_end = time.time()
        progress.enter("draining", played_wall_s=round(played_s, 1))
        await asyncio.gather(*(drain(leg_, asyncio.Event()) for leg_ in legs.values()))
        drain_s = time.time() - audio_end
        stop_silence.set()
        await asyncio.gather(*feeders, return_exceptions=True)
        done.set()
        await asyncio.gather(*clients, return_exceptions=True)
        for ws in senders.values():
            await ws.close()
        counters = dict.fromkeys(COUNTERS, 0.0)
        for s in ids:
            status = server.redis.hgetall(f"status:{s}")
            for key in COUNTERS:
                counters[key] += float(status.get(key, 0))
        actors = {a: {k: number_or_text(v) for k, v in server.redis.hgetall(f"actor:{a}").items()}
                  for a in actor_ids}  # an idle ingest actor's is empty
        progress.enter("stopping babelcast run", drain_s=round(drain_s, 1))
    progress.enter("stopped")

    audio_s = samples / SAMPLE_RATE * len(ids)
    per_lang: dict[str, Any] = {}
    for lang in langs:
        partial: list[float] = []
        final: list[float] = []
        finals_per_stream: dict[str, int] = {}
        hyps: list[str] = []
        after_audio = {"partials": 0, "finals": 0}
        for s in ids:
            p, f, texts, after = _latencies(received[(s, lang)], legs[(s, lang)].sent)
            partial += p
            final += f
            for k in after_audio:
                after_audio[k] += after[k]
            finals_per_stream[s] = len(f)
            hyps.append(normalize(" ".join(texts)))
        row: dict[str, Any] = {
            "lang": lang,
            "partial_latency_p50_s": pct(partial, 0.5),
            "partial_latency_p95_s": pct(partial, 0.95),
            "final_latency_p50_s": pct(final, 0.5),
            "final_latency_p95_s": pct(final, 0.95),
            "partials": len(partial),
            "finals": len(final),
            "finals_per_stream": finals_per_stream,
            "open_at_end": sum(1 for s in ids if legs[(s, lang)].open_text.strip()),
            # Captions of the silence after the talk (in the latencies above, timed from
            # when that silence was sent): with real weights few, with random ones many.
            "partials_after_audio": after_audio["partials"],
            "finals_after_audio": after_audio["finals"],
        }
        if lang == SOURCE_LANG:
            refs = [normalize(audio[s][1]) for s in ids]
            row["wer"] = round(float(jiwer.wer(refs, hyps)), 4)
            row["wer_per_stream"] = {s: round(float(jiwer.wer(r, h)), 4)
                                     for s, r, h in zip(ids, refs, hyps, strict=True)}
        per_lang["source" if lang == SOURCE_LANG else "translated"] = row
    cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in COMPONENTS}
    asr_parts = {k: round(cpu1[k] - cpu0[k], 2) for k in ASR_PARTS}
    return {
        "kind": "product",
        "streams": len(ids),
        "engine": yaml.safe_load(args.engine),
        "translate": target,
        "translation": yaml.safe_load(args.translation) if args.translation else None,
        "seconds_per_stream": round(seconds, 1),
        "seconds_asked": args.seconds,
        "cut_by_deadline": seconds < args.seconds,
        "deadline_s": args.deadline_s,
        "ready_s": round(ready_s, 1),
        "speech_s_per_stream": [round(audio[s][2], 1) for s in ids],
        "played_wall_s": round(played_s, 2),
        "drain_s": round(drain_s, 1),
        **per_lang,
        "cpu_s": cpu,
        "cpu_s_per_audio_s": {k: round(v / audio_s, 4) for k, v in cpu.items()},
        "cpu_s_per_audio_s_total": round(sum(cpu.values()) / audio_s, 4),
        "asr_cpu_s_parts": asr_parts,
        # per 80 ms of stream audio, as bench.capacity.strict reports its engine cores,
        # front ends and helpers: the actor's own part is the strict front end plus Redis
        "asr_us_per_chunk_parts": {k: round(v / (audio_s / 0.08) * 1e6, 1)
                                   for k, v in asr_parts.items()},
        "bench_client_cpu_s": round(bench_cpu, 2),  # the senders and caption sockets, same host
        "session_counters": {k: round(v, 3) for k, v in counters.items()},
        "actors": actors,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(progress.elapsed(), 1),
        "complete": True,
    }


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


T = TypeVar("T")


class Terminated(Exception):
    """The run got SIGTERM (what `timeout` sends a device call at its limit)."""


async def until_terminated(coro: Coroutine[Any, Any, T]) -> T:
    """`coro`, cancelled on SIGTERM, which then comes out as `Terminated`: `babelcast
    run` is stopped as Ctrl-C would stop it (asyncio.run cancels the main task on
    SIGINT). A Python signal handler that raised instead (`default_int_handler`) could
    land in a weakref callback, where the exception is printed and dropped: a suite run
    saw the run go on to its end and exit 0."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def terminate() -> None:
        got.append(signal.SIGTERM)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        return await coro
    except asyncio.CancelledError:
        if got:
            raise Terminated("SIGTERM") from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=300.0,
                    help="audio seconds each stream plays (the talk looped)")
    ap.add_argument("--engine", default=None,
                    help="the event's engine section, YAML flow mapping, passed through "
                         "unchanged (default: {kind: embedded, model: whisper-base, "
                         "actors: 1, streams_per_actor: N})")
    ap.add_argument("--translate", default="fr",
                    help="each stream's one target language, or 'none'")
    ap.add_argument("--translation", default=None,
                    help="the event's translation section, YAML flow mapping (default: "
                         "none, i.e. the embedded backends)")
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for the gateway and every actor (vLLM loads slowly)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the run ends (drain and stop included) within this many seconds "
                         "of its start: the playback is cut to fit, and says so")
    ap.add_argument("--log-out", default=None,
                    help="copy `babelcast run`'s own log here at the end, however it ended")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.engine is None:
        args.engine = (f"{{kind: embedded, model: whisper-base, actors: 1, "
                       f"streams_per_actor: {args.streams}}}")
    if not isinstance(yaml.safe_load(args.engine), dict):
        ap.error("--engine is a YAML flow mapping, e.g. '{kind: vllm, model: /tmp/voxtral}'")
    progress = Progress()
    code = 0
    with tempfile.TemporaryDirectory(prefix="bench-product-") as tmp:
        try:
            result = asyncio.run(until_terminated(run(args, Path(tmp), progress)))
        except (Exception, KeyboardInterrupt) as exc:  # reported in the JSON, not hidden
            code = 1
            # what the run had by then, so a cut device call still says where it got to
            result = {"kind": "product", "complete": False, "stopped_in": progress.phase,
                      "error": f"{type(exc).__name__}: {exc}"[-2000:],
                      "wall_s": round(progress.elapsed(), 1), "streams": args.streams,
                      "seconds_asked": args.seconds, "deadline_s": args.deadline_s,
                      **progress.facts}
            progress.enter("failed", stopped_in=result["stopped_in"])
        finally:
            log = Path(tmp) / "run.log"
            if args.log_out and log.exists():
                shutil.copyfile(log, args.log_out)
    result = stamp({"argv": sys.argv, "host": host_fingerprint(),
                    "vllm_version": _vllm_version(), **result},
                   shlex.join(["python", "-m", "bench.product", *sys.argv[1:]]))
    emit(result, args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
