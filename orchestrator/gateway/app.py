"""The gateway: REST status, the captions WebSocket, push audio, /metrics.

Captions WebSocket `/v1/streams/{id}/captions?lang=xx&since=SEQ`:
subscribe to live pub/sub first, then replay the Redis Stream after `since`,
then forward live messages whose seq is newer than the last one sent. Because
the subscription is confirmed before the replay is read, nothing published in
between is missed; because every message carries its seq, nothing is sent
twice. Without `since` a client starts at the live edge; a `since` beyond the
newest publication (the stream's captions started over) gets a `since_ahead`
error, so the client drops its position and reconnects without one.

`/v1/status` serves the event's headline figures (`babelcast status` prints them)
and `/metrics` the gateway's and orchestrator's Prometheus metrics.

Also served here: `/` (the streams, with overlay links), the overlay page
`/overlay/{id}?lang=xx` with its static files under `/static/`, and live HLS
WebVTT playlists `/hls/{id}/{lang}.m3u8` with segments `/hls/{id}/{lang}/{n}.vtt`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import BlockingConnectionPool, Redis

from orchestrator import metrics
from orchestrator.gateway.hub import CaptionHub, ClientQueue
from orchestrator.gateway.pages import STATIC_DIR, index_html, linebreak_script
from orchestrator.gateway.realtime import RealtimeConnection
from orchestrator.gateway.realtime_protocol import error_event
from orchestrator.outputs.hls import HlsOptions, HlsService, HlsTrack
from orchestrator.status import collect as collect_status
from workers.bus import RedisBus, caption_to_json, captions_key
from workers.events import CaptionSegment, StreamOptions
from workers.ingest import AudioClock, write_audio

log = logging.getLogger(__name__)

MAX_PUSH_FRAME_BYTES = 64_000  # 2 s of PCM16 16 kHz; larger frames are refused


@dataclass(frozen=True, slots=True)
class GatewayStream:
    options: StreamOptions
    source_kind: str


def _error(code: str, message: str) -> str:
    return json.dumps({"type": "error", "code": code, "message": message})


def create_app(redis_url: str, streams: list[GatewayStream], event_name: str = "",
               engine_profiles: tuple[str, ...] = (), *,
               hls: HlsOptions | None = None) -> FastAPI:
    """`engine_profiles`: names `/v1/realtime` clients may ask for in session.update;
    with one profile (or none named) any model name selects it. `hls`: the live HLS
    WebVTT playlists (default options when None; `enabled=False` turns them off)."""
    hls_options = hls or HlsOptions()
    by_id = {s.options.stream_id: s for s in streams}
    push_ids = [s.options.stream_id for s in streams if s.source_kind == "push"]
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Clients that connect together (overlays reconnecting after a blip) read Redis
        # together: wait for a pooled connection; redis-py's default pool (8.x) raises
        # MaxConnectionsError past 100 and the WebSocket dies with it.
        redis = Redis.from_pool(BlockingConnectionPool.from_url(redis_url, max_connections=100))
        hub = CaptionHub(redis)
        await hub.start()
        bus = RedisBus(redis)
        state.update(redis=redis, bus=bus, hub=hub, clocks={},
                     hls=HlsService(bus, hls_options), clients=collections.Counter())
        try:
            yield
        finally:
            await hub.stop()
            await redis.aclose()

    app = FastAPI(title="Babelcast gateway", lifespan=lifespan)

    def bus() -> RedisBus:
        b: RedisBus = state["bus"]
        return b

    async def describe(gs: GatewayStream) -> dict[str, Any]:
        o = gs.options
        try:
            status = await bus().get_status(o.stream_id)
        except Exception:
            metrics.REDIS_ERRORS.labels(component="gateway").inc()
            status = {}
        return {
            "id": o.stream_id,
            "name": o.name,
            "language": o.language,
            "caption_lang": o.caption_lang,
            "targets": list(o.targets),
            "source_kind": gs.source_kind,
            "captions_ws": f"/v1/streams/{o.stream_id}/captions?lang={o.caption_lang}",
            "status": status,
        }

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        try:
            await state["redis"].ping()
        except Exception as exc:
            return JSONResponse({"ok": False, "redis": type(exc).__name__}, status_code=503)
        return JSONResponse({"ok": True, "event": event_name, "streams": len(by_id)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def event_status() -> JSONResponse:
        """The headline figures `babelcast status` prints (see orchestrator/status.py)."""
        try:
            body = await collect_status(bus(), [s.options for s in by_id.values()], event_name,
                                        dict(state["clients"]))
        except Exception as exc:
            metrics.REDIS_ERRORS.labels(component="gateway").inc()
            return JSONResponse({"error": f"status unavailable: {type(exc).__name__}"},
                                status_code=503)
        return JSONResponse(body)

    @app.get("/v1/streams")
    async def list_streams() -> list[dict[str, Any]]:
        return [await describe(s) for s in by_id.values()]

    @app.get("/v1/streams/{stream_id}")
    async def get_stream(stream_id: str) -> dict[str, Any]:
        gs = by_id.get(stream_id)
        if gs is None:
            raise HTTPException(404, f"no stream {stream_id!r} in this event")
        return await describe(gs)

    def languages(gs: GatewayStream) -> list[str]:
        return [gs.options.caption_lang, *gs.options.targets]

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(index_html(event_name, [s.options for s in by_id.values()],
                                       hls=hls_options.enabled))

    @app.get("/overlay/{stream_id}", response_model=None)
    async def overlay(stream_id: str, request: Request) -> Response:
        gs = by_id.get(stream_id)
        if gs is None:
            return PlainTextResponse(f"no stream {stream_id!r} in this event; see / for the "
                                     "streams", status_code=404)
        query = dict(request.query_params)
        if not query.get("lang"):
            # The page needs a language; the stream's own is the natural default.
            query["lang"] = gs.options.caption_lang
            return RedirectResponse(f"/overlay/{stream_id}?{urlencode(query)}",
                                    status_code=307)
        langs = languages(gs)
        for name in ("lang", "lang2"):
            if query.get(name) and query[name] not in langs:
                return PlainTextResponse(
                    f"stream {stream_id!r} has captions in {', '.join(langs)}; "
                    f"{name}={query[name]!r} is not one of them", status_code=404)
        return FileResponse(STATIC_DIR / "overlay.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/static/linebreak.js")
    async def linebreak_js() -> Response:
        return Response(linebreak_script(), media_type="text/javascript",
                        headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    hls_headers = {"Access-Control-Allow-Origin": "*"}

    def hls_track_or_404(stream_id: str, lang: str) -> None:
        gs = by_id.get(stream_id)
        if not hls_options.enabled:
            raise HTTPException(404, "HLS output is turned off (outputs.hls.enabled)")
        if gs is None:
            raise HTTPException(404, f"no stream {stream_id!r} in this event")
        if lang not in languages(gs):
            raise HTTPException(404, f"stream {stream_id!r} has captions in "
                                     f"{', '.join(languages(gs))}, not {lang!r}")

    async def hls_track(stream_id: str, lang: str) -> HlsTrack:
        hls_track_or_404(stream_id, lang)
        service: HlsService = state["hls"]
        try:
            return await service.track(stream_id, lang)
        except Exception as exc:
            metrics.REDIS_ERRORS.labels(component="gateway").inc()
            log.warning("HLS %s/%s: caption read failed: %s", stream_id, lang,
                        type(exc).__name__)
            raise HTTPException(503, "captions are unavailable; retry") from None

    @app.get("/hls/{stream_id}/{lang}.m3u8")
    async def hls_playlist(stream_id: str, lang: str) -> Response:
        track = await hls_track(stream_id, lang)
        body = track.playlist(lambda n: f"{lang}/{n}.vtt")
        return Response(body, media_type="application/vnd.apple.mpegurl",
                        headers={**hls_headers, "Cache-Control": "no-cache"})

    @app.get("/hls/{stream_id}/{lang}/{n}.vtt")
    async def hls_segment(stream_id: str, lang: str, n: int) -> Response:
        body = (await hls_track(stream_id, lang)).segment(n)
        if body is None:
            raise HTTPException(404, f"segment {n} is not in the playlist's window")
        return Response(body, media_type="text/vtt; charset=utf-8",
                        headers={**hls_headers,
                                 "Cache-Control": f"max-age={int(hls_options.segment_s)}"})

    @app.websocket("/v1/streams/{stream_id}/captions")
    async def captions_ws(ws: WebSocket, stream_id: str) -> None:
        await ws.accept()
        gs = by_id.get(stream_id)
        lang = ws.query_params.get("lang") or (gs.options.caption_lang if gs else "")
        since_raw = ws.query_params.get("since")
        if gs is None:
            await ws.send_text(_error("unknown_stream", f"no stream {stream_id!r}"))
            await ws.close(code=4404)
            return
        langs = {gs.options.caption_lang, *gs.options.targets}
        if lang not in langs:
            await ws.send_text(_error("unknown_language", f"stream has languages {sorted(langs)}"))
            await ws.close(code=4404)
            return
        try:
            since = int(since_raw) if since_raw not in (None, "") else None
        except ValueError:
            await ws.send_text(_error("invalid_since", "since must be an integer seq"))
            await ws.close(code=4400)
            return
        if since is not None:
            latest = await bus().last_caption(stream_id, lang)
            newest = latest.seq if latest else 0
            if since > newest:
                await ws.send_text(_error(
                    "since_ahead", f"since={since} is past the newest caption ({newest}): the "
                    "stream's captions started over; reconnect without since"))
                await ws.close(code=4409)
                return
        await _serve_captions(ws, stream_id, lang, since)

    async def _serve_captions(ws: WebSocket, stream_id: str, lang: str, since: int | None) -> None:
        hub: CaptionHub = state["hub"]
        key = captions_key(stream_id, lang)
        queue = ClientQueue()
        await hub.subscribe(key, queue)
        gauge = metrics.GATEWAY_CLIENTS.labels(stream=stream_id, lang=lang)
        gauge.inc()
        clients: collections.Counter[tuple[str, str]] = state["clients"]
        clients[(stream_id, lang)] += 1
        sent = metrics.GATEWAY_MESSAGES.labels(stream=stream_id, lang=lang)
        # Looked up once per connection: a labels() call per message showed in profiles.
        delivery = {final: metrics.GATEWAY_CAPTION_DELIVERY.labels(
            stream=stream_id, kind="final" if final else "partial") for final in (False, True)}
        last = since
        if last is None:
            latest = await bus().last_caption(stream_id, lang)
            last = latest.seq if latest else 0

        async def send(seg: CaptionSegment, text: str | None = None) -> None:
            nonlocal last
            await ws.send_text(text if text is not None else caption_to_json(seg))
            sent.inc()
            delivery[seg.is_final].observe(max(0.0, time.time() - seg.audio_end_wall))
            last = seg.seq

        async def replay_after(seq: int) -> None:
            while True:
                batch = await bus().captions_after(stream_id, lang, seq)
                for seg in batch:
                    await send(seg)
                if len(batch) < 1000:
                    return
                seq = batch[-1].seq

        async def pump() -> None:
            await replay_after(last)
            dropped_seen = queue.dropped
            while True:
                seg, text = await queue.get_with_text()
                if seg.seq <= last:
                    continue  # already sent by the replay
                if seg.seq > last + 1 and queue.dropped == dropped_seen:
                    # A hole that the slow-client policy did not make: read it back.
                    await replay_after(last)
                    if seg.seq <= last:
                        continue
                dropped_seen = queue.dropped
                await send(seg, text)

        async def watch_close() -> None:
            # Clients send nothing we need; reading tells us when they leave.
            with contextlib.suppress(WebSocketDisconnect):
                while True:
                    await ws.receive_text()

        pump_task = asyncio.create_task(pump())
        close_task = asyncio.create_task(watch_close())
        try:
            await asyncio.wait({pump_task, close_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_task, close_task):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            gauge.dec()
            clients[(stream_id, lang)] -= 1
            await hub.unsubscribe(key, queue)
            with contextlib.suppress(Exception):
                await ws.close()

    def clock_for(stream_id: str) -> AudioClock:
        clock: AudioClock = state["clocks"][stream_id]
        return clock

    async def ensure_clock(stream_id: str) -> AudioClock:
        clocks: dict[str, AudioClock] = state["clocks"]
        if stream_id not in clocks:
            pos, wall = await bus().last_audio_end(stream_id)
            clocks[stream_id] = AudioClock(stream_id, pos, last_wall=wall,
                                           reason="push-reconnected")
        return clocks[stream_id]

    def accepts(model: str) -> bool:
        return len(engine_profiles) <= 1 or model in engine_profiles

    @app.websocket("/v1/realtime")
    async def realtime_ws(ws: WebSocket) -> None:
        await ws.accept()
        stream_id = ws.query_params.get("stream") or (push_ids[0] if len(push_ids) == 1 else "")
        gs = by_id.get(stream_id)
        if gs is None or gs.source_kind != "push":
            await ws.send_text(error_event(
                "invalid_event",
                "connect to /v1/realtime?stream=ID where ID is a stream with `source: push`"
                f" (push streams: {push_ids})"))
            await ws.close(code=4404)
            return
        await ensure_clock(stream_id)
        await bus().set_status(stream_id, source_state="live")
        conn = RealtimeConnection(ws, stream_id=stream_id, lang=gs.options.caption_lang,
                                  bus=bus(), hub=state["hub"], clock_for=clock_for,
                                  accepts=accepts)
        await conn.run()
        with contextlib.suppress(Exception):
            await bus().set_status(stream_id, source_state="waiting")

    @app.websocket("/v1/streams/{stream_id}/audio")
    async def push_audio_ws(ws: WebSocket, stream_id: str) -> None:
        await ws.accept()
        gs = by_id.get(stream_id)
        if gs is None or gs.source_kind != "push":
            await ws.send_text(
                _error("not_push", f"stream {stream_id!r} does not declare `source: push`")
            )
            await ws.close(code=4403)
            return
        clock = await ensure_clock(stream_id)
        await bus().set_status(stream_id, source_state="live")
        frames = metrics.PUSH_FRAMES.labels(stream=stream_id)
        bad = metrics.PUSH_BAD_FRAMES.labels(stream=stream_id)
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("bytes")
                if data is None:
                    # Text frames carry no audio; say so and keep the socket.
                    bad.inc()
                    await ws.send_text(_error("invalid_audio", "send binary PCM16 LE frames"))
                    continue
                if len(data) % 2 or not data or len(data) > MAX_PUSH_FRAME_BYTES:
                    bad.inc()
                    await ws.send_text(
                        _error("invalid_audio", f"frame of {len(data)} bytes: need an even "
                               f"length of 2..{MAX_PUSH_FRAME_BYTES} (PCM16 16 kHz mono)")
                    )
                    continue
                frames.inc()
                await write_audio(bus(), clock, data)
        except WebSocketDisconnect:
            pass
        finally:
            clock.pending_reason = "push-disconnected"
            with contextlib.suppress(Exception):
                await bus().set_status(stream_id, source_state="waiting")

    return app
