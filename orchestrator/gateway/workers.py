"""Several gateway processes on one port (`gateway.workers`).

One asyncio process delivers about 30,000 caption messages a second before its loop is
the bottleneck (bench.delivery: 200 streams × 2,000 clients queued 0.85 s at p99 on
one process). With `gateway.workers: N` the process that runs the gateway (`babelcast
run`, or `babelcast gateway`) serves as worker 0 and starts N-1 more, each a fresh
interpreter (`python -m orchestrator.gateway.workers`) that builds the same app. Every
worker binds its own listening socket on the same port with SO_REUSEPORT, so the kernel
spreads new connections over the workers with no proxy in the path; each worker has its
own caption hub (one pub/sub connection, subscribed only to the channels its own clients
watch, each publication decoded once and its text sent as is to every client).

What a worker needs travels pickled through its stdin (`WorkerSpec`, secrets included):
never argv, the environment or a file, so no other user (nor `ps`) sees the keys, and
every worker signs and checks viewer tokens with the same key. A worker says `ready` on
stdout once it listens.

A worker that dies is started again (after `RESTART_BACKOFF_S`, doubling while it keeps
dying within `STABLE_S`); its clients' sockets closed with it, and they reconnect with
`since` to any worker and miss nothing (the captions WebSocket replays from the Redis
Stream). Each worker gets the parent-death signal, so none outlives its parent.

`/metrics` and `/v1/status`'s client counts cover every worker, whichever answers:
each worker also listens on a private Unix socket in a folder worker 0 creates (mode
0700; its path travels in `WorkerSpec.group`), and worker 0 sums the others' figures
(`metrics_merge`). What stays per process (see docs/deployment.md, "Gateway workers"): the
connection caps (`max_ws_per_ip`, `max_viewers_per_stream`, `max_connections` hold per
worker, so the port takes up to N times each). The one-publisher-per-push-stream rule is
held in Redis (`gateway.publishers`), so it holds across workers and machines.

`gateway.workers` defaults to `auto`, one per core (at most 16).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass

from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.context import GatewayStream
from orchestrator.gateway.metrics_merge import WorkerGroup
from orchestrator.outputs.hls import HlsOptions
from workers.aio import wait_for

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
"""A worker imports the app and connects to Redis; on a loaded 2-core machine ~2-5 s."""
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_S = 30.0
"""A worker that lived this long before dying is restarted at once (backoff reset)."""
STOP_GRACE_S = 8.0
"""SIGTERM → uvicorn's graceful shutdown (3 s for open sockets) → SIGKILL after this."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds its gateway from (picklable; holds secrets)."""

    redis_url: str
    streams: list[GatewayStream]
    event_name: str
    engine_profiles: tuple[str, ...]
    security: GatewaySecurity
    hls: HlsOptions | None
    host: str
    port: int
    group: WorkerGroup | None = None
    """Where the workers' private metric sockets are (`metrics_merge`); None: each
    serves its own figures (bench.delivery)."""


class WorkerError(Exception):
    """A worker process did not come up; the message says why."""


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.backoff_s = RESTART_BACKOFF_S
        self.restarts = 0


class GatewayWorkers:
    """Worker processes 1..count-1 beside the calling process, which serves as worker 0.
    `start()` returns once every one listens; `run()` restarts any that dies, until
    `aclose()`."""

    def __init__(self, spec: WorkerSpec, count: int) -> None:
        if count < 1:
            raise ValueError("count is the number of gateway processes, worker 0 included")
        self.spec = spec
        self._payload = pickle.dumps(spec)
        self._workers = [_Worker(i) for i in range(1, count)]
        self._closing = False

    @property
    def pids(self) -> dict[int, int]:
        """index → pid of the workers that run now."""
        return {w.index: w.proc.pid for w in self._workers
                if w.proc is not None and w.proc.returncode is None}

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self._workers)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(self._spawn(w) for w in self._workers))
        except BaseException:
            await self.aclose()
            raise

    async def _spawn(self, w: _Worker) -> None:
        from orchestrator.lifecycle import parent_death_signal

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator.gateway.workers", str(w.index),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            # Its own session: Ctrl-C in a terminal reaches the parent only, which stops
            # the workers itself (else they exit first and are restarted while it stops).
            start_new_session=True, preexec_fn=parent_death_signal(signal.SIGTERM))
        w.proc, w.started_at = proc, time.monotonic()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(self._payload)
        await proc.stdin.drain()
        proc.stdin.close()
        if not await self._ready(proc.stdout):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise WorkerError(f"gateway worker {w.index} did not start (exit code "
                              f"{proc.returncode}; its log is above)")

    @staticmethod
    async def _ready(out: asyncio.StreamReader) -> bool:
        """Whether the worker said `ready` in time (lines before it are skipped)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                line = await wait_for(out.readline(),
                                      max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            if not line:  # it exited
                return False
            if line.strip() == b"ready":
                return True

    async def run(self) -> None:
        """Restart workers that die, for as long as this runs."""
        while not self._closing:
            running = {asyncio.ensure_future(w.proc.wait()): w for w in self._workers
                       if w.proc is not None}
            if not running:
                await asyncio.sleep(1.0)
                continue
            try:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for fut in running:
                    fut.cancel()
            for fut in done:
                w = running[fut]
                if self._closing:
                    return
                lived = time.monotonic() - w.started_at
                w.backoff_s = RESTART_BACKOFF_S if lived >= STABLE_S else min(
                    RESTART_BACKOFF_MAX_S, w.backoff_s * 2)
                log.warning("gateway worker %d (pid %s) exited with %s after %.0f s; "
                            "starting it again in %.1f s", w.index,
                            w.proc.pid if w.proc else "?",
                            w.proc.returncode if w.proc else "?", lived, w.backoff_s)
                await self._respawn(w)

    async def _respawn(self, w: _Worker) -> None:
        while not self._closing:
            await asyncio.sleep(w.backoff_s)
            if self._closing:
                return
            try:
                await self._spawn(w)
            except WorkerError as exc:
                w.backoff_s = min(RESTART_BACKOFF_MAX_S, w.backoff_s * 2)
                log.error("%s; trying again in %.1f s", exc, w.backoff_s)
                continue
            w.restarts += 1
            return

    def stop_restarting(self) -> None:
        """`run()` ends and no worker is started again; those running go on."""
        self._closing = True

    async def aclose(self) -> None:
        self.stop_restarting()
        procs = [w.proc for w in self._workers
                 if w.proc is not None and w.proc.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                await wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


# ---- inside a worker process -----------------------------------------------------------
def _worker_main(index: int) -> int:
    import uvicorn

    from orchestrator.gateway.app import create_app
    from orchestrator.gateway.server import listen_socket, tune_gc, uvicorn_config

    spec: WorkerSpec = pickle.loads(sys.stdin.buffer.read())  # from our parent only
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s gateway-worker-{index} %(levelname)s "
                               "%(name)s: %(message)s")
    try:
        sock = listen_socket(spec.host, spec.port, reuse_port=True)
    except OSError as exc:
        log.error("gateway worker %d cannot listen on %s:%s: %s", index, spec.host,
                  spec.port, exc)
        return 2
    app = create_app(spec.redis_url, spec.streams, spec.event_name, spec.engine_profiles,
                     security=spec.security, hls=spec.hls, group=spec.group,
                     worker_index=index)
    server = uvicorn.Server(uvicorn_config(app, spec.host, spec.port,
                                           spec.security.limits, worker=index))
    tune_gc()

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                break
            await asyncio.sleep(0.02)
        else:
            # stdout carries this line only: the parent reads it, then nothing more.
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
        with contextlib.suppress(SystemExit):
            await task

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(int(sys.argv[1])))
