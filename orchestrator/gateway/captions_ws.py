"""The captions WebSocket `/v1/streams/{id}/captions?lang=xx&since=SEQ`.

Subscribe to live pub/sub first, then replay the Redis Stream after `since`, then
forward live messages whose seq is newer than the last one sent. Because the
subscription is confirmed before the replay is read, nothing published in between is
missed; because every message carries its seq, nothing is sent twice. Without `since`
a client starts at the live edge; a `since` beyond the newest seq ever given (the
stream's captions started over) gets `since_ahead`, so the client drops its position
and reconnects without one. A negative or non-integer `since` is `invalid_since`.

Bounds: clients send nothing here but a close, so a message over `MAX_CLIENT_MESSAGE`
bytes or more than `MAX_CLIENT_MESSAGES` per window closes the socket (1009 / 1008); a
client too slow for its finals is closed with 1013 and the seq to resume from; the
socket closes 4401 when the viewer token it came with expires, and 4404
(`stream_removed`) once a hot apply has removed its stream, after what is left of it.
Through a Redis restart the socket stays open: the hub has it catch up from the Stream
once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from orchestrator import metrics
from orchestrator.gateway.access import TRY_AGAIN_LATER, Access, Admitted, can_view
from orchestrator.gateway.context import GatewayContext, cancel_all
from orchestrator.gateway.hub import ClientQueue, Resync, SlowClient
from orchestrator.gateway.limits import CapExceeded
from workers.aio import wait_for
from workers.bus import RETRYABLE, caption_to_json, captions_key, retry_redis
from workers.events import CaptionSegment

log = logging.getLogger(__name__)

MAX_CLIENT_MESSAGE = 1024
MAX_CLIENT_MESSAGES = 30
CLIENT_MESSAGE_WINDOW_S = 10.0
REPLAY_HOLD_S = 30.0
REMOVED_FLUSH_S = 5.0
"""A removed stream's socket gets what is left in Redis for at most this long, then 4404."""
"""How long a catch-up read waits for Redis before the client is told to come back."""


async def captions_ws(ctx: GatewayContext, ws: WebSocket, stream_id: str) -> None:
    gs = ctx.by_id.get(stream_id)
    lang = ws.query_params.get("lang") or (gs.options.caption_lang if gs else "")
    admitted = await ctx.access.websocket(ws, can_view(stream_id, lang or None),
                                          f"reading captions of {stream_id!r}")
    if admitted is None:
        return
    try:
        await _admitted(ctx, ws, admitted, stream_id, lang)
    finally:
        ctx.access.release(admitted)


async def _admitted(ctx: GatewayContext, ws: WebSocket, admitted: Admitted, stream_id: str,
                    lang: str) -> None:
    gs = ctx.by_id.get(stream_id)
    if gs is None:
        await Access.refuse(ws, "unknown_stream", f"no stream {stream_id!r}", 4404)
        return
    langs = set(ctx.languages(gs))
    if lang not in langs:
        await Access.refuse(ws, "unknown_language", f"stream has languages {sorted(langs)}",
                            4404)
        return
    since_raw = ws.query_params.get("since") or None
    # ASCII digits only: int() also takes "+3", " 3", "1_000" and other scripts' digits.
    if since_raw is not None and not (since_raw.isascii() and since_raw.isdigit()):
        await Access.refuse(ws, "invalid_since", "since must be a seq: an integer ≥ 0", 4400)
        return
    since = int(since_raw) if since_raw is not None else None
    try:
        newest = await ctx.bus.last_seq(stream_id, lang)
    except RETRYABLE:
        await _unavailable(ws)
        return
    if since is not None and since > newest:
        await Access.refuse(ws, "since_ahead", f"since={since} is past the newest caption "
                            f"({newest}): the stream's captions started over; reconnect "
                            "without since", 4409)
        return
    try:
        ctx.access.caps.add_viewer(stream_id)
    except CapExceeded as exc:
        metrics.GATEWAY_REFUSALS.labels(refusal="cap").inc()
        await Access.refuse(ws, exc.code, str(exc), TRY_AGAIN_LATER)
        return
    try:
        await _serve(ctx, ws, admitted, stream_id, lang, newest if since is None else since)
    finally:
        ctx.access.caps.remove_viewer(stream_id)


async def _unavailable(ws: WebSocket) -> None:
    metrics.GATEWAY_REFUSALS.labels(refusal="unavailable").inc()
    await Access.refuse(ws, "unavailable", "captions are unavailable for a moment (Redis); "
                        "reconnect with since", TRY_AGAIN_LATER)


async def _serve(ctx: GatewayContext, ws: WebSocket, admitted: Admitted, stream_id: str,
                 lang: str, start_after: int) -> None:
    key = captions_key(stream_id, lang)
    queue = ClientQueue(max_finals=ctx.limits.client_finals_max)
    try:
        await ctx.hub.subscribe(key, queue)
    except Exception as exc:  # Redis away: say so; the hub kept nothing of this client
        log.warning("caption subscribe failed: %s", type(exc).__name__)
        await _unavailable(ws)
        return
    gauge = metrics.GATEWAY_CLIENTS.labels(stream=stream_id, lang=lang)
    gauge.inc()
    ctx.clients[(stream_id, lang)] += 1
    sent = metrics.GATEWAY_MESSAGES.labels(stream=stream_id, lang=lang)
    # Looked up once per connection: a labels() call per message showed in profiles.
    delivery = {final: metrics.GATEWAY_CAPTION_DELIVERY.labels(
        stream=stream_id, kind="final" if final else "partial") for final in (False, True)}
    last = start_after

    async def send(seg: CaptionSegment, text: str | None = None) -> None:
        nonlocal last
        await ws.send_text(text if text is not None else caption_to_json(seg))
        sent.inc()
        delivery[seg.is_final].observe(max(0.0, time.time() - seg.audio_end_wall))
        last = seg.seq

    async def replay_after(seq: int) -> None:
        while True:
            batch = await retry_redis(
                functools.partial(ctx.bus.captions_after, stream_id, lang, seq),
                what="caption replay", log=log, max_wait_s=REPLAY_HOLD_S)
            for seg in batch:
                if seg.seq > last:
                    await send(seg)
            if len(batch) < 1000:
                return
            seq = batch[-1].seq

    async def pump() -> None:
        await replay_after(last)
        dropped_seen = queue.dropped
        while True:
            try:
                seg, text = await queue.get_with_text()
            except Resync:
                await replay_after(last)
                continue
            if seg.seq <= last:
                continue  # already sent by the replay
            if seg.seq > last + 1 and queue.dropped == dropped_seen:
                # A hole that the slow-client policy did not make: read it back.
                await replay_after(last)
                if seg.seq <= last:
                    continue
            dropped_seen = queue.dropped
            await send(seg, text)

    async def watch_client() -> None:
        # Clients send nothing we need; reading tells us when they leave.
        window_start, count = time.monotonic(), 0
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                size = len(msg.get("text") or msg.get("bytes") or b"")
                now = time.monotonic()
                if now - window_start > CLIENT_MESSAGE_WINDOW_S:
                    window_start, count = now, 0
                count += 1
                if size > MAX_CLIENT_MESSAGE or count > MAX_CLIENT_MESSAGES:
                    metrics.GATEWAY_REFUSALS.labels(refusal="size").inc()
                    await Access.refuse(ws, "unexpected_message",
                                        "caption sockets take no messages", 1009 if size >
                                        MAX_CLIENT_MESSAGE else 1008)
                    return

    async def expire() -> None:
        expires_at = admitted.principal.expires_at
        if expires_at is None:
            await asyncio.Event().wait()
            return
        await asyncio.sleep(max(0.0, expires_at - time.time()))
        await Access.refuse(ws, "token_expired", "the viewer token has expired; reconnect "
                            f"with a new one and since={last}", 4401)

    pumping = asyncio.create_task(pump())
    removed = asyncio.create_task(ctx.removal(stream_id).wait())
    tasks = {pumping, asyncio.create_task(watch_client()), asyncio.create_task(expire()),
             removed}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if removed in done and not pumping.done():
            # A hot apply drained the stream (its open caption closed) and removed it:
            # send what is left, then say so rather than leave a silent socket open.
            await cancel_all({pumping})
            with contextlib.suppress(Exception):
                await wait_for(replay_after(last), REMOVED_FLUSH_S)
            await Access.refuse(ws, "stream_removed", f"stream {stream_id!r} was removed "
                                f"from the event; its captions end at seq {last}", 4404)
        for task in done:
            failure = task.exception()
            if isinstance(failure, SlowClient):
                metrics.GATEWAY_REFUSALS.labels(refusal="slow_client").inc()
                await Access.refuse(ws, "slow_client",
                                    f"more than {ctx.limits.client_finals_max} finals unread; "
                                    f"reconnect with since={last}", TRY_AGAIN_LATER)
            elif isinstance(failure, RETRYABLE):
                await _unavailable(ws)
    finally:
        await cancel_all(tasks)
        gauge.dec()
        ctx.clients[(stream_id, lang)] -= 1
        await ctx.hub.unsubscribe(key, queue)
        with contextlib.suppress(Exception):
            await ws.close()
