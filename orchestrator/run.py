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

from orchestrator.config import EventConfig
from orchestrator.gateway.app import GatewayStream, create_app
from orchestrator.live import LiveView
from orchestrator.outputs.config import hls_options, start_outputs
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
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def gateway_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    """How `babelcast run` serves the gateway. Per-message deflate is off: a caption is a
    few hundred bytes and browsers ask for deflate, so with it on the gateway compressed
    every caption once per client: a quarter of its CPU at 500 clients (bench.delivery)."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                          ws_per_message_deflate=False)


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
        # In the main thread (Ray wants it), and before our signal handlers so that
        # Ctrl-C and SIGTERM reach the graceful stop below rather than Ray's handler.
        redis_url = runtime.start_services()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        port = cfg.gateway.port or free_port(cfg.gateway.host)
        app = create_app(redis_url, gateway_streams(cfg), cfg.event, (cfg.engine.model,),
                         hls=hls_options(cfg.outputs))
        server = _EmbeddedServer(gateway_config(app, cfg.gateway.host, port))
        tune_gc()
        gateway = asyncio.create_task(_serve(server), name="gateway")
        while not server.started:
            if gateway.done():
                log.error("gateway could not listen on %s:%s (port in use?); set gateway.port",
                          cfg.gateway.host, port)
                return 2
            await asyncio.sleep(0.05)
        base = f"http://{cfg.gateway.host}:{port}"
        await runtime.start_actors()
        outputs = await start_outputs(
            redis_url, [stream_options(s, cfg.translation) for s in cfg.streams], cfg.outputs)
        supervisor = asyncio.create_task(runtime.supervise(), name="supervisor")
        redis = Redis.from_url(redis_url)
        view = LiveView(cfg, redis, base, plain=plain, unplaced=runtime.unplaced)
        viewer = asyncio.create_task(view.run(stop), name="live-view")
        timeout = None if duration_s is None else max(0.0, duration_s - (time.monotonic() -
                                                                         started))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout)
        stop.set()
        for task in (viewer, supervisor):
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
        await asyncio.to_thread(runtime.stop_services)
    return 0
