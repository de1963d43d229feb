"""`GET /v1/streams/{id}/transcript.vtt|.srt?lang=xx&profile=web`: a stream's finals as
a WebVTT or SRT file, built from the caption Stream like `babelcast export --redis`
(orchestrator.outputs.export), for a user who has the gateway but not Redis.

Who may: whoever may read that stream's captions in that language (a viewer token
scoped to it, or admin; anyone with `auth.viewers: public`). The file holds exactly the
finals a viewer gets by replaying the captions WebSocket with `since=0`, so a stricter
scope would protect nothing while sending viewers to the slower replay.

Bounds: one export reads the whole Stream (at most `workers.bus.CAPTIONS_MAXLEN`
publications, a few MB), so at most `MAX_CONCURRENT` run at once; past that the
answer is 429 with `Retry-After`. Building the cues runs in a thread so a long
transcript never stalls live captions on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import HTTPException
from fastapi.responses import Response

from orchestrator import metrics
from orchestrator.gateway.context import GatewayContext
from orchestrator.outputs.export import read_finals, render
from workers.bus import RETRYABLE
from workers.captions.linebreak import get_profile

log = logging.getLogger(__name__)

Format = Literal["vtt", "srt"]
Profile = Literal["web", "cea608", "youtube"]
MEDIA_TYPES: dict[str, str] = {"vtt": "text/vtt; charset=utf-8",
                               "srt": "application/x-subrip; charset=utf-8"}
MAX_CONCURRENT = 2
"""Exports at once per gateway: each holds a Stream's worth of captions in memory."""


class TranscriptExporter:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx
        self._running = 0

    def check(self, stream_id: str, lang: str) -> None:
        """404 for an unknown stream or a language it does not have."""
        gs = self.ctx.by_id.get(stream_id)
        if gs is None:
            raise HTTPException(404, f"no stream {stream_id!r} in this event")
        langs = self.ctx.languages(gs)
        if lang not in langs:
            raise HTTPException(404, f"stream {stream_id!r} has captions in "
                                     f"{', '.join(langs)}, not {lang!r}")

    async def response(self, stream_id: str, lang: str, fmt: Format,
                       profile: Profile) -> Response:
        self.check(stream_id, lang)
        if self._running >= MAX_CONCURRENT:
            metrics.GATEWAY_REFUSALS.labels(refusal="cap").inc()
            raise HTTPException(429, f"{MAX_CONCURRENT} transcript exports are running; "
                                     "retry in a few seconds", headers={"Retry-After": "5"})
        self._running += 1
        try:
            try:
                finals = await read_finals(self.ctx.bus, stream_id, lang)
            except RETRYABLE as exc:
                metrics.REDIS_ERRORS.labels(component="gateway").inc()
                log.warning("transcript %s/%s: caption read failed: %s", stream_id, lang,
                            type(exc).__name__)
                raise HTTPException(503, "captions are unavailable for a moment (Redis); "
                                         "retry", headers={"Retry-After": "5"}) from None
            text = await asyncio.to_thread(render, finals, fmt, get_profile(profile))
        finally:
            self._running -= 1
        filename = f"{stream_id}-{lang}.{fmt}"
        return Response(text, media_type=MEDIA_TYPES[fmt], headers={
            "Content-Disposition": f'attachment; filename="{filename}"',
            "Cache-Control": "no-store", "Content-Language": lang,
            "X-Babelcast-Finals": str(len(finals))})
