"""Delivery benchmark: scripted captions → Redis → gateway → WebSocket clients, next to raw
Redis pub/sub round trips on the same server in the same run.

    python -m bench.delivery --json [--streams 200] [--clients 2000] [--seconds 30]
                             [--gateway-workers N] [--repeat 1] [--plot FILE]
                             [--profile-gateway FILE]

It measures delivery, not recognition: no audio and no engine. A `ScriptedCaptionSource`
per stream stands in for the ASR side and publishes, through `RedisBus.publish_caption`
(XADD + PUBLISH, as an ASR actor does), `--rate` deltas per second: partials that grow by
a word each, and a final every `--final-every` seconds. Each part runs in its own process,
so that their CPU is counted apart:

- redis-server (`LocalRedisServer`);
- the gateway: the real `create_app`, served by uvicorn with the config and process
  settings `babelcast run` uses, on plain asyncio as there (`--gateway-loop uvloop` to
  compare); with `--gateway-workers N` (`gateway.workers`), N such processes on the port;
- the publisher (every stream's scripted source, one Redis client);
- `--client-procs` processes (aiohttp) holding the `--clients` caption WebSockets, client i
  on stream i mod N. Each connects with `since=0` before publishing starts, so it is owed
  every publication of its stream, and reconnects from its last seq if dropped, as the
  overlay does. They offer permessage-deflate, as browsers do (`--no-deflate`: not);
- the Redis probe: PUBLISH → message on one channel at the publisher's total rate with a
  payload of the same size, read as the gateway's hub reads (redis-py pub/sub,
  `get_message`, plain asyncio). It runs alone for `--idle-probe` seconds, then during
  the load.

Latency is a client's receipt time minus the `emit_time` that the publisher stamps right
before publishing (one machine, one clock). After the last publication the clients stop
once nothing has come for `--drain` seconds, so a backlog shows as late, not lost. JSON:

- `p50_ms`, `p99_ms`, `final_p99_ms`, `max_ms`: publish → client receipt, every message
  (finals only);
- `redis_rtt_p50_ms`, `redis_rtt_p99_ms`: the probe during the load; `ratio_p99` is
  `p99_ms / redis_rtt_p99_ms`; `redis_rtt_idle_*`: the probe before the load;
- `published`: segments published; `messages`: caption messages received by clients;
  `offered_per_s` / `delivered_per_s`: messages owed to clients per second of load, and
  those received by its end; `latency_trend_ms_per_s`: slope of the per-second median
  latency, about 0 when the gateway keeps up and large when a backlog grows;
- `interims_dropped`: interims the hub's slow-client policy dropped (its counter);
  `missing_interims`: interims clients did not get; `lost`: finals clients did not get
  plus missing interims beyond what the policy dropped (the policy never drops finals);
  `duplicates`, `out_of_order`, `clients_failed`, `reconnects` should be 0;
  `setup_retries`: handshakes refused before the load (see `--connect-burst`);
- `cpu_percent`: per process (100 = one core) over the load, `gateway` summed over its
  `gateway_workers` processes (`gateway_worker_cpu_percent`: each); `host_cpu_percent`:
  the whole machine, other users included (100 × cores at most);
- `deliveries_per_s_per_worker`: `delivered_per_s` / workers (a worker's capacity when the
  gateway is saturated: its CPU near 100); `deliveries_per_gateway_cpu_s`: messages per
  CPU-second the gateway processes used, which host load does not change;
- `gateway_loop_lag_*`: how late a 5 ms sleep in the gateway's loop woke up;
  `gateway_gc_*`: its cyclic GC pauses; `publisher_lag_p99_ms`: how late the scripted
  source published against its schedule.

With `--repeat R` the fields are medians over R fresh runs (every ratio taken within its
own run) and `runs` lists each run.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import multiprocessing
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.delivery_procs import (  # noqa: E402
    LANG,
    ScriptedCaptionSource,
    _clients_main,
    _gateway_main,
    _probe_main,
    _publisher_main,
)
from bench.delivery_stats import (  # noqa: E402
    _median,
    _ms,
    _pct_ms,
    _read_counter,
    _trend_ms_per_s,
)
from bench.report import emit  # noqa: E402
from bench.system import CLK_TCK  # noqa: E402

SLOW_DROPS_METRIC = "babelcast_gateway_slow_client_drops_total"


# ---- the run --------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _host_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of the whole machine, every core."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:9]]
    return sum(cpu) - cpu[3] - cpu[4], sum(cpu)


@dataclass
class Params:
    streams: int
    clients: int
    seconds: float
    rate: float
    final_every_s: float
    client_procs: int
    idle_probe_s: float
    drain_s: float
    drain_max_s: float = 120.0
    gateway_loop: str = "asyncio"
    deflate: bool = True
    connect_burst: int = 10
    probe_rate: float | None = None
    profile_gateway: str | None = None
    gateway_workers: int = 1


def _read_counter_all_workers(base: str, admin_token: str, name: str,
                              workers: int) -> float | None:
    """The sum of a counter over every gateway worker: each process serves its own
    /metrics, and which one answers is the kernel's pick per connection, so connect
    afresh until every worker (its `X-Babelcast-Worker` header) has answered."""
    import httpx

    if workers == 1:
        with httpx.Client(headers={"Authorization": f"Bearer {admin_token}"}) as http:
            return _read_counter(http.get(f"{base}/metrics").text, name)
    seen: dict[str, float | None] = {}
    for _ in range(40 * workers):
        with httpx.Client(headers={"Authorization": f"Bearer {admin_token}"}) as http:
            r = http.get(f"{base}/metrics")
        seen[r.headers.get("x-babelcast-worker", "?")] = _read_counter(r.text, name)
        if len(seen) == workers:
            break
    if len(seen) < workers:
        return None
    return sum(v or 0.0 for v in seen.values())


@contextlib.contextmanager
def _processes() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGINT)
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def run_once(prm: Params) -> dict[str, Any]:
    import subprocess

    import httpx

    import orchestrator.gateway.hub as hub_module
    from orchestrator.redis_server import LocalRedisServer, free_port

    ctx = multiprocessing.get_context("spawn")
    stream_ids = [f"s{i:03d}" for i in range(prm.streams)]
    redis_server = LocalRedisServer()
    redis_url = redis_server.start()
    redis_pid = redis_server._proc.pid if redis_server._proc else 0
    admin_token = secrets.token_urlsafe(32)  # /metrics needs the admin token
    profiler: subprocess.Popen[bytes] | None = None
    try:
        with _processes() as procs:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            gw_conn, gw_theirs = ctx.Pipe()
            gateway = ctx.Process(target=_gateway_main, name="gateway",
                                  args=(redis_url, stream_ids, port, prm.clients,
                                        prm.gateway_loop, gw_theirs, admin_token,
                                        prm.gateway_workers))
            gateway.start()
            gw_theirs.close()
            procs.append(gateway)
            deadline = time.monotonic() + 60
            with httpx.Client(base_url=base,
                              headers={"Authorization": f"Bearer {admin_token}"}) as http:
                while True:
                    try:
                        if http.get("/healthz", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if not gateway.is_alive() or time.monotonic() > deadline:
                        raise RuntimeError("the gateway did not start")
                    time.sleep(0.2)
            if not gw_conn.poll(120):
                raise RuntimeError("the gateway's workers did not start")
            worker_pids: list[int] = gw_conn.recv()["pids"]
            drops_before = _read_counter_all_workers(base, admin_token, SLOW_DROPS_METRIC,
                                                     prm.gateway_workers)

            client_conns: list[Connection] = []
            for k in range(prm.client_procs):
                indices = list(range(k, prm.clients, prm.client_procs))
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_clients_main, name=f"clients-{k}",
                                args=(base, stream_ids, indices, prm.deflate,
                                      prm.connect_burst, theirs))
                p.start()
                theirs.close()  # so that a dead child reads as EOFError, not a hang
                procs.append(p)
                client_conns.append(mine)
            connected = failed_connect = 0
            for c in client_conns:
                _, ok, bad = c.recv()
                connected += ok
                failed_connect += bad

            probe_rate = prm.probe_rate or prm.rate * prm.streams
            idle_start = time.time() + 1.0
            load_start = idle_start + prm.idle_probe_s + 0.5
            load_end = load_start + prm.seconds
            phases = [(load_start, load_end)]
            if prm.idle_probe_s > 0:
                phases.insert(0, (idle_start, idle_start + prm.idle_probe_s))
            payload = len(_sample_payload(prm))
            for c in client_conns:
                c.send(load_start)
            probe_conn, probe_theirs = ctx.Pipe()
            probe = ctx.Process(target=_probe_main, name="probe",
                                args=(redis_url, probe_rate, payload, phases, probe_theirs))
            probe.start()
            probe_theirs.close()
            procs.append(probe)
            pub_conn, pub_theirs = ctx.Pipe()
            publisher = ctx.Process(target=_publisher_main, name="publisher",
                                    args=(redis_url, stream_ids, prm.rate, prm.final_every_s,
                                          load_start, prm.seconds, pub_theirs))
            publisher.start()
            pub_theirs.close()
            procs.append(publisher)

            time.sleep(max(0.0, load_start - time.time()))
            if prm.profile_gateway:
                profiler = _start_profiler(gateway.pid or 0, prm.seconds, prm.profile_gateway)
            watched: dict[str, list[int | None]] = {
                "gateway": [gateway.pid, *worker_pids], "publisher": [publisher.pid],
                "redis_probe": [probe.pid], "redis_server": [redis_pid],
                "clients": [p.pid for p in procs if p.name.startswith("clients")]}
            cpu0 = {k: sum(_cpu_s(p or 0) for p in v) for k, v in watched.items()}
            gw_pids = watched["gateway"]
            gw_cpu0 = [_cpu_s(p or 0) for p in gw_pids]
            host0, t0 = _host_ticks(), time.monotonic()
            published = pub_conn.recv()
            cpu1 = {k: sum(_cpu_s(p or 0) for p in v) for k, v in watched.items()}
            gw_cpu1 = [_cpu_s(p or 0) for p in gw_pids]
            host1, t1 = _host_ticks(), time.monotonic()
            for c in client_conns:
                c.send((prm.drain_s, prm.drain_max_s))
            got = [c.recv() for c in client_conns]
            drained = time.time() - load_end
            drops_after = _read_counter_all_workers(base, admin_token, SLOW_DROPS_METRIC,
                                                    prm.gateway_workers)
            probed = probe_conn.recv()
            stopping = time.monotonic()
            os.kill(gateway.pid or 0, signal.SIGINT)
            gw_diag = gw_conn.recv() if gw_conn.poll(60) else {"gc": [], "lag": [],
                                                                "gc_threshold": None,
                                                                "ws_deflate": None}
            shutdown_s = time.monotonic() - stopping
            gateway.join(30)  # its exit handlers (Ray's, where run.py is imported) finish
    finally:
        if profiler is not None:
            profiler.wait(30)
        redis_server.stop()

    wall = t1 - t0
    finals: dict[str, bytes] = published["finals"]
    emitted = array.array("d")
    lat = array.array("d")
    msg_final = bytearray()
    missing_finals = missing_interims = duplicates = out_of_order = 0
    for part in got:
        emitted.frombytes(part["emitted"])
        lat.frombytes(part["lat"])
        msg_final += part["finals"]
        for stream, got_seqs, dup, ooo in part["clients"]:
            duplicates += dup
            out_of_order += ooo
            for seq0, final in enumerate(finals[stream_ids[stream]]):
                if seq0 >= len(got_seqs) or not got_seqs[seq0]:
                    if final:
                        missing_finals += 1
                    else:
                        missing_interims += 1
    all_lat = list(lat)
    expected = sum(len(finals[stream_ids[i % prm.streams]]) for i in range(prm.clients))
    lat_final = [v for v, f in zip(lat, msg_final, strict=True) if f]
    window = (load_start, load_end + drained)
    loop_lag = [v for t, v in gw_diag["lag"] if window[0] <= t <= window[1]]
    gc_load = [(v, cpu, gen) for t, v, cpu, gen in gw_diag["gc"] if window[0] <= t <= window[1]]
    dropped = (None if drops_after is None else int(drops_after - (drops_before or 0)))
    lost = missing_finals + max(0, missing_interims - (dropped or 0))
    rtts = probed["rtt"]
    load_rtt = rtts[-1]
    delivered_per_s = sum(1 for e, v in zip(emitted, lat, strict=True)
                          if e + v <= load_end) / prm.seconds
    p99 = _pct_ms(all_lat, 0.99)
    rtt_p99 = _pct_ms(load_rtt, 0.99)
    result: dict[str, Any] = {
        "streams": prm.streams, "clients": prm.clients, "seconds": prm.seconds,
        "rate_per_stream": prm.rate, "final_every_s": prm.final_every_s,
        "client_procs": prm.client_procs,
        "p50_ms": _pct_ms(all_lat, 0.5), "p99_ms": p99,
        "final_p99_ms": _pct_ms(lat_final, 0.99),
        "max_ms": _ms(max(all_lat)) if all_lat else None,
        "redis_rtt_p50_ms": _pct_ms(load_rtt, 0.5), "redis_rtt_p99_ms": rtt_p99,
        "ratio_p99": round(p99 / rtt_p99, 2) if p99 and rtt_p99 else None,
        "redis_rtt_idle_p50_ms": _pct_ms(rtts[0], 0.5) if len(rtts) > 1 else None,
        "redis_rtt_idle_p99_ms": _pct_ms(rtts[0], 0.99) if len(rtts) > 1 else None,
        "published": sum(len(f) for f in finals.values()),
        "messages": len(all_lat),
        "offered_per_s": round(expected / prm.seconds),
        "delivered_per_s": round(delivered_per_s),
        "latency_trend_ms_per_s": _trend_ms_per_s(emitted, lat, load_start),
        "expected": expected,
        "lost": lost, "missing_finals": missing_finals, "missing_interims": missing_interims,
        "interims_dropped": dropped, "duplicates": duplicates, "out_of_order": out_of_order,
        "clients_connected": connected,
        "clients_failed": failed_connect,
        "reconnects": sum(p["reconnects"] for p in got),
        "setup_retries": sum(p["setup_retries"] for p in got),
        "client_errors": sorted({e for p in got for e in p["errors"]}),
        "cpu_percent": {k: round(100 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu0},
        "gateway_workers": prm.gateway_workers,
        "gateway_worker_cpu_percent": [round(100 * (b - a) / wall, 1)
                                       for a, b in zip(gw_cpu0, gw_cpu1, strict=True)],
        # Deliveries by the load's end, per worker process; and per CPU-second the
        # gateway processes used, which does not depend on how busy the host was.
        "deliveries_per_s_per_worker": round(delivered_per_s / prm.gateway_workers),
        "deliveries_per_gateway_cpu_s": round(delivered_per_s * wall / max(
            1e-9, cpu1["gateway"] - cpu0["gateway"])),
        "host_cpu_percent": round(100 * (os.cpu_count() or 1) * (host1[0] - host0[0]) /
                                  max(1, host1[1] - host0[1]), 1),
        "cores": os.cpu_count(),
        "gateway_loop": prm.gateway_loop, "client_deflate": prm.deflate,
        "gateway_ws_deflate": gw_diag["ws_deflate"], "gateway_gc_threshold": gw_diag[
            "gc_threshold"],
        "gateway_loop_lag_p99_ms": _pct_ms(loop_lag, 0.99),
        "gateway_loop_lag_max_ms": _ms(max(loop_lag)) if loop_lag else None,
        # 0 when no collection ran during the load; None when the gateway did not report.
        "gateway_gc_pause_max_ms": _ms(max((v for v, _, _ in gc_load), default=0.0))
        if gw_diag["gc_threshold"] else None,
        "gateway_gc_cpu_max_ms": _ms(max((c for _, c, _ in gc_load), default=0.0))
        if gw_diag["gc_threshold"] else None,
        "gateway_gc_full_per_s": round(sum(1 for _, _, g in gc_load if g == 2) / wall, 2),
        "gateway_gc_s_per_s": round(sum(c for _, c, _ in gc_load) / wall, 4),
        "publisher_lag_p99_ms": published["lag_p99_ms"],
        "drain_s": round(drained, 1), "gateway_shutdown_s": round(shutdown_s, 1),
        "probe_rate": probe_rate, "probe_payload_bytes": payload,
        "gateway_code": str(Path(hub_module.__file__).resolve().parent),
        "_lat": all_lat, "_emitted": list(emitted), "_rtt": load_rtt,
        "_rtt_idle": rtts[0] if len(rtts) > 1 else [], "_load_start": load_start,
        "_rtt_sent": probed["sent"][-1],
    }
    return result


def _sample_payload(prm: Params) -> str:
    from workers.bus import caption_to_json

    src = ScriptedCaptionSource("s000", LANG, max(1, round(prm.final_every_s * prm.rate)),
                                1 / prm.rate)
    segs = [src.next(time.time()) for _ in range(src.deltas_per_final)]
    return caption_to_json(segs[len(segs) // 2])


def _start_profiler(pid: int, seconds: float, out: str) -> Any:
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    fmt = "raw" if out.endswith(".txt") else "speedscope" if out.endswith(".json") else \
        "flamegraph"
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200",
                             "--nonblocking", "-f", fmt, "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def plot(path: str, runs: list[dict[str, Any]], prm: Params) -> None:
    """Left: CDFs of delivery latency and of the Redis probe. Right: p50 and p99 per second
    of the load, by publish time, so that a transient shows apart from a steady state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (cdf, series) = plt.subplots(1, 2, figsize=(13, 4.5))
    for k, r in enumerate(runs):
        tag = f" (run {k + 1})" if len(runs) > 1 else ""
        for key, label, style in (("_lat", "publish → WebSocket client", "-"),
                                  ("_rtt", "Redis PUBLISH → message, same load", "--"),
                                  ("_rtt_idle", "Redis PUBLISH → message, idle", ":")):
            values = np.sort(np.asarray(r[key]) * 1000)
            if values.size:
                cdf.plot(values, np.arange(1, values.size + 1) / values.size, style,
                         label=label + tag, color=f"C{k}" if len(runs) > 1 else None)
        for times, key, label, style in (("_emitted", "_lat", "client", "-"),
                                         ("_rtt_sent", "_rtt", "Redis probe", "--")):
            t = np.asarray(r[times]) - r["_load_start"]
            v = np.asarray(r[key]) * 1000
            bins = np.floor(t).astype(int)
            xs = np.unique(bins)
            for q, marker in ((50, "."), (99, "^")) if len(runs) == 1 else ((99, "^"),):
                ys = [np.percentile(v[bins == x], q) for x in xs]
                series.plot(xs + 0.5, ys, style, marker=marker, ms=3,
                            label=f"{label} p{q}{tag}", color=f"C{k}" if len(runs) > 1 else None)
    cdf.set_xscale("log")
    cdf.axhline(0.99, color="grey", lw=0.6, ls=":")
    cdf.set_xlabel("latency (ms, log)")
    cdf.set_ylabel("fraction of messages")
    cdf.legend(fontsize=6, loc="lower right")
    series.set_yscale("log")
    series.set_xlabel("seconds into the load (publish time)")
    series.set_ylabel("latency per second (ms, log)")
    series.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"bench.delivery: {prm.streams} streams, {prm.clients} clients, "
                 f"{prm.rate:g} deltas/s per stream, {prm.seconds:g} s, gateway on "
                 f"{prm.gateway_loop}")
    fig.savefig(path, dpi=100, bbox_inches="tight")


def _workers(asked: int | None) -> int:
    from orchestrator.config import GatewayConfig

    cfg = GatewayConfig() if asked is None else GatewayConfig(workers=asked)  # its checks
    return cfg.worker_count()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=12.5, help="caption deltas/s per stream")
    ap.add_argument("--final-every", type=float, default=2.0, help="seconds between finals")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--idle-probe", type=float, default=3.0,
                    help="seconds of Redis probe alone before the load (0: none)")
    ap.add_argument("--drain", type=float, default=2.0,
                    help="after the last publication, the clients stop once nothing came for "
                         "this long (at most --drain-max seconds)")
    ap.add_argument("--drain-max", type=float, default=120.0)
    ap.add_argument("--gateway-workers", type=int, default=None,
                    help="gateway processes on the port (gateway.workers; default: what "
                         "`babelcast run` uses by default)")
    ap.add_argument("--gateway-loop", default="asyncio", choices=["asyncio", "uvloop"],
                    help="the gateway's event loop (`babelcast run` uses asyncio)")
    ap.add_argument("--no-deflate", dest="deflate", action="store_false",
                    help="clients do not offer permessage-deflate (browsers and `websockets` "
                         "do, so they do by default)")
    ap.add_argument("--connect-burst", type=int, default=10,
                    help="handshakes in flight at a time per client process")
    ap.add_argument("--probe-rate", type=float, default=None,
                    help="Redis probe messages/s (default: the publisher's total rate)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a latency CDF (PNG) here")
    ap.add_argument("--profile-gateway", default=None,
                    help="py-spy record the gateway during the load into this file (.svg "
                         "flamegraph, .txt collapsed stacks, .json speedscope)")
    args = ap.parse_args()
    prm = Params(args.streams, args.clients, args.seconds, args.rate, args.final_every,
                 max(1, min(args.client_procs, args.clients)), args.idle_probe, args.drain,
                 args.drain_max, args.gateway_loop, args.deflate, args.connect_burst,
                 args.probe_rate, args.profile_gateway, _workers(args.gateway_workers))
    runs = [run_once(prm) for _ in range(max(1, args.repeat))]
    if args.plot:
        plot(args.plot, runs, prm)
    for r in runs:
        for key in [k for k in r if k.startswith("_")]:
            r.pop(key)
    result = _median(runs) if len(runs) > 1 else runs[0]
    if len(runs) > 1:
        result["repeat"] = len(runs)
        result["runs"] = [{k: r[k] for k in ("p50_ms", "p99_ms", "redis_rtt_p99_ms",
                                             "ratio_p99", "lost", "interims_dropped",
                                             "cpu_percent", "gateway_worker_cpu_percent",
                                             "host_cpu_percent")} for r in runs]
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
