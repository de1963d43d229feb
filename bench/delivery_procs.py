"""The processes a delivery run starts (bench.delivery), each in its own so that its
CPU is counted apart: the gateway as `babelcast run` serves it, the publisher (every
stream's scripted caption source), the Redis probe, and the WebSocket clients."""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.delivery_stats import _pct_ms
from workers.events import CaptionSegment

LANG = "en"
PROBE_CHANNEL = "bench:probe"
_SCRIPT = ("the speaker walks to the front of the hall and thanks everyone for coming so "
           "early on a rainy morning then opens the first slide about caption delivery and "
           "why latency matters for people who follow the talk with their eyes").split()


# ---- the scripted source --------------------------------------------------------------------
@dataclass
class ScriptedCaptionSource:
    """Stands in for the ASR side of one stream: a fixed script of words published as partials
    that grow by one word per delta and a final every `deltas_per_final` deltas. The text
    means nothing: this drives delivery, it never stands in for recognition."""

    stream: str
    lang: str
    deltas_per_final: int
    delta_s: float
    seq: int = 0
    segment_id: int = 0
    revision: int = 0
    word: int = 0
    audio_s: float = 0.0

    def next(self, now: float) -> CaptionSegment:
        self.seq += 1
        words = [_SCRIPT[(self.word + k) % len(_SCRIPT)] for k in range(self.revision + 1)]
        text = " ".join(words)
        final = self.revision + 1 >= self.deltas_per_final
        seg = CaptionSegment(
            stream=self.stream, lang=self.lang, segment_id=self.segment_id, seq=self.seq,
            revision=self.revision, is_final=final, text=text,
            stable_prefix_len=max(0, len(text) - 12), lines=_two_lines(text),
            audio_start_s=self.audio_s, audio_end_s=self.audio_s + self.delta_s * (
                self.revision + 1), audio_end_wall=now, emit_time=now)
        if final:
            self.audio_s = seg.audio_end_s
            self.word += self.revision + 1
            self.segment_id += 1
            self.revision = 0
        else:
            self.revision += 1
        return seg


def _two_lines(text: str, width: int = 42) -> tuple[str, ...]:
    lines: list[str] = []
    for w in text.split():
        if lines and len(lines[-1]) + 1 + len(w) <= width:
            lines[-1] += " " + w
        else:
            lines.append(w)
    return tuple(lines[-2:])


# ---- child processes ------------------------------------------------------------------------
def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need + 256
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _gateway_main(redis_url: str, stream_ids: list[str], port: int, clients: int, loop: str,
                  conn: Connection, admin_token: str, workers: int = 1) -> None:
    """The gateway as `babelcast run` builds it (orchestrator/run.py), alone in its process,
    on plain asyncio as there (or uvloop, to see what it would change). Beside it, two
    diagnostics that report after it stops: the cyclic GC's pauses and the event loop's
    lag (how late a 5 ms sleep wakes up), each with its wall time. With `workers` > 1,
    as `gateway.workers` makes `babelcast run` do: this process is worker 0 and starts the
    others (orchestrator.gateway.workers) on the same port; the diagnostics are worker
    0's, and the other workers' pids are sent first so that their CPU is counted."""
    import gc

    import uvicorn

    from orchestrator.gateway.access import GatewaySecurity
    from orchestrator.gateway.app import GatewayStream, create_app
    from orchestrator.gateway.auth import Authenticator, GatewaySecrets
    from orchestrator.gateway.security_config import LimitsConfig
    from workers.events import StreamOptions

    _raise_nofile(clients)
    # Delivery, not admission, is measured: captions are public (`auth.viewers: public`,
    # still a check per connection) and every client comes from 127.0.0.1.
    limits = LimitsConfig(max_ws_per_ip=clients + 16, max_viewers_per_stream=clients + 16,
                          max_connections=2 * clients + 64)
    security = GatewaySecurity(Authenticator(GatewaySecrets(admin=admin_token),
                                             viewers_public=True), (), limits)
    streams = [GatewayStream(StreamOptions(stream_id=s, name=s, source="scripted",
                                           language=LANG), "scripted") for s in stream_ids]
    logging.basicConfig(level=logging.WARNING)  # as `babelcast` does: the hub's warnings show
    app = create_app(redis_url, streams, "bench delivery", (), security=security)
    # Served as `babelcast run` serves it: its uvicorn config and process settings, where
    # orchestrator/run.py has them as functions; else what run_event builds inline.
    try:
        from orchestrator.run import gateway_config  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on")
    else:
        config = (gateway_config(app, "127.0.0.1", port, limits) if workers == 1 else
                  gateway_config(app, "127.0.0.1", port, limits, worker=0))
    with contextlib.suppress(ImportError):
        from orchestrator.run import tune_gc  # type: ignore[attr-defined,unused-ignore]

        tune_gc()
    server = uvicorn.Server(config)
    gc_pauses: list[tuple[float, float, float, int]] = []  # wall time, pause, its CPU, gen
    lags: list[tuple[float, float]] = []
    gc_start = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[:] = time.perf_counter(), time.thread_time()
        else:
            gc_pauses.append((time.time(), time.perf_counter() - gc_start[0],
                              time.thread_time() - gc_start[1], info["generation"]))

    async def watch_lag() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append((time.time(), time.perf_counter() - t - 0.005))

    async def serve() -> None:
        watcher = asyncio.create_task(watch_lag())
        others = None
        try:
            if workers == 1:
                conn.send({"pids": []})
                await server.serve()
                return
            from orchestrator.gateway.server import listen_socket
            from orchestrator.gateway.workers import GatewayWorkers, WorkerSpec

            sock = listen_socket("127.0.0.1", port, reuse_port=True)
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                if task.done():
                    break
                await asyncio.sleep(0.05)
            others = GatewayWorkers(WorkerSpec(redis_url, streams, "bench delivery", (),
                                               security, None, "127.0.0.1", port), workers)
            await others.start()
            conn.send({"pids": list(others.pids.values())})
            await task
        finally:
            watcher.cancel()
            if others is not None:
                await others.aclose()

    gc.callbacks.append(on_gc)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT that stops it
        if loop == "uvloop":
            import uvloop

            uvloop.run(serve())
        else:
            asyncio.run(serve())
    conn.send({"gc": gc_pauses, "lag": lags, "gc_threshold": gc.get_threshold(),
               "ws_deflate": config.ws_per_message_deflate})


def _publisher_main(redis_url: str, stream_ids: list[str], rate: float, final_every_s: float,
                    start_at: float, seconds: float, conn: Connection) -> None:
    coro = _publish(redis_url, stream_ids, rate, final_every_s, start_at, seconds)
    try:
        import uvloop  # the scripted source is harness: let it cost little
    except ImportError:
        conn.send(asyncio.run(coro))
    else:
        conn.send(uvloop.run(coro))


async def _publish(redis_url: str, stream_ids: list[str], rate: float, final_every_s: float,
                   start_at: float, seconds: float) -> dict[str, Any]:

    from workers.bus import RedisBus, connect_redis

    # One publication in flight per stream; redis-py >= 6 raises past its pool (100 by default).
    redis = connect_redis(redis_url, max_connections=len(stream_ids) + 8)
    bus = RedisBus(redis)
    period = 1.0 / rate
    finals: dict[str, bytearray] = {}  # per stream, byte seq-1: 1 for a final
    lags: list[float] = []

    async def one(i: int, stream: str) -> None:
        src = ScriptedCaptionSource(stream, LANG, max(1, round(final_every_s * rate)), period)
        flags = finals[stream] = bytearray()
        # Streams start spread over one period so that publications are not in step.
        due = start_at + period * i / len(stream_ids)
        while due < start_at + seconds:
            await asyncio.sleep(max(0.0, due - time.time()))
            now = time.time()
            lags.append(now - due)
            seg = src.next(now)
            await bus.publish_caption(seg)
            flags.append(1 if seg.is_final else 0)
            due += period

    # Open the pool's connections before the clock starts: a first publish that connects
    # would count the connect as delivery latency.
    await asyncio.gather(*(redis.ping() for _ in stream_ids))
    try:
        await asyncio.gather(*(one(i, s) for i, s in enumerate(stream_ids)))
    finally:
        await redis.aclose()
    return {"finals": {s: bytes(f) for s, f in finals.items()},
            "lag_p99_ms": _pct_ms(lags, 0.99)}


def _probe_main(redis_url: str, rate: float, payload_bytes: int, phases: list[tuple[float, float]],
                conn: Connection) -> None:
    conn.send(asyncio.run(_probe(redis_url, rate, payload_bytes, phases)))


async def _probe(redis_url: str, rate: float, payload_bytes: int,
                 phases: list[tuple[float, float]]) -> dict[str, list[list[float]]]:
    """PUBLISH → message round trips (seconds) in each (start, end) wall-clock phase. The
    publishing side is spread like the scripted sources (senders staggered over a period);
    the reading side reads like the gateway's hub."""
    from workers.bus import connect_redis

    pub = connect_redis(redis_url)
    sub = connect_redis(redis_url)
    pubsub = sub.pubsub()
    await pubsub.subscribe(PROBE_CHANNEL)
    pad = "x" * max(0, payload_bytes - 40)
    rtts: list[list[float]] = [[] for _ in phases]
    sent: list[list[float]] = [[] for _ in phases]

    async def read() -> None:
        while True:
            msg = await pubsub.get_message(timeout=1.0)
            if msg is None or msg["type"] != "message":
                continue
            now = time.time()
            data = json.loads(msg["data"])
            rtts[data["p"]].append(now - data["t"])
            sent[data["p"]].append(data["t"])

    senders = 20

    async def send(k: int) -> None:
        period = senders / rate
        for p, (start, end) in enumerate(phases):
            due = start + period * k / senders
            while due < end:
                await asyncio.sleep(max(0.0, due - time.time()))
                await pub.publish(PROBE_CHANNEL, json.dumps({"p": p, "t": time.time(),
                                                             "pad": pad}))
                due += period

    reader = asyncio.create_task(read())
    await asyncio.gather(*(pub.ping() for _ in range(senders)))  # connected before the clock
    try:
        await asyncio.gather(*(send(k) for k in range(senders)))
        await asyncio.sleep(1.0)  # the last round trips land
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await pubsub.aclose()
        await sub.aclose()
        await pub.aclose()
    return {"rtt": rtts, "sent": sent}


@dataclass
class _Client:
    stream: int
    got: bytearray = field(default_factory=bytearray)  # byte seq-1: 1 once received
    duplicates: int = 0
    out_of_order: int = 0
    last_seq: int = 0


def _clients_main(base: str, stream_ids: list[str], indices: list[int], deflate: bool,
                  burst: int, conn: Connection) -> None:
    _raise_nofile(len(indices))
    try:
        import uvloop  # the measuring side should cost as little as it can
    except ImportError:
        asyncio.run(_clients(base, stream_ids, indices, deflate, burst, conn))
    else:
        uvloop.run(_clients(base, stream_ids, indices, deflate, burst, conn))


async def _clients(base: str, stream_ids: list[str], indices: list[int], deflate: bool,
                   burst: int, conn: Connection) -> None:
    # aiohttp rather than websockets here: its reader is compiled, and the clients share
    # the machine with the gateway they measure (about 12 µs a message against 25).
    import aiohttp

    emitted = array.array("d")  # per message received: its emit_time,
    lat = array.array("d")  # publish → receipt (seconds),
    finals = bytearray()  # and 1 for a final
    clients = [_Client(i % len(stream_ids)) for i in indices]
    up = asyncio.Event()
    connected = failed = setup_retries = reconnects = 0
    errors: list[str] = []
    load_start = float("inf")
    last_rx = time.time()
    # Handshakes in flight at a time: each makes the gateway read Redis, and redis-py's
    # default pool raises past 100 connections instead of waiting (the client retries and
    # `setup_retries` counts it).
    gate = asyncio.Semaphore(burst)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def handle(c: _Client, raw: str, now: float) -> None:
        nonlocal last_rx
        last_rx = now
        msg = json.loads(raw)
        if msg.get("type") != "caption":
            errors.append(f"server: {msg.get('code')}")
            return
        seq = msg["seq"]
        emitted.append(msg["emit_time"])
        lat.append(now - msg["emit_time"])
        finals.append(msg["is_final"])
        if seq > len(c.got):
            c.got.extend(bytes(seq - len(c.got)))
        if c.got[seq - 1]:
            c.duplicates += 1
        c.got[seq - 1] = 1
        if seq < c.last_seq:
            c.out_of_order += 1
        c.last_seq = max(c.last_seq, seq)

    async def client(c: _Client) -> None:
        nonlocal connected, failed, setup_retries, reconnects
        first = True
        for _ in range(20):
            # Like the overlay: (re)connect from the last seq seen; since=0 at first, so a
            # client that connects late still gets everything of its stream.
            url = (base.replace("http://", "ws://") + f"/v1/streams/{stream_ids[c.stream]}"
                   f"/captions?lang={LANG}&since={c.last_seq}")
            try:
                async with gate:
                    # autoping on: uvicorn pings every 20 s and closes (1011) a client that
                    # does not answer, and browsers answer.
                    ws = await session.ws_connect(url, max_msg_size=0,
                                                  compress=15 if deflate else 0,
                                                  timeout=aiohttp.ClientWSTimeout(ws_close=1))
                if first:
                    first = False
                    connected += 1
                    if connected + failed == len(clients):
                        up.set()
                async with ws:
                    async for m in ws:
                        if m.type == aiohttp.WSMsgType.TEXT:
                            handle(c, m.data, time.time())
                    errors.append(f"closed {ws.close_code}")
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                errors.append(type(exc).__name__)
            if time.time() >= load_start:
                reconnects += 1
            else:
                setup_retries += 1
            await asyncio.sleep(0.2)
        if first:
            failed += 1
            if connected + failed == len(clients):
                up.set()

    tasks = [asyncio.create_task(client(c)) for c in clients]
    await up.wait()
    conn.send(("ready", connected, failed))
    load_start = await asyncio.to_thread(conn.recv)
    quiet_s, max_s = await asyncio.to_thread(conn.recv)  # the publisher is done
    # Drained when nothing came for quiet_s: a backlog still in the gateway is late, not lost.
    for _ in range(int(max_s * 10)):
        if time.time() - last_rx >= quiet_s:
            break
        await asyncio.sleep(0.1)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    conn.send({"emitted": emitted.tobytes(), "lat": lat.tobytes(), "finals": bytes(finals),
               "clients": [(c.stream, bytes(c.got), c.duplicates, c.out_of_order)
                           for c in clients],
               "failed": failed, "setup_retries": setup_retries, "reconnects": reconnects,
               "errors": sorted(set(errors))[:8]})
