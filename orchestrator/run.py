"""`babelcast run`: everything of one event in one process tree, until Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from orchestrator.actor_options import stream_options
from orchestrator.apply import ApplyController, publish_streams
from orchestrator.config import EventConfig
from orchestrator.epoch import EpochGuard
from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.app import GatewayStream, create_app
from orchestrator.gateway.auth import Authenticator, GatewaySecrets, SecretsError
from orchestrator.gateway.hub import CaptionHub
from orchestrator.gateway.local_credentials import LocalCredentials
from orchestrator.gateway.metrics_merge import WorkerGroup
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.gateway.server import listen_socket, uvicorn_config
from orchestrator.gateway.server import tune_gc as tune_gc  # bench.delivery imports it here
from orchestrator.gateway.workers import GatewayWorkers, WorkerError, WorkerSpec
from orchestrator.lifecycle import mark_run, start_reaper
from orchestrator.live import LiveView
from orchestrator.outputs.config import hls_options, start_outputs
from orchestrator.redis_child import keep_alive
from orchestrator.redis_server import free_port
from orchestrator.runtime import EventRuntime
from workers.aio import wait_for
from workers.bus import connect_redis

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our loop: the run command owns Ctrl-C, so shutdown stops the
    actors first and the gateway last, instead of uvicorn grabbing the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _serve(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    with contextlib.suppress(SystemExit):  # uvicorn exits on a bind failure; we report it
        await server.serve(sockets=sockets)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # As uvicorn binds: connections of a previous run left in TIME_WAIT do not
        # make the port busy (a restart 40 s after a crash was refused without this).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def gateway_config(app: FastAPI, host: str, port: int,
                   limits: LimitsConfig | None = None, *,
                   worker: int | None = None) -> uvicorn.Config:
    """How `babelcast run` serves the gateway (see orchestrator.gateway.server)."""
    return uvicorn_config(app, host, port, limits, worker=worker)


def gateway_security(cfg: EventConfig) -> GatewaySecurity:
    """Secrets from the environment variables `auth` names; without `auth` (a loopback
    gateway, or validation would have refused) fresh ones for this run. Raises
    SecretsError naming what is missing."""
    if cfg.auth is not None:
        secrets_ = GatewaySecrets.from_env(cfg.auth)
        public, ttl = cfg.auth.viewers == "public", cfg.auth.viewer_ttl_s
    else:
        secrets_ = GatewaySecrets.generate(s.id for s in cfg.streams
                                           if s.source_kind == "push")
        public, ttl = False, 86_400
    return GatewaySecurity(Authenticator(secrets_, viewers_public=public, viewer_ttl_s=ttl),
                           tuple(o.rstrip("/") for o in cfg.gateway.allowed_origins),
                           cfg.gateway.limits)


def gateway_streams(cfg: EventConfig) -> list[GatewayStream]:
    return [GatewayStream(stream_options(s, cfg.translation), s.source_kind)
            for s in cfg.streams]


@dataclass
class ServedGateway:
    """The gateway of a run: worker 0 served in this loop (`app`, whose `state.hub` the
    epoch guard reads) and, with `gateway.workers` > 1, the other worker processes."""

    app: FastAPI
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    workers: GatewayWorkers | None = None
    keeper: asyncio.Task[None] | None = None
    group: WorkerGroup | None = None

    async def aclose(self) -> None:
        if self.workers is not None:
            # First, so the keeper stops restarting even where a cancel is lost.
            self.workers.stop_restarting()
        if self.keeper is not None:
            self.keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.keeper
        self.server.should_exit = True
        if self.workers is not None:
            await self.workers.aclose()
        with contextlib.suppress(Exception):
            await wait_for(self.task, 10)
        if self.group is not None:
            self.group.remove()


async def serve_gateway(cfg: EventConfig, redis_url: str,
                        security: GatewaySecurity) -> ServedGateway | None:
    """Start the event's gateway: `gateway.workers` processes on one port, this one
    first. None (and the reason logged) when it cannot listen."""
    host, count = cfg.gateway.host, cfg.gateway.worker_count()
    hls = hls_options(cfg.outputs)
    streams = gateway_streams(cfg)
    profiles = (cfg.engine.model,)
    sockets: list[socket.socket] | None = None
    group: WorkerGroup | None = None
    if count == 1:
        port = cfg.gateway.port or free_port(host)
    else:
        try:
            sock = listen_socket(host, cfg.gateway.port, reuse_port=True)
        except OSError as exc:
            log.error("gateway could not listen on %s:%s (%s); set gateway.port", host,
                      cfg.gateway.port, exc.strerror or exc)
            return None
        sockets, port = [sock], sock.getsockname()[1]
        group = WorkerGroup.create(count)  # removed by ServedGateway.aclose
    app = create_app(redis_url, streams, cfg.event, profiles, hls=hls, security=security,
                     group=group)
    server = _EmbeddedServer(gateway_config(app, host, port, cfg.gateway.limits,
                                            worker=None if count == 1 else 0))
    tune_gc()
    task = asyncio.create_task(_serve(server, sockets), name="gateway")
    while not server.started:
        if task.done():
            log.error("gateway could not listen on %s:%s (port in use?); set gateway.port",
                      host, port)
            if group is not None:
                group.remove()
            return None
        await asyncio.sleep(0.05)
    served = ServedGateway(app, server, task, port, group=group)
    if count > 1:
        served.workers = GatewayWorkers(
            WorkerSpec(redis_url, streams, cfg.event, profiles, security, hls, host, port,
                       group), count)
        try:
            await served.workers.start()
        except WorkerError as exc:
            log.error("%s", exc)
            served.workers = None
            await served.aclose()
            return None
        served.keeper = asyncio.create_task(served.workers.run(), name="gateway-workers")
        log.info("gateway: %d worker processes on %s:%s", count, host, port)
    return served


def _gateway_preflight(cfg: EventConfig, in_use_hint: str) -> GatewaySecurity | None:
    """The gateway's port is free and its secrets load; None (and why, logged) if not."""
    if cfg.gateway.port and not _port_free(cfg.gateway.host, cfg.gateway.port):
        log.error("gateway port %s:%s is in use; stop what uses it or set gateway.port%s",
                  cfg.gateway.host, cfg.gateway.port, in_use_hint)
        return None
    try:
        return gateway_security(cfg)
    except SecretsError as exc:
        log.error("cannot start: %s", exc)
        return None


async def run_event(cfg: EventConfig, *, duration_s: float | None = None,
                    plain: bool = False) -> int:
    runtime = EventRuntime(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    security = _gateway_preflight(cfg, " (0 picks a free one)")
    if security is None:
        return 2
    # Before any child exists: every process started from here on carries the mark
    # the reaper kills by if this process dies without cleaning up (SIGKILL).
    start_reaper(mark_run())
    local_url: str | None = None
    background: list[asyncio.Task[None]] = []
    try:
        # In the main thread (Ray wants it), and before our signal handlers so that
        # Ctrl-C and SIGTERM reach the graceful stop below rather than Ray's handler.
        redis_url = runtime.start_services()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        if runtime.redis_child is not None:
            background.append(asyncio.create_task(keep_alive(runtime.redis_child),
                                                  name="redis-child"))
        async with connect_redis(redis_url) as fresh:  # before a gateway reads it
            await publish_streams(fresh, cfg)
        gateway = await serve_gateway(cfg, redis_url, security)
        if gateway is None:
            return 2
        app, port = gateway.app, gateway.port
        base = f"http://{cfg.gateway.host}:{port}"
        redis = connect_redis(redis_url)
        hub: CaptionHub = app.state.hub
        guard = EpochGuard(redis, [(s.id, lang) for s in cfg.streams
                                   for lang in (stream_options(s).caption_lang, *s.targets)],
                           seen=lambda: hub.last_seq_seen, on_reset=runtime.report_status)
        await guard.start()  # before any publisher: translators adopt this epoch
        background.append(asyncio.create_task(guard.run(), name="epoch-guard"))
        auth = security.auth
        viewer_token = None if auth.viewers_public else auth.mint_viewer(subject="live-view")
        if cfg.auth is None:
            local_url = base
            path = LocalCredentials(base, auth.secrets.admin, viewer_token,
                                    dict(auth.secrets.publish)).write()
            log.warning("no auth section: this run's tokens are in %s (readable by you "
                        "only); babelcast tail/status/token on this machine use them", path)
        await runtime.start_actors()
        outputs = await start_outputs(
            redis_url, [stream_options(s, cfg.translation) for s in cfg.streams], cfg.outputs)
        supervisor = asyncio.create_task(runtime.supervise(), name="supervisor")
        view = LiveView(cfg, redis, base, plain=plain, unplaced=runtime.unplaced,
                        viewer_token=viewer_token)
        viewer = asyncio.create_task(view.run(stop), name="live-view")

        def applied(new: EventConfig) -> None:  # after a hot apply (orchestrator.apply)
            view.cfg = new
            guard.keys = [(s.id, lang) for s in new.streams
                          for lang in (stream_options(s).caption_lang, *s.targets)]
        control = asyncio.create_task(ApplyController(runtime, redis, outputs,
                                                       on_applied=applied).run(), name="apply")
        timeout = None if duration_s is None else max(0.0, duration_s - (time.monotonic() -
                                                                         started))
        with contextlib.suppress(TimeoutError):
            await wait_for(stop.wait(), timeout)
        stop.set()
        for task in (control, viewer, supervisor, *background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await runtime.stop()
        await outputs.aclose()  # archives closed, YouTube given a moment to drain
        await gateway.aclose()
        await redis.aclose()
    finally:
        for task in background:
            task.cancel()
        if local_url is not None:
            LocalCredentials.remove(local_url)
        # On this thread: the redis child's parent-death signal follows the thread
        # that started it, and stopping it from another thread is just as good.
        runtime.stop_services()
    return 0



async def run_gateway(cfg: EventConfig) -> int:
    """`babelcast gateway`: only the event's gateway (its `gateway.workers` processes),
    against `redis.url`, until Ctrl-C; a `babelcast run` elsewhere publishes there."""
    if cfg.redis.url is None:
        log.error("babelcast gateway serves a run that publishes to Redis elsewhere: set "
                  "redis.url in the event file to that run's Redis")
        return 2
    security = _gateway_preflight(cfg, "")
    if security is None:
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    gateway = await serve_gateway(cfg, cfg.redis.url, security)
    if gateway is None:
        return 2
    base = f"http://{cfg.gateway.host}:{gateway.port}"
    local = cfg.auth is None
    if local:
        auth = security.auth
        viewer = None if auth.viewers_public else auth.mint_viewer(subject="gateway")
        path = LocalCredentials(base, auth.secrets.admin, viewer,
                                dict(auth.secrets.publish)).write()
        log.warning("no auth section: this gateway's tokens are in %s (readable by you "
                    "only)", path)
    print(f"gateway of {cfg.event!r} on {base} ({cfg.gateway.worker_count()} worker "
          "process(es)); Ctrl-C stops it", flush=True)
    try:
        await stop.wait()
    finally:
        await gateway.aclose()
        if local:
            LocalCredentials.remove(base)
    return 0
