"""`babelcast run`: everything of one event in one process tree, until Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI
from redis.asyncio import Redis

from orchestrator.apply import ApplyController, publish_streams
from orchestrator.config import EventConfig
from orchestrator.epoch import EpochGuard
from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.app import GatewayStream, create_app
from orchestrator.gateway.auth import Authenticator, GatewaySecrets, SecretsError
from orchestrator.gateway.hub import CaptionHub
from orchestrator.gateway.local_credentials import LocalCredentials
from orchestrator.gateway.security_config import LimitsConfig
from orchestrator.gateway.server import uvicorn_config
from orchestrator.lifecycle import mark_run, start_reaper
from orchestrator.live import LiveView
from orchestrator.outputs.config import hls_options, start_outputs
from orchestrator.redis_child import keep_alive
from orchestrator.redis_server import free_port
from orchestrator.runtime import EventRuntime, stream_options

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our loop: the run command owns Ctrl-C, so shutdown stops the
    actors first and the gateway last, instead of uvicorn grabbing the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _serve(server: uvicorn.Server) -> None:
    with contextlib.suppress(SystemExit):  # uvicorn exits on a bind failure; we report it
        await server.serve()


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
                   limits: LimitsConfig | None = None) -> uvicorn.Config:
    """How `babelcast run` serves the gateway (see orchestrator.gateway.server)."""
    return uvicorn_config(app, host, port, limits)


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


def tune_gc() -> None:
    """Young collections far less often. The gateway allocates per caption and client, and
    with the default thresholds (700, 10, 10) what a busy second had in flight survived into
    the old generation fast enough for a full collection every 3 s, walking every
    connection's objects: at 2,000 clients 15 % of the gateway's CPU and 0.2-0.3 s pauses,
    which set the p99 of delivery (bench.delivery)."""
    gc.set_threshold(50_000, 20, 10)


def gateway_streams(cfg: EventConfig) -> list[GatewayStream]:
    return [GatewayStream(stream_options(s, cfg.translation), s.source_kind)
            for s in cfg.streams]


async def run_event(cfg: EventConfig, *, duration_s: float | None = None,
                    plain: bool = False) -> int:
    runtime = EventRuntime(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    if cfg.gateway.port and not _port_free(cfg.gateway.host, cfg.gateway.port):
        log.error("gateway port %s:%s is in use; stop what uses it or set gateway.port "
                  "(0 picks a free one)", cfg.gateway.host, cfg.gateway.port)
        return 2
    try:
        security = gateway_security(cfg)
    except SecretsError as exc:
        log.error("cannot start: %s", exc)
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
        async with Redis.from_url(redis_url) as fresh:  # before a gateway reads it
            await publish_streams(fresh, cfg)
        port = cfg.gateway.port or free_port(cfg.gateway.host)
        app = create_app(redis_url, gateway_streams(cfg), cfg.event, (cfg.engine.model,),
                         hls=hls_options(cfg.outputs), security=security)
        server = _EmbeddedServer(gateway_config(app, cfg.gateway.host, port, cfg.gateway.limits))
        tune_gc()
        gateway = asyncio.create_task(_serve(server), name="gateway")
        while not server.started:
            if gateway.done():
                log.error("gateway could not listen on %s:%s (port in use?); set gateway.port",
                          cfg.gateway.host, port)
                return 2
            await asyncio.sleep(0.05)
        base = f"http://{cfg.gateway.host}:{port}"
        redis = Redis.from_url(redis_url)
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
            await asyncio.wait_for(stop.wait(), timeout)
        stop.set()
        for task in (control, viewer, supervisor, *background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await runtime.stop()
        await outputs.aclose()  # archives closed, YouTube given a moment to drain
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gateway, 10)
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

