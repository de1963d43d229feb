"""The gateway: REST status, the captions WebSocket, push audio, /metrics.

Routes and who may use them (see `auth` for the token kinds, `access` for admission):

| route | needs |
|---|---|
| `GET /livez`, `GET /healthz` (readiness, see `health`) | nothing |
| `GET /metrics` | admin, or the scrape token |
| `GET /v1/status`, `POST /v1/tokens`, `POST /v1/admin/apply` | admin |
| `GET /v1/streams[/{id}]`, `GET /` | admin or a viewer token (its streams only) |
| `GET /v1/streams/{id}/transcript.{vtt,srt}?lang=xx` | viewer of that stream and language |
| `GET /overlay/{id}`, `/hls/...`, WS `/v1/streams/{id}/captions` | viewer of that stream |
| WS `/v1/streams/{id}/audio`, WS `/v1/realtime` | publish token of that stream |
| `/static/...` | nothing (the overlay's code, no data) |

With `auth.viewers: public`, viewer routes need no token.

`/v1/status` serves the event's headline figures (`babelcast status` prints them)
and `/metrics` the gateway's and orchestrator's Prometheus metrics; with several gateway
workers, both count every worker of the port, whichever answers (see `metrics_merge`).
Also served here: `/` (the streams, with overlay links carrying a viewer token), the
overlay page `/overlay/{id}?lang=xx` with its static files under `/static/`, and live HLS
WebVTT playlists `/hls/{id}/{lang}.m3u8` with segments `/hls/{id}/{lang}/{n}.vtt`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query, Request, WebSocket
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import BlockingConnectionPool, Redis

from orchestrator import metrics
from orchestrator.gateway import admin_apply
from orchestrator.gateway.access import (
    Access,
    GatewaySecurity,
    can_scrape,
    can_view,
    can_view_any,
    is_admin,
)
from orchestrator.gateway.auth import MAX_MINT_TTL_S, AuthError, Principal
from orchestrator.gateway.body_guard import BodyGuard, BodyRoute
from orchestrator.gateway.captions_ws import captions_ws
from orchestrator.gateway.context import GatewayContext, GatewayStream
from orchestrator.gateway.health import readiness
from orchestrator.gateway.hub import CaptionHub
from orchestrator.gateway.metrics_merge import GatewayMetrics, WorkerGroup
from orchestrator.gateway.pages import STATIC_DIR, index_html, linebreak_script
from orchestrator.gateway.publish import push_audio_ws, realtime_ws
from orchestrator.gateway.transcripts import Format, Profile, TranscriptExporter
from orchestrator.outputs.hls import HlsOptions, HlsTrack
from orchestrator.status import collect as collect_status
from orchestrator.status import typed_status
from workers.bus import cancel_safe

__all__ = ["GatewayStream", "create_app"]

log = logging.getLogger(__name__)


MAX_TOKEN_REQUEST_BYTES = 64 * 1024
"""256 stream ids and 64 languages, as JSON, fit with room to spare."""


class TokenRequest(BaseModel):
    """`POST /v1/tokens`: a viewer token (JWT) for some streams and languages."""

    model_config = ConfigDict(extra="forbid")
    streams: list[str] | None = Field(default=None, max_length=256,
                                      description="stream ids; null: every stream")
    langs: list[str] | None = Field(default=None, max_length=64,
                                    description="caption languages; null: every language")
    ttl_s: int | None = Field(default=None, ge=1, le=MAX_MINT_TTL_S,
                              description="lifetime in seconds; null: auth.viewer_ttl_s")
    sub: str = Field(default="viewer", min_length=1, max_length=128,
                     description="who the token is for (shows in nothing but the token)")


def create_app(redis_url: str, streams: list[GatewayStream], event_name: str = "",
               engine_profiles: tuple[str, ...] = (), *, security: GatewaySecurity,
               hls: HlsOptions | None = None, group: WorkerGroup | None = None,
               worker_index: int = 0) -> FastAPI:
    """`engine_profiles`: names `/v1/realtime` clients may ask for in session.update;
    with one profile (or none named) any model name selects it. `security`: tokens,
    allowed origins and limits. `hls`: the live HLS WebVTT playlists (default options
    when None; `enabled=False` turns them off). `group`, `worker_index`: with several
    gateway workers on the port, where they reach each other and which one this is
    (`/metrics` and `/v1/status` then count all of them)."""
    hls_options = hls or HlsOptions()
    access = Access(security)
    ctx = GatewayContext(streams, access, engine_profiles)
    by_id = ctx.by_id
    for gs in by_id.values():  # its series exist from the start (orchestrator.metrics)
        metrics.zero_stream_series(gs.options.stream_id,
                                   (gs.options.caption_lang, *gs.options.targets),
                                   push=gs.source_kind == "push")
    exporter = TranscriptExporter(ctx)
    figures = GatewayMetrics(group, worker_index)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Clients that connect together (overlays reconnecting after a blip) read Redis
        # together: wait for a pooled connection; redis-py's default pool (8.x) raises
        # MaxConnectionsError past 100 and the WebSocket dies with it.
        redis = cancel_safe(Redis.from_pool(BlockingConnectionPool.from_url(
            redis_url, max_connections=100)))
        hub = CaptionHub(redis)
        await hub.start()
        ctx.bind(redis, hub, hls_options)
        _app.state.hub = hub
        follower = await admin_apply.StreamFollower(ctx, event_name, redis_url).start()  # hot apply
        await figures.start()
        try:
            yield
        finally:
            await figures.aclose()
            await follower.aclose()
            await hub.stop()
            await redis.aclose()

    app = FastAPI(title="Babelcast gateway", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    # Token and size before a byte of any body is read (see body_guard).
    app.add_middleware(BodyGuard, access=access, timeout_s=security.limits.body_timeout_s,
                       routes={
                           ("POST", "/v1/tokens"): BodyRoute(
                               MAX_TOKEN_REQUEST_BYTES, is_admin, "minting tokens"),
                           ("POST", "/v1/admin/apply"): BodyRoute(
                               admin_apply.MAX_BODY_BYTES + 4096, is_admin,
                               "applying an event file"),
                       })

    @app.exception_handler(RequestValidationError)
    async def validation_after_auth(request: Request,
                                    exc: RequestValidationError) -> Response:
        """FastAPI checks query and path parameters before an endpoint runs, so its 422
        (with what was wrong) answered anyone; it answers callers with a token (or public
        viewers) only, as the body's details do (body_guard)."""
        try:
            p, _ = access.principal(request.headers, request.query_params)
        except AuthError:
            p = None
        if p is None:
            metrics.GATEWAY_REFUSALS.labels(refusal="unauthorized").inc()
            return JSONResponse({"detail": "this request needs a token: send "
                                           "`Authorization: Bearer TOKEN` (see README, "
                                           "Security)"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await request_validation_exception_handler(request, exc)

    def require(request: Request, check: Any, what: str) -> Principal:
        try:
            return access.http(request, check, what)
        except HTTPException as exc:
            metrics.GATEWAY_REFUSALS.labels(
                refusal="unauthorized" if exc.status_code == 401 else "forbidden").inc()
            raise

    async def describe(gs: GatewayStream) -> dict[str, Any]:
        o = gs.options
        try:
            status = await ctx.bus.get_status(o.stream_id)
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
            # Numbers as numbers, the room's state, and the captions' lag (status.py).
            "status": typed_status(status),
        }

    @app.get("/livez")
    async def livez() -> JSONResponse:
        """Liveness: the process serves requests."""
        return JSONResponse({"ok": True})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Readiness: Redis answers and every live stream and actor is reporting."""
        ok, body = await readiness(ctx.bus, list(by_id))
        body.update(event=event_name, streams=len(by_id))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        require(request, can_scrape, "reading metrics")
        body = await figures.exposition()
        if body is None:  # worker 0 sums for the port (metrics_merge): not this time
            return PlainTextResponse("gateway worker 0 did not answer in time; retry",
                                     status_code=503)
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def event_status(request: Request) -> JSONResponse:
        """The headline figures `babelcast status` prints (see orchestrator/status.py)."""
        require(request, is_admin, "the event status")
        clients, workers, counted = await figures.clients(ctx.clients)
        try:
            body = await collect_status(ctx.bus, [s.options for s in by_id.values()],
                                        event_name, dict(clients))
        except Exception as exc:
            metrics.REDIS_ERRORS.labels(component="gateway").inc()
            return JSONResponse({"error": f"status unavailable: {type(exc).__name__}"},
                                status_code=503)
        body["clients"]["gateway_workers"] = {"count": workers, "counted": counted}
        return JSONResponse(body)

    @app.post("/v1/tokens")
    async def mint_token(request: Request, body: TokenRequest) -> JSONResponse:
        """A viewer token for the given streams and languages (admin only)."""
        require(request, is_admin, "minting tokens")
        if not access.auth.can_mint:
            raise HTTPException(409, "viewers are public in this event (auth.viewers: public)"
                                     "; there is no viewer token to mint")
        unknown = sorted(set(body.streams or ()) - set(by_id))
        if unknown:
            raise HTTPException(404, f"no stream(s) {', '.join(unknown)} in this event")
        ttl = body.ttl_s or access.auth.viewer_ttl_s
        token = access.auth.mint_viewer(streams=body.streams, langs=body.langs, ttl_s=ttl,
                                        subject=body.sub)
        return JSONResponse({"token": token, "expires_at": int(time.time() + ttl),
                             "streams": body.streams, "langs": body.langs})

    def visible(p: Principal) -> list[GatewayStream]:
        return [s for s in by_id.values() if p.can_view(s.options.stream_id)]

    @app.get("/v1/streams")
    async def list_streams(request: Request) -> list[dict[str, Any]]:
        p = require(request, can_view_any, "listing streams")
        return [await describe(s) for s in visible(p)]

    @app.get("/v1/streams/{stream_id}")
    async def get_stream(stream_id: str, request: Request) -> dict[str, Any]:
        require(request, can_view(stream_id), f"stream {stream_id!r}")
        gs = by_id.get(stream_id)
        if gs is None:
            raise HTTPException(404, f"no stream {stream_id!r} in this event")
        return await describe(gs)

    @app.get("/v1/streams/{stream_id}/transcript.{fmt}", response_class=PlainTextResponse,
             responses={200: {"content": {"text/vtt": {}, "application/x-subrip": {}}}})
    async def transcript(stream_id: str, fmt: Format, request: Request,
                         lang: Annotated[str | None, Query(max_length=16, description=(
                             "caption language; default: the stream's own"))] = None,
                         profile: Annotated[Profile, Query(description=(
                             "line-breaking profile of the cues"))] = "web") -> Response:
        """The stream's finals as a WebVTT or SRT file (see gateway.transcripts)."""
        gs = by_id.get(stream_id)
        lang = lang or (gs.options.caption_lang if gs else "")
        require(request, can_view(stream_id, lang or None),
                f"the transcript of {stream_id!r} in {lang!r}")
        return await exporter.response(stream_id, lang, fmt, profile)

    def link_token(request: Request, p: Principal) -> str | None:
        """The token to put in links: the viewer's own (from the URL), or for an admin a
        viewer token of every stream; none when viewers are public."""
        if access.auth.viewers_public:
            return None
        if p.kind == "viewer":
            return request.query_params.get("token")
        return access.auth.mint_viewer(subject="index")

    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request) -> HTMLResponse:
        p = require(request, can_view_any, "the stream index")
        return HTMLResponse(index_html(event_name, [s.options for s in visible(p)],
                                       hls=hls_options.enabled,
                                       token=link_token(request, p)))

    @app.get("/overlay/{stream_id}", response_model=None)
    async def overlay(stream_id: str, request: Request,
                      lang: Annotated[str | None, Query(max_length=16, description=(
                          "caption language; default: the stream's own"))] = None,
                      lang2: Annotated[str | None, Query(max_length=16, description=(
                          "a second language, shown below the first"))] = None) -> Response:
        """The overlay page (OBS browser source); its other parameters are read by the
        page itself (static/overlay.js)."""
        gs = by_id.get(stream_id)
        query = dict(request.query_params)
        for name in ("lang", "lang2"):
            if query.get(name):
                require(request, can_view(stream_id, query[name]),
                        f"captions of {stream_id!r} in {query[name]!r}")
        require(request, can_view(stream_id), f"captions of {stream_id!r}")
        if gs is None:
            return PlainTextResponse(f"no stream {stream_id!r} in this event; see / for the "
                                     "streams", status_code=404)
        if not query.get("lang"):
            # The page needs a language; the stream's own is the natural default.
            query["lang"] = gs.options.caption_lang
            return RedirectResponse(f"/overlay/{stream_id}?{urlencode(query)}",
                                    status_code=307)
        langs = ctx.languages(gs)
        for name in ("lang", "lang2"):
            if query.get(name) and query[name] not in langs:
                return PlainTextResponse(
                    f"stream {stream_id!r} has captions in {', '.join(langs)}; "
                    f"{name}={query[name]!r} is not one of them", status_code=404)
        return FileResponse(STATIC_DIR / "overlay.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache",
                                     "Referrer-Policy": "no-referrer"})

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
        if lang not in ctx.languages(gs):
            raise HTTPException(404, f"stream {stream_id!r} has captions in "
                                     f"{', '.join(ctx.languages(gs))}, not {lang!r}")

    async def hls_track(request: Request, stream_id: str, lang: str) -> HlsTrack:
        require(request, can_view(stream_id, lang), f"HLS of {stream_id!r} in {lang!r}")
        hls_track_or_404(stream_id, lang)
        assert ctx.hls is not None
        try:
            return await ctx.hls.track(stream_id, lang)
        except Exception as exc:
            metrics.REDIS_ERRORS.labels(component="gateway").inc()
            log.warning("HLS %s/%s: caption read failed: %s", stream_id, lang,
                        type(exc).__name__)
            raise HTTPException(503, "captions are unavailable; retry") from None

    @app.get("/hls/{stream_id}/{lang}.m3u8")
    async def hls_playlist(stream_id: str, lang: str, request: Request) -> Response:
        track = await hls_track(request, stream_id, lang)
        # Players fetch segments relative to the playlist and drop its query: a token
        # that came in the URL goes into every segment's URL.
        token = request.query_params.get("token")
        suffix = f"?{urlencode({'token': token})}" if token else ""
        body = track.playlist(lambda n: f"{lang}/{n}.vtt{suffix}")
        return Response(body, media_type="application/vnd.apple.mpegurl",
                        headers={**hls_headers, "Cache-Control": "no-cache"})

    @app.get("/hls/{stream_id}/{lang}/{n}.vtt")
    async def hls_segment(stream_id: str, lang: str, n: int, request: Request) -> Response:
        body = (await hls_track(request, stream_id, lang)).segment(n)
        if body is None:
            raise HTTPException(404, f"segment {n} is not in the playlist's window")
        return Response(body, media_type="text/vtt; charset=utf-8",
                        headers={**hls_headers,
                                 "Cache-Control": f"max-age={int(hls_options.segment_s)}"})

    @app.websocket("/v1/streams/{stream_id}/captions")
    async def captions_endpoint(ws: WebSocket, stream_id: str) -> None:
        await captions_ws(ctx, ws, stream_id)

    @app.websocket("/v1/realtime")
    async def realtime_endpoint(ws: WebSocket) -> None:
        await realtime_ws(ctx, ws)

    @app.websocket("/v1/streams/{stream_id}/audio")
    async def push_audio_endpoint(ws: WebSocket, stream_id: str) -> None:
        await push_audio_ws(ctx, ws, stream_id)

    admin_apply.install(app, ctx, event_name)  # POST /v1/admin/apply
    app.state.context = ctx
    return app
