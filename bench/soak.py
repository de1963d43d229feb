"""Soak: `babelcast run` (tiny.en, N file streams, local redis-server child) for a long
time while caption clients join and leave, with an ASR actor kill and a Redis restart
taking turns every `--fault-every` minutes. Prints JSON.

    .venv/bin/python -m bench.soak --minutes 60 --json [--streams 4] [--fault-every 15]

Counted truthfully:
- A fault is recorded only when its process was found and then seen dead (gone, or a
  zombie) within `KILL_VERIFY_S`; a fault due with no process to kill, or one that did not
  die, goes to `faults_not_done` with the reason, never into `faults`.
- Finals lost are counted from the seq numbers the publisher issued (one per publication
  on (stream, lang), 1, 2, 3, ...): every seq a client following a stream never saw is a
  publication lost to it; those also missing from the Redis Stream were lost at the
  source (inside a Redis restart, say), which comparing clients with the Stream alone
  cannot show. A missing seq may have been a final or a partial; a segment whose final
  neither the client nor the Stream holds is a lost final (`finals_lost`), and so is a
  final the Stream holds that the client missed. Repeats (a seq not above the last one,
  e.g. a counter reset) are counted apart.
- RSS per role (ASR actor, ingest actor, raylet, gcs, redis-server, babelcast-run: the
  gateway and the supervisor): a replaced process's successor continues its role's series
  (once warm: every stream captioning again after it appeared, and `WARMUP_S` more), and
  growth is reported per role over the whole soak (first warm sample of the role to its
  last, whichever process held it), besides the last process's own growth.
Per fault, the longest caption silence on any stream after it (fault -> that stream's next
caption); no fault is injected in the last two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.system import ROOT, _descendants, _proc_table
from orchestrator.redis_server import free_port
from tests.speech import AUDIO

WARMUP_S = 30.0
"""After the start and after a process is replaced: models loaded, sessions open, the
first captions out, before its RSS counts."""
KILL_VERIFY_S = 5.0
"""A SIGKILLed process is gone (or a zombie) within this, or the fault did not happen."""
FAULT_MARGIN_S = 120.0
"""No fault this close to the end."""
SERIES_EVERY_S = 300.0
KINDS = {"redis-server": "redis-server", "ray::AsrActor": "asr-actor",
         "ray::IngestActor": "ingest-actor", "raylet": "raylet", "gcs_server": "gcs",
         "orchestrator.gateway.workers": "gateway-worker", "orchestrator.cli": "babelcast-run"}
"""Needles in a process's command line -> its role (the first that matches)."""


def _rss_by_kind(root: int) -> dict[str, tuple[int, float]]:
    """kind → (pid, RSS MB) of the biggest process of that kind under root."""
    parents, _ = _proc_table()
    out: dict[str, tuple[int, float]] = {}
    for pid in _descendants(root, parents):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kind = next((k for needle, k in KINDS.items() if needle in cmd), None)
        if kind is None:
            continue
        rss = next((int(line.split()[1]) / 1024 for line in status.splitlines()
                    if line.startswith("VmRSS:")), 0.0)
        if kind not in out or rss > out[kind][1]:
            out[kind] = (pid, rss)
    return out


def pid_dead(pid: int) -> bool:
    """Gone, or a zombie (killed, not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def kill_verified(pid: int | None, wait_s: float = KILL_VERIFY_S) -> bool:
    """SIGKILL `pid` and wait until it is dead; False when there was no pid, or it lives."""
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False  # already gone: not this fault's doing
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if pid_dead(pid):
            return True
        time.sleep(0.05)
    return False


def seq_audit(seen: list[int]) -> dict[str, int]:
    """The seq numbers one client saw, in arrival order, against the publisher's 1, 2, ...:
    `missing` numbers below the highest seen that never arrived, `repeats` arrivals not
    above the one before."""
    repeats = sum(1 for x, y in itertools.pairwise(seen) if y <= x)
    top = max(seen, default=0)
    return {"missing": len(set(range(1, top + 1)) - set(seen)), "repeats": repeats}


def message_kind(msg: dict[str, Any]) -> str:
    """'final', 'partial', 'withdraw' or 'gap' (a wire message with a seq)."""
    if msg.get("type") == "caption":
        return "final" if msg.get("is_final") else "partial"
    return str(msg.get("type"))


def finals_lost(client: dict[int, tuple[int, str]], stream: dict[int, tuple[int, str]],
                first_in_stream: int = 1) -> dict[str, int]:
    """seq -> (segment_id, `message_kind`) as one client saw them and as the Redis Stream
    holds them (the Stream from `first_in_stream` on: older entries may be trimmed). Lost:
    a final the Stream holds that the client never got; a segment below the last one the
    client saw that neither holds a final or a withdraw for (segment ids go up by one, so
    one neither saw at all was a whole segment lost: its partials and its final). Seq
    numbers neither holds were issued and lost at the source (inside a Redis restart)."""
    top = max(client, default=0)
    missed = sum(1 for seq, (_, kind) in stream.items()
                 if kind == "final" and seq <= top and seq not in client)
    both = [v for v in (*client.values(), *stream.values()) if v[1] != "gap"]
    closed = {seg for seg, kind in both if kind in ("final", "withdraw")}
    first = min((seg for seg, _ in both), default=1)
    last = max((seg for seg, kind in client.values() if kind != "gap"), default=0)
    unfinished = sum(1 for seg in range(first, last) if seg not in closed)
    lost_at_source = len({s for s in range(max(1, first_in_stream), top + 1)
                          if s not in client and s not in stream})
    return {"finals_lost": missed + unfinished, "finals_missed_by_client": missed,
            "segments_never_final": unfinished, "seqs_lost_at_source": lost_at_source}


def role_growth(samples: list[dict[str, tuple[int, float]]], role: str,
                every: int) -> dict[str, Any] | None:
    """One role's RSS over the whole soak, whichever process held it (samples of a
    replacement that is not warm yet are left out by `Warmup`)."""
    series = [(s[role][0], s[role][1]) for s in samples if role in s]
    if not series:
        return None
    first, last = series[0][1], series[-1][1]
    half = series[len(series) // 2][1]
    last_pid = series[-1][0]
    own = [mb for pid, mb in series if pid == last_pid]
    return {"first_mb": round(first, 1), "last_mb": round(last, 1),
            "growth_pct": round(100 * (last - first) / first, 1),
            # A leak keeps growing; a process settling in does not.
            "second_half_growth_pct": round(100 * (last - half) / half, 1),
            "processes": len({pid for pid, _ in series}),
            "last_process_growth_pct": round(100 * (own[-1] - own[0]) / own[0], 1),
            "every_5_min_mb": [round(mb, 1) for _, mb in series[::every]],
            "measured_minutes": round(len(series) * 5 / 60, 1)}


class Auditor:
    """Follows one stream's captions from seq 0, reconnecting with `since`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seqs: list[int] = []
        self.finals: set[int] = set()
        self.seen: dict[int, tuple[int, str]] = {}
        """seq -> (segment_id, message_kind), as received."""
        self.times: list[float] = []
        self.reconnects = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            since = self.seqs[-1] if self.seqs else 0
            try:
                async with websockets.connect(f"{self.url}&since={since}") as ws:
                    while not stop.is_set():
                        try:
                            msg = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                        except TimeoutError:
                            continue
                        if "seq" not in msg:
                            continue
                        # Withdraws and gap events take seq numbers too: all count for
                        # continuity, only captions for finals and silence.
                        is_final = msg.get("type") == "caption" and bool(msg["is_final"])
                        self.seqs.append(msg["seq"])
                        self.seen[msg["seq"]] = (msg.get("segment_id", 0),
                                                 message_kind(msg))
                        if msg.get("type") != "caption":
                            continue
                        self.times.append(time.time())
                        if is_final:
                            self.finals.add(msg["seq"])
            except (OSError, websockets.ConnectionClosed, websockets.InvalidStatus):
                self.reconnects += 1
                await asyncio.sleep(0.5)


class Warmup:
    """Keeps a process's RSS samples out until it is warm: the processes seen first are
    (the soak starts after a warm-up); a new pid of a kind (a replacement after a kill)
    once every stream has captioned again after it appeared, and `WARMUP_S` more."""

    def __init__(self, auditors: Any) -> None:
        self.auditors = list(auditors)
        self.born: dict[int, float] = {}
        self.warm: set[int] = set()
        self.first = True
        self.warmups_s: list[float] = []

    def filter(self, sample: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
        now = time.time()
        out = {}
        for kind, (pid, mb) in sample.items():
            if self.first:
                self.warm.add(pid)
            elif pid not in self.warm:
                born = self.born.setdefault(pid, now)
                captioning = all(any(t > born for t in a.times[-1:]) for a in self.auditors)
                if not (captioning and now - born >= WARMUP_S):
                    continue
                self.warm.add(pid)
                self.warmups_s.append(round(now - born, 1))
            out[kind] = (pid, mb)
        self.first = False
        return out


async def churn(base: str, streams: list[str], stop: asyncio.Event) -> int:
    """Clients that join, read a little and leave."""
    joined = 0
    while not stop.is_set():
        s = random.choice(streams)
        try:
            async with websockets.connect(f"{base}/v1/streams/{s}/captions?lang=en"):
                joined += 1
                await asyncio.sleep(random.uniform(0.5, 5.0))
        except (OSError, websockets.ConnectionClosed, websockets.InvalidStatus):
            await asyncio.sleep(1.0)
    return joined


async def soak(minutes: float, n_streams: int, fault_every_min: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="babelcast-soak-"))
    port = free_port()
    admin = secrets.token_urlsafe(32)
    sources = [AUDIO / "room-a.flac", AUDIO / "room-b.flac"]
    lines = ["event: soak", "engine: {kind: embedded, model: tiny.en, actors: 1, "
             f"streams_per_actor: {n_streams}}}", "streams:"]
    ids = [f"room-{i}" for i in range(n_streams)]
    for i, sid in enumerate(ids):
        lines.append(f"  - {{id: {sid}, source: \"{sources[i % 2]}\", loop: true, "
                     "language: en}")
    lines += [f"gateway: {{host: 127.0.0.1, port: {port}}}",
              f"redis: {{data_dir: \"{tmp / 'redis'}\"}}",
              "auth: {admin_token_env: SOAK_ADMIN, viewers: public}"]
    cfg = tmp / "soak.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    log = (tmp / "run.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, not awaited
        [sys.executable, "-m", "orchestrator.cli", "run", str(cfg), "--plain",
         "--duration", str(minutes * 60 + 600)], stdout=log, stderr=subprocess.STDOUT,
        cwd=ROOT, env={**os.environ, "SOAK_ADMIN": admin})
    base = f"http://127.0.0.1:{port}"
    ws_base = base.replace("http://", "ws://")
    result: dict[str, Any] = {"minutes": minutes, "streams": n_streams,
                              "fault_every_min": fault_every_min, "faults": [],
                              "faults_not_done": []}
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"babelcast run did not start; see {tmp / 'run.log'}")
                try:
                    if (await http.get("/healthz", timeout=2)).status_code == 200 and _rss_by_kind(
                            proc.pid).get("asr-actor"):
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
        stop = asyncio.Event()
        auditors = {s: Auditor(f"{ws_base}/v1/streams/{s}/captions?lang=en") for s in ids}
        tasks = [asyncio.create_task(a.run(stop)) for a in auditors.values()]
        churners = [asyncio.create_task(churn(ws_base, ids, stop)) for _ in range(4)]
        await asyncio.sleep(WARMUP_S)  # models loaded, first captions out
        warm = Warmup(auditors.values())
        rss_samples = [warm.filter(_rss_by_kind(proc.pid))]
        started = time.monotonic()
        next_fault = started + fault_every_min * 60
        fault_kind = "asr-actor"
        while time.monotonic() - started < minutes * 60:
            await asyncio.sleep(5)
            raw = _rss_by_kind(proc.pid)
            rss_samples.append(warm.filter(raw))
            # A fault needs time after it to be measured (silence, a warm replacement).
            if time.monotonic() >= next_fault and (
                    started + minutes * 60 - time.monotonic() >= FAULT_MARGIN_S):
                target = raw.get(fault_kind)
                at = time.time()
                pid = target[0] if target is not None else None
                if await asyncio.to_thread(kill_verified, pid):
                    result["faults"].append({"kind": fault_kind, "at": at, "pid": pid})
                else:
                    result["faults_not_done"].append({
                        "kind": fault_kind, "at": at,
                        "why": "no process found" if pid is None else "did not die"})
                fault_kind = "redis-server" if fault_kind == "asr-actor" else "asr-actor"
                next_fault += fault_every_min * 60
        ended = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        joined = sum(r for r in await asyncio.gather(*churners, return_exceptions=True)
                     if isinstance(r, int))
        # What the Stream holds, read back from seq 0, against what the clients saw live
        # and against the seq numbers the publisher issued.
        lost: dict[str, int] = {}
        gaps = dups = 0
        for sid, a in auditors.items():
            replay: list[dict[str, Any]] = []
            async with websockets.connect(f"{ws_base}/v1/streams/{sid}/captions?lang=en"
                                          "&since=0") as ws:
                last_seen = max(a.seqs, default=0)
                while not replay or replay[-1].get("seq", 0) < last_seen:
                    try:  # the streams go on: read up to what the auditor saw
                        msg = json.loads(await asyncio.wait_for(ws.recv(), 5.0))
                    except TimeoutError:
                        break
                    if "seq" in msg:
                        replay.append(msg)
            stream = {m["seq"]: (m.get("segment_id", 0), message_kind(m)) for m in replay}
            for k, v in finals_lost(a.seen, stream, min(stream, default=1)).items():
                lost[k] = lost.get(k, 0) + v
            audit = seq_audit(a.seqs)
            gaps += audit["missing"]
            dups += audit["repeats"]
        for fault in result["faults"]:
            silences: list[float] = []
            for a in auditors.values():
                after = [t for t in a.times if t > fault["at"]]
                silences.append(round(after[0] - fault["at"], 1) if after else float("inf"))
            worst = max(silences, default=float("inf"))
            fault["longest_caption_silence_s"] = None if worst == float("inf") else worst
        every = max(1, int(SERIES_EVERY_S / 5))  # samples are 5 s apart
        growth = {role: g for role in dict.fromkeys(KINDS.values())
                  if (g := role_growth(rss_samples, role, every)) is not None}
        result.update(ran_minutes=round((ended - started) / 60, 1), rss=growth,
                      replacement_warmups_s=warm.warmups_s, **lost,
                      seqs_missed_by_clients=gaps, seq_repeats=dups,
                      finals_seen=sum(len(a.finals) for a in auditors.values()),
                      auditor_reconnects=sum(a.reconnects for a in auditors.values()),
                      churn_clients=joined)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--fault-every", type=float, default=15.0, metavar="MIN",
                   help="minutes between faults (ASR actor kill, Redis restart, in turn)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = asyncio.run(soak(args.minutes, args.streams, args.fault_every))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
