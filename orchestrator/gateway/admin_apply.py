"""`POST /v1/admin/apply` and the gateway's live stream set (see orchestrator.apply).

The endpoint takes an event file's text (admin token; body at most `MAX_BODY_BYTES`;
`ApplyGate`: one apply in flight per gateway process and `RATE_PER_MIN` a minute),
validates it exactly as `babelcast validate` does (422 with the same lines, nothing
sent on), then queues it for the orchestrator on Redis and waits for its answer: 200
applied or unchanged, 409 refused (nothing changed), 429 busy, 504 no answer in
`WAIT_S`. The gateway itself never touches the runtime: it may be one of several
gateway processes, or run apart from `babelcast run`.

`StreamFollower` keeps a gateway process's stream set equal to what the orchestrator
last wrote to `event:{name}:streams`: it listens for the change notice on the channel
of that name and also reads the key every `POLL_S` (a notice sent while its pub/sub
connection was down is not lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator import metrics
from orchestrator.apply import MAX_QUEUED, control_key, reply_key, streams_key
from orchestrator.config import ConfigError, parse_event
from orchestrator.gateway.access import is_admin
from orchestrator.gateway.context import GatewayContext, GatewayStream
from workers.bus import connect_redis
from workers.events import StreamOptions

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024
"""An event file of a few hundred streams is ~50 KiB."""
RATE_PER_MIN = 6
WAIT_S = 150.0
"""The orchestrator starts a request within 60 s or answers `expired`; draining a stream
waits for its translations (translation.timeout_s) and archives (10 s) besides."""
POLL_S = 5.0


class ApplyRequest(BaseModel):
    """`POST /v1/admin/apply`: an event file to apply to the running event."""

    model_config = ConfigDict(extra="forbid")
    yaml: str = Field(max_length=MAX_BODY_BYTES, description="the event file's text")
    filename: str = Field(default="event.yaml", min_length=1, max_length=1024,
                          description="the file's name, as error lines show it")
    base_dir: str | None = Field(default=None, max_length=4096, description=(
        "folder that relative paths in the file resolve against, on the orchestrator's "
        "machine; default: the gateway's working folder"))


class ApplyGate:
    """One apply in flight per process, and at most `per_min` started a minute."""

    def __init__(self, per_min: int = RATE_PER_MIN) -> None:
        self.per_min = per_min
        self.lock = asyncio.Lock()
        self.started: list[float] = []

    def admit(self) -> None:
        now = time.monotonic()
        self.started = [t for t in self.started if now - t < 60.0]
        if self.lock.locked():
            raise HTTPException(409, "another apply is in progress; wait for its answer")
        if len(self.started) >= self.per_min:
            retry = int(60.0 - (now - self.started[0])) + 1
            raise HTTPException(429, f"at most {self.per_min} applies a minute; retry in "
                                     f"{retry} s", headers={"Retry-After": str(retry)})
        self.started.append(now)


async def _bounded_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES + 4096:
        raise HTTPException(413, f"the body is over {MAX_BODY_BYTES // 1024} KiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES + 4096:  # the JSON around the file's text
            raise HTTPException(413, f"the body is over {MAX_BODY_BYTES // 1024} KiB")
    return bytes(body)


def install(app: FastAPI, ctx: GatewayContext, event_name: str) -> None:
    """Add the endpoint to a gateway app."""
    router = APIRouter()
    gate = ApplyGate()

    @router.post("/v1/admin/apply")
    async def admin_apply(request: Request) -> JSONResponse:
        """Apply an event file to the running event (admin only); see orchestrator.apply."""
        try:
            ctx.access.http(request, is_admin, "applying an event file")
        except HTTPException as exc:
            metrics.GATEWAY_REFUSALS.labels(
                refusal="unauthorized" if exc.status_code == 401 else "forbidden").inc()
            raise
        gate.admit()
        async with gate.lock:
            raw = await _bounded_body(request)
            try:
                req = ApplyRequest.model_validate_json(raw)
            except ValidationError as exc:
                raise HTTPException(422, f"expected JSON {{yaml, filename, base_dir}}: "
                                         f"{exc.errors(include_url=False)[0]['msg']}") from None
            base = Path(req.base_dir) if req.base_dir else None
            try:
                await asyncio.to_thread(parse_event, req.yaml, filename=req.filename,
                                        base_dir=base)
            except ConfigError as exc:
                errors = [str(i) for i in exc.errors]
                return JSONResponse({"status": "invalid", "ok": False, "errors": errors,
                                     "message": "\n".join(errors)}, status_code=422)
            return await _hand_over(ctx, event_name, req)

    app.include_router(router)


async def _hand_over(ctx: GatewayContext, event_name: str, req: ApplyRequest) -> JSONResponse:
    request_id = uuid.uuid4().hex
    try:
        if await ctx.redis.llen(control_key(event_name)) >= MAX_QUEUED:
            raise HTTPException(429, "applies are queued at the orchestrator; retry later",
                                headers={"Retry-After": "10"})
        await ctx.redis.rpush(control_key(event_name), json.dumps(
            {"id": request_id, "sent_at": time.time(), **req.model_dump()}))
        # BLPOPs of 2 s: redis-py's socket timeout (5 s by default) fails a longer one.
        deadline = time.monotonic() + WAIT_S
        got = None
        while got is None and time.monotonic() < deadline:
            got = await ctx.redis.blpop([reply_key(event_name, request_id)], timeout=2)
    except HTTPException:
        raise
    except Exception as exc:
        raise HTTPException(503, f"Redis is unavailable ({type(exc).__name__}); nothing "
                                 "was applied") from None
    if got is None:
        raise HTTPException(504, f"the orchestrator did not answer in {WAIT_S:.0f} s; is "
                                 "`babelcast run` running? `babelcast status` shows what "
                                 "the event runs now")
    reply: dict[str, Any] = json.loads(got[1])
    code = {"refused": 409, "invalid": 422, "expired": 504, "failed": 500}.get(
        str(reply.get("status")), 200)
    return JSONResponse(reply, status_code=code)


# ---- the live stream set ----------------------------------------------------------------
def streams_from_view(raw: bytes | str) -> list[GatewayStream]:
    data = json.loads(raw)
    return [GatewayStream(StreamOptions(stream_id=str(s["id"]), name=str(s["name"]),
                                        source="", language=str(s["language"]),
                                        targets=tuple(str(t) for t in s["targets"])),
                          str(s["source_kind"]))
            for s in data["streams"]]


class StreamFollower:
    """Keeps `ctx.by_id` (and `ctx.push_ids`) equal to the orchestrator's stream set."""

    def __init__(self, ctx: GatewayContext, event_name: str, redis_url: str) -> None:
        self.ctx = ctx
        self.key = streams_key(event_name)
        self.redis_url = redis_url
        # Its own client: the pub/sub connection it holds for the process's lifetime is
        # not taken from the pool the clients' requests wait on.
        self._redis: Any = None
        self._seen: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> StreamFollower:
        self._redis = connect_redis(self.redis_url)
        with contextlib.suppress(Exception):  # Redis away: the loop reads it later
            await self.refresh()
        self._task = asyncio.create_task(self._run(), name="stream-follower")
        return self

    async def refresh(self) -> None:
        raw = await self._redis.get(self.key)
        if raw is None or raw == self._seen:
            return
        try:
            streams = streams_from_view(raw)
        except (ValueError, KeyError, TypeError):
            log.warning("%s holds no stream set; keeping the current one", self.key)
            return
        self._seen = raw
        new = {s.options.stream_id: s for s in streams}
        by_id = self.ctx.by_id  # changed in place: the endpoints hold this dict
        self.ctx.remove_streams([s for s in by_id if s not in new])
        by_id.update(new)
        self.ctx.push_ids[:] = [s for s, g in new.items() if g.source_kind == "push"]

    async def _run(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.key)
                while True:
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
                    await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("stream set: %s; reading again", type(exc).__name__)
                await asyncio.sleep(POLL_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._redis is not None:
            await self._redis.aclose()
