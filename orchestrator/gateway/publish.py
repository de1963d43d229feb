"""The endpoints that push audio into a `source: push` stream: binary PCM frames on
`/v1/streams/{id}/audio`, and vLLM's realtime protocol on `/v1/realtime?stream=ID`.

Both need the stream's publish token, and a stream has one publisher at a time (a
second connection is refused with 4409 `publisher_busy`), held in this process and, for
other gateway workers and machines, as a lease in Redis (`publishers`). Audio is paced against the
wall clock (`limits.AudioPacer`): past 1.5 × real time beyond a burst allowance the
publisher gets `rate_limited` and close 1008, and nobody else notices. While Redis is
away a frame is held for up to `REDIS_HOLD_S` (the publisher's own socket backs up
meanwhile, and the time it was held is credited back to its pace); past that the
publisher is told to come back (1013).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from orchestrator import metrics
from orchestrator.gateway.access import (
    TRY_AGAIN_LATER,
    Access,
    Admitted,
    can_publish,
    error_text,
)
from orchestrator.gateway.auth import Principal
from orchestrator.gateway.context import GatewayContext, GatewayStream
from orchestrator.gateway.limits import AudioPacer, CapExceeded, RateLimited
from orchestrator.gateway.publishers import PublisherLease
from orchestrator.gateway.realtime import RealtimeConnection, RealtimeLimits
from orchestrator.gateway.realtime_protocol import error_event
from workers.bus import RETRYABLE
from workers.ingest import AudioClock, write_audio

log = logging.getLogger(__name__)

MAX_PUSH_FRAME_BYTES = 64_000  # 2 s of PCM16 16 kHz; larger frames are refused
REDIS_HOLD_S = 20.0


def _any_publisher(p: Principal) -> bool:
    return p.kind == "publish"


async def _refuse_early(ws: WebSocket, ctx: GatewayContext, code: str, message: str,
                        close_code: int, *, realtime: bool = False) -> None:
    """Refuse a stream that takes no push. Only to a caller holding a publish token: an
    anonymous one gets 4401 first and learns nothing about the event's streams."""
    admitted = await ctx.access.websocket(ws, _any_publisher, "pushing audio")
    if admitted is None:
        return
    ctx.access.release(admitted)
    with contextlib.suppress(Exception):
        await ws.send_text(error_event(code, message) if realtime else error_text(code, message))
        await ws.close(code=close_code)


PUBLISHER_GRACE_S = 2.0
"""How long a new publisher waits for the stream's place before it is refused."""
BUSY = ("publisher_busy", "stream {!r} already has a publisher; one connection pushes a "
        "stream at a time (a dropped one frees its place within the ping timeout)")


async def _admit_publisher(ctx: GatewayContext, ws: WebSocket, stream_id: str
                           ) -> tuple[Admitted, PublisherLease] | None:
    admitted = await ctx.access.websocket(ws, can_publish(stream_id),
                                          f"pushing audio to {stream_id!r}")
    if admitted is None:
        return None
    # A publisher that closed a moment ago may not have let go yet (its handler's clean-up
    # runs after the close): a reconnect is let in if the place frees within the grace.
    deadline = time.monotonic() + PUBLISHER_GRACE_S
    while True:
        try:
            ctx.access.caps.claim_publisher(stream_id)
            break
        except CapExceeded as exc:
            if time.monotonic() >= deadline:
                metrics.GATEWAY_REFUSALS.labels(refusal="cap").inc()
                ctx.access.release(admitted)
                await Access.refuse(ws, exc.code, str(exc), 4409)
                return None
            await asyncio.sleep(0.1)

    async def lost() -> None:
        await Access.refuse(ws, BUSY[0], BUSY[1].format(stream_id), 4409)

    # Another gateway process (a worker, another machine) may hold the stream.
    lease = PublisherLease(ctx.redis, stream_id, lost)
    while True:
        try:
            claimed = await lease.claim()
        except RETRYABLE:
            _release_publisher(ctx, admitted, stream_id)
            metrics.GATEWAY_REFUSALS.labels(refusal="unavailable").inc()
            await Access.refuse(ws, "unavailable", "Redis is unavailable; retry",
                                TRY_AGAIN_LATER)
            return None
        if claimed:
            break
        if time.monotonic() >= deadline:
            _release_publisher(ctx, admitted, stream_id)
            metrics.GATEWAY_REFUSALS.labels(refusal="cap").inc()
            await Access.refuse(ws, BUSY[0], BUSY[1].format(stream_id), 4409)
            return None
        await asyncio.sleep(0.1)
    return admitted, lease


def _release_publisher(ctx: GatewayContext, admitted: Admitted, stream_id: str) -> None:
    ctx.access.caps.release_publisher(stream_id)
    ctx.access.release(admitted)


async def _set_source(ctx: GatewayContext, stream_id: str, state: str) -> None:
    with contextlib.suppress(*RETRYABLE):
        await ctx.bus.set_status(stream_id, source_state=state)


def pacer_for(ctx: GatewayContext) -> AudioPacer:
    return AudioPacer(ctx.limits.push_rate, ctx.limits.push_burst_s)


async def write_paced(ctx: GatewayContext, pacer: AudioPacer, clock: AudioClock,
                      pcm: bytes, *, admitted: bool = False) -> None:
    """Write one frame within the publisher's pace; RateLimited past it. `admitted`: the
    caller has charged this audio to the pacer already (it must be charged once)."""
    if not admitted and not pacer.admit(len(pcm)):
        raise RateLimited
    started = time.monotonic()
    await write_audio(ctx.bus, clock, pcm, max_wait_s=REDIS_HOLD_S)
    held = time.monotonic() - started
    if held > 0.5:  # Redis held us: the publisher's backlog is ours, not its fault
        pacer.credit(held)


def rate_message(ctx: GatewayContext) -> str:
    return (f"audio arrives faster than {ctx.limits.push_rate:g} × real time beyond a "
            f"{ctx.limits.push_burst_s:g} s burst; send PCM at its real pace")


async def push_audio_ws(ctx: GatewayContext, ws: WebSocket, stream_id: str) -> None:
    gs = ctx.by_id.get(stream_id)
    if gs is None or gs.source_kind != "push":
        await _refuse_early(ws, ctx, "not_push",
                            f"stream {stream_id!r} does not declare `source: push`", 4404)
        return
    claim = await _admit_publisher(ctx, ws, stream_id)
    if claim is None:
        return
    admitted, lease = claim
    try:
        if await ctx.until_removed(stream_id, _push_loop(ctx, ws, stream_id)):
            await Access.refuse(ws, "stream_removed", f"stream {stream_id!r} was removed "
                                "from the event", 4404)
    finally:
        await lease.release()
        _release_publisher(ctx, admitted, stream_id)


async def _push_loop(ctx: GatewayContext, ws: WebSocket, stream_id: str) -> None:
    try:
        clock = await ctx.ensure_clock(stream_id)
    except RETRYABLE:
        await Access.refuse(ws, "unavailable", "Redis is unavailable; retry", TRY_AGAIN_LATER)
        return
    await _set_source(ctx, stream_id, "live")
    frames = metrics.PUSH_FRAMES.labels(stream=stream_id)
    bad = metrics.PUSH_BAD_FRAMES.labels(stream=stream_id)
    pacer = pacer_for(ctx)
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                break
            data = msg.get("bytes")
            if data is None:
                # Text frames carry no audio; say so and keep the socket.
                bad.inc()
                await ws.send_text(error_text("invalid_audio", "send binary PCM16 LE frames"))
                continue
            if len(data) % 2 or not data or len(data) > MAX_PUSH_FRAME_BYTES:
                bad.inc()
                await ws.send_text(error_text(
                    "invalid_audio", f"frame of {len(data)} bytes: need an even length of "
                    f"2..{MAX_PUSH_FRAME_BYTES} (PCM16 16 kHz mono)"))
                continue
            frames.inc()
            await write_paced(ctx, pacer, clock, data)
    except RateLimited:
        metrics.GATEWAY_REFUSALS.labels(refusal="rate").inc()
        log.warning("stream %s: publisher closed: faster than %.1f × real time", stream_id,
                    ctx.limits.push_rate)
        await Access.refuse(ws, "rate_limited", rate_message(ctx), 1008)
    except RETRYABLE:
        metrics.GATEWAY_REFUSALS.labels(refusal="unavailable").inc()
        await Access.refuse(ws, "unavailable", "Redis is unavailable; reconnect and resend "
                            "from where you were", TRY_AGAIN_LATER)
    except WebSocketDisconnect:
        pass
    finally:
        clock.pending_reason = "push-disconnected"
        await _set_source(ctx, stream_id, "waiting")


async def realtime_ws(ctx: GatewayContext, ws: WebSocket) -> None:
    push_ids = ctx.push_ids
    stream_id = ws.query_params.get("stream") or (push_ids[0] if len(push_ids) == 1 else "")
    gs: GatewayStream | None = ctx.by_id.get(stream_id)
    if gs is None or gs.source_kind != "push":
        await _refuse_early(ws, ctx, "invalid_event",
                            "connect to /v1/realtime?stream=ID where ID is a stream with "
                            f"`source: push` (push streams: {push_ids})", 4404, realtime=True)
        return
    claim = await _admit_publisher(ctx, ws, stream_id)
    if claim is None:
        return
    admitted, lease = claim
    try:
        try:
            await ctx.ensure_clock(stream_id)
        except RETRYABLE:
            await Access.refuse(ws, "unavailable", "Redis is unavailable; retry",
                                TRY_AGAIN_LATER)
            return
        await _set_source(ctx, stream_id, "live")
        pacer = pacer_for(ctx)

        async def write(pcm: bytes) -> None:
            # Charged when the append came in (RealtimeLimits.admit), before it was held
            # for the first commit; charging it again here halved the allowed pace.
            await write_paced(ctx, pacer, ctx.clock_for(stream_id), pcm, admitted=True)

        conn = RealtimeConnection(
            ws, stream_id=stream_id, lang=gs.options.caption_lang, bus=ctx.bus, hub=ctx.hub,
            clock_for=ctx.clock_for, accepts=ctx.accepts, writer=write,
            limits=RealtimeLimits(append_max_bytes=ctx.limits.realtime_append_max_bytes,
                                  precommit_max_s=ctx.limits.realtime_precommit_max_s,
                                  admit=pacer.admit))
        try:
            if await ctx.until_removed(stream_id, conn.run()):
                with contextlib.suppress(Exception):
                    await conn.stop_listening()
                    await ws.send_text(error_event("stream_removed", f"stream {stream_id!r} "
                                                   "was removed from the event"))
                    await ws.close(code=4404)
        except RateLimited:
            metrics.GATEWAY_REFUSALS.labels(refusal="rate").inc()
            with contextlib.suppress(Exception):
                await ws.send_text(error_event("rate_limited", rate_message(ctx)))
                await ws.close(code=1008)
        except RETRYABLE:
            metrics.GATEWAY_REFUSALS.labels(refusal="unavailable").inc()
            with contextlib.suppress(Exception):
                await ws.send_text(error_event("processing_error", "Redis is unavailable; "
                                               "reconnect"))
                await ws.close(code=TRY_AGAIN_LATER)
        await _set_source(ctx, stream_id, "waiting")
    finally:
        await lease.release()
        _release_publisher(ctx, admitted, stream_id)
