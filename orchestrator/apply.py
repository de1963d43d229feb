"""Hot apply: a changed event file applied to the running event, one apply at a time.

`babelcast apply EVENT.yaml` and `POST /v1/admin/apply` (orchestrator.gateway.admin_apply)
validate the file, then hand it to the running `babelcast run` through Redis: a request
on the list `event:{name}:control`, the answer on `event:{name}:reply:{id}`. The gateway
never calls the runtime itself (it may run as several processes, or apart from the
orchestrator). The `ApplyController` here reads the list, one request at a time, diffs
the file against the running config and applies what can change live:

- a stream that is new is placed by the router on an ASR actor that is up and has room,
  and its ingest starts (a `source: push` stream is refused: its publish token is made
  when the gateway starts);
- a stream that is gone is drained: its ingest stops, its ASR session stops and a caption
  it left open becomes a final once, its translations are waited for (bounded, else
  named as not waited for), then its archives are closed once they hold its last
  caption; its router budget is free again;
- a stream's `targets` and `name`, the `glossary` and `outputs.youtube` change without
  interrupting any stream's session;
- the event's streams are written to `event:{name}:streams` and a notice is published
  on the channel of that name, so every gateway process serves the new set.

Anything else (engine, Redis, Ray, ingest, gateway, auth, translation, archive or HLS
settings, the event name, a stream's source or language) cannot change without
interrupting streams: the whole apply is refused with a message naming it, and nothing
changes. Streams that are neither added, removed nor changed are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from orchestrator.config import ConfigError, EventConfig, StreamConfig, parse_event
from orchestrator.outputs.config import caption_tracks, outputs_options
from orchestrator.source_config import read_stream_secrets
from workers.bus import RedisBus, done_key
from workers.events import StreamOptions

if TYPE_CHECKING:
    from orchestrator.outputs.runner import OutputsRunner
    from orchestrator.runtime import EventRuntime

log = logging.getLogger(__name__)

MAX_QUEUED = 4
"""Requests waiting on the control list; the gateway answers 429 past it."""
REPLY_TTL_S = 300
POLL_S = 0.25
"""How often the controller looks for a request."""
START_WITHIN_S = 60.0
"""A request not started this long after it was sent is answered `expired`, not applied:
whoever sent it has given up waiting."""


def control_key(event: str) -> str:
    return f"event:{event}:control"


def reply_key(event: str, request_id: str) -> str:
    return f"event:{event}:reply:{request_id}"


def streams_key(event: str) -> str:
    """The event's streams as the gateway serves them (JSON); also the channel on which
    a change is announced."""
    return f"event:{event}:streams"


def gateway_view(streams: list[StreamOptions], kinds: dict[str, str]) -> str:
    """What a gateway process needs of each stream (no source URL, no key)."""
    return json.dumps({"at": time.time(), "streams": [
        {"id": o.stream_id, "name": o.name, "language": o.language,
         "targets": list(o.targets), "source_kind": kinds[o.stream_id]} for o in streams]})


async def publish_streams(redis: Redis, cfg: EventConfig) -> None:
    """Write the event's stream set and tell every gateway process."""
    from orchestrator.actor_options import stream_options

    view = gateway_view([stream_options(s, cfg.translation) for s in cfg.streams],
                        {s.id: s.source_kind for s in cfg.streams})
    await redis.set(streams_key(cfg.event), view)
    await redis.publish(streams_key(cfg.event), "changed")


# ---- the diff ---------------------------------------------------------------------------
FIXED_SECTIONS = {
    "event": "the event name is the running event's identity (its Ray namespace and Redis "
             "keys); run the file as a new event instead",
    "redis": "the caption bus cannot move under a running event",
    "ray": "actors cannot move to another Ray cluster while they run",
    "engine": "the ASR engine and its pool are built when the event starts",
    "ingest": "the ingest pool is built when the event starts",
    "gateway": "the gateway's address, origins and limits are read when it starts",
    "auth": "tokens are read when the gateway starts",
    "translation": "the translator pool and routes are built when it starts",
}
LIVE_STREAM_FIELDS = ("targets", "name")


@dataclass
class Plan:
    added: list[StreamConfig] = field(default_factory=list)
    removed: list[StreamConfig] = field(default_factory=list)
    changed: dict[str, list[str]] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    glossary: bool = False
    youtube: bool = False
    refused: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.glossary
                    or self.youtube)


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _stream_dump(s: StreamConfig) -> dict[str, Any]:
    return {**s.model_dump(mode="json"), "source": s.resolved_source}


def keep_running_budget(old: EventConfig, new: EventConfig) -> EventConfig:
    """`new`, with the running event's `engine.streams_per_actor` where neither file sets
    it: the embedded default with `engine.calibrate` moves once the event's first start
    has measured the host (orchestrator/capacity.py), and that takes effect at the next
    start rather than refusing every apply as an engine change."""
    set_in = old.engine.model_fields_set | new.engine.model_fields_set
    if ("streams_per_actor" in set_in or old.engine.kind != new.engine.kind
            or old.engine.streams_per_actor == new.engine.streams_per_actor):
        return new
    engine = new.engine.model_copy(update={"streams_per_actor": old.engine.streams_per_actor})
    engine.model_fields_set.discard("streams_per_actor")  # still the file's default
    return new.model_copy(update={"engine": engine})


def plan(old: EventConfig, new: EventConfig,
         environ: dict[str, str] | None = None) -> Plan:
    """What applying `new` to a running `old` does, or why it cannot (`refused`)."""
    p = Plan()
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    for section, why in FIXED_SECTIONS.items():
        if a[section] != b[section]:
            keys = (_differing(a[section], b[section])
                    if isinstance(a[section], dict) and isinstance(b[section], dict) else [])
            what = f"{section}.{{{', '.join(keys)}}}" if keys else section
            p.refused.append(f"{what} changed: {why}; restart the event to change it")
    for part in ("archive", "hls"):
        if a["outputs"][part] != b["outputs"][part]:
            p.refused.append(f"outputs.{part} changed: it is set up when the event starts; "
                             "restart the event to change it")
    if old.outputs.archive.resolved_dir != new.outputs.archive.resolved_dir:
        p.refused.append("outputs.archive.dir names another folder (relative to the file's "
                         "folder); restart the event to change it")
    p.youtube = a["outputs"]["youtube"] != b["outputs"]["youtube"]
    p.glossary = a["glossary"] != b["glossary"]
    before = {s.id: s for s in old.streams}
    after = {s.id: s for s in new.streams}
    p.removed = [s for sid, s in before.items() if sid not in after]
    p.added = [s for sid, s in after.items() if sid not in before]
    for s in p.added:
        if s.source_kind == "push":
            p.refused.append(f"stream {s.id!r}: a push stream's publish token is made when "
                             "the gateway starts; restart the event to add it")
    _, problems = read_stream_secrets(new.streams, os.environ if environ is None else environ)
    p.refused += [f"{problem} (in the environment of `babelcast run`)" for problem in problems
                  if any(f"({s.id})" in problem for s in p.added)]
    for sid, s in after.items():
        if sid not in before:
            continue
        diff = _differing(_stream_dump(before[sid]), _stream_dump(s))
        fixed = [k for k in diff if k not in LIVE_STREAM_FIELDS]
        if fixed:
            p.refused.append(f"stream {sid!r}: {', '.join(fixed)} changed: that restarts its "
                             "session; remove the stream and add it under a new id, or "
                             "restart the event")
        elif diff:
            p.changed[sid] = diff
        else:
            p.unchanged.append(sid)
    return p


# ---- the controller ---------------------------------------------------------------------
class ApplyController:
    """Reads apply requests from Redis and applies them to `runtime`, one at a time."""

    def __init__(self, runtime: EventRuntime, redis: Redis, outputs: OutputsRunner | None,
                 *, on_applied: Callable[[EventConfig], None] | None = None,
                 block_s: float = 2.0) -> None:
        self.runtime = runtime
        self.redis: Any = redis
        self.outputs = outputs
        self.on_applied = on_applied
        # How long the controller idles between the glossary's upkeep ticks.
        self.block_s = block_s
        self.event = runtime.cfg.event
        self.applied = 0
        self._glossary_live = False
        self._glossary_sent = 0.0

    async def run(self) -> None:
        backoff = 0.5
        idle_s = 0.0
        me = asyncio.current_task()
        while True:
            try:
                raw = await self.redis.lpop(control_key(self.event))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: requests wait in the list
                log.warning("apply: cannot read requests (%r); retrying in %.1f s",
                            exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            # redis-py 8.1 can swallow a cancellation that lands inside a command (the
            # command then returns): without this check Ctrl-C left `babelcast run`
            # waiting for this loop for good.
            if me is not None and me.cancelling():
                raise asyncio.CancelledError
            item = None if raw is None else (control_key(self.event), raw)
            if item is None:
                await asyncio.sleep(POLL_S)
                idle_s += POLL_S
                if idle_s < self.block_s:
                    continue
                idle_s = 0.0
            backoff = 0.5
            if item is None:
                await self._keep_glossary()
                continue
            try:
                req = json.loads(item[1])
                request_id = str(req["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("apply: an undecodable request was skipped")
                continue
            try:
                reply = await self.handle(req)
            except Exception as exc:  # the event goes on; the caller is told
                log.exception("apply %s failed", request_id)
                reply = {"status": "failed", "ok": False,
                         "problems": [f"the apply failed: {type(exc).__name__}; see the "
                                      "`babelcast run` log"]}
            with contextlib.suppress(Exception):
                key = reply_key(self.event, request_id)
                await self.redis.rpush(key, json.dumps(reply))
                await self.redis.expire(key, REPLY_TTL_S)

    async def _keep_glossary(self) -> None:
        """A translator that Ray restarted was built with the starting file's glossary:
        after a live glossary change, send it again every 30 s (at an idle tick)."""
        if self._glossary_live and time.monotonic() - self._glossary_sent >= 30.0:
            self._glossary_sent = time.monotonic()
            for problem in await self.runtime.set_glossary(timeout_s=5.0):
                log.warning("apply: %s", problem)

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        if time.time() > float(req.get("sent_at", 0)) + START_WITHIN_S:
            return {"status": "expired", "ok": False, "problems": [
                "the request waited too long to start; nothing was applied; send it again"]}
        base_dir = req.get("base_dir")
        try:
            new = await asyncio.to_thread(
                parse_event, str(req["yaml"]), filename=str(req.get("filename") or "<apply>"),
                base_dir=Path(base_dir) if base_dir else None)
        except ConfigError as exc:
            return {"status": "invalid", "ok": False, "errors": [str(i) for i in exc.errors]}
        return await self.apply(new)

    async def apply(self, new: EventConfig) -> dict[str, Any]:
        rt = self.runtime
        old = rt.cfg
        new = keep_running_budget(old, new)
        p = plan(old, new)
        summary: dict[str, Any] = {
            "event": old.event, "added": [s.id for s in p.added],
            "removed": [s.id for s in p.removed], "changed": p.changed,
            "unchanged": p.unchanged, "glossary": p.glossary, "youtube": p.youtube}
        if p.refused:
            return {**summary, "status": "refused", "ok": False, "refused": p.refused}
        if p.empty:
            return {**summary, "status": "unchanged", "ok": True, "problems": []}
        problems: list[str] = []
        placed: dict[str, str] = {}
        drained: dict[str, dict[str, Any]] = {}
        async with rt.control_lock:
            assert rt.router is not None
            room = rt.free_slots(releasing=frozenset(s.id for s in p.removed))
            if len(p.added) > room:
                return {**summary, "status": "refused", "ok": False, "refused": [
                    f"{len(p.added)} stream(s) to add but the ASR actors that are up have "
                    f"room for {room}; remove streams, or raise engine.actors or "
                    "engine.streams_per_actor and restart the event"]}
            for s in p.removed:
                last_seq, problem = await rt.remove_stream(s)
                drained[s.id] = {"last_seq": last_seq}
                if problem:
                    problems.append(f"{s.id}: {problem}")
            # From here on the supervisor works from the new file (it re-adds what the
            # pins name, with the new targets).
            rt.cfg = new
            for s in p.added:
                try:
                    placed[s.id] = await rt.add_stream(s)
                except Exception as exc:
                    problems.append(f"{s.id}: not started: {exc}" if not isinstance(
                        exc, TimeoutError) else f"{s.id}: its actor did not answer; the "
                        "supervisor adds it at its next pass")
            for sid in p.changed:
                problem = await rt.update_stream(next(s for s in new.streams if s.id == sid))
                if problem:
                    problems.append(f"{sid}: {problem}")
            if p.glossary:
                problems += await rt.set_glossary()
                self._glossary_live, self._glossary_sent = True, time.monotonic()
        try:
            await publish_streams(self.redis, new)
        except Exception as exc:
            problems.append(f"gateways not told of the new streams: {type(exc).__name__}")
        for s in p.removed:
            drained[s.id].update(await self._finish(s, old, drained[s.id]["last_seq"]))
        problems += await self._update_outputs(new)
        with contextlib.suppress(Exception):
            await rt.report_status()
        if self.on_applied is not None:
            self.on_applied(new)
        self.applied += 1
        log.warning("apply: %d added, %d removed, %d changed, %d unchanged%s",
                    len(p.added), len(p.removed), len(p.changed), len(p.unchanged),
                    ", glossary" if p.glossary else "")
        return {**summary, "status": "applied", "ok": not problems, "placed": placed,
                "drained": drained, "problems": problems}

    async def _finish(self, s: StreamConfig, old: EventConfig, last_seq: int
                      ) -> dict[str, Any]:
        """A removed stream's translations (bounded wait), then its archives complete."""
        from orchestrator.actor_options import stream_options

        opts = stream_options(s, old.translation)
        lang = opts.caption_lang
        out: dict[str, Any] = {}
        bus = RedisBus(self.redis)
        if opts.targets:
            out["translations"] = await self._translations(
                bus, s.id, lang, list(opts.targets), old.translation.timeout_s + 5.0)
        if self.outputs is not None:
            seqs = {lang: last_seq}
            for t in opts.targets:
                seqs[t] = await bus.last_seq(s.id, t)
            late = [lg for lg, q in seqs.items()
                    if not await self.outputs.caught_up(s.id, lg, q, timeout_s=10.0)]
            if late:
                out["outputs_behind"] = late
        return out

    async def _translations(self, bus: RedisBus, stream: str, lang: str, targets: list[str],
                            timeout_s: float) -> str:
        """Until the stream's last final is translated into every target ('finished'),
        or why not."""
        last = await bus.last_caption(stream, lang)
        if last is None or not last.is_final or not last.text:
            return "finished"
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [t for t in targets
                       if not await self.redis.exists(done_key(stream, t, last.segment_id))]
            if not missing:
                return "finished"
            if time.monotonic() >= deadline:
                return (f"not waited for past {timeout_s:.0f} s in {', '.join(missing)}: "
                        "published to Redis when done, not archived")
            await asyncio.sleep(0.2)

    async def _update_outputs(self, new: EventConfig) -> list[str]:
        from orchestrator.actor_options import stream_options

        if self.outputs is None:
            return []
        options, problems = outputs_options(new.outputs)
        tracks = caption_tracks([stream_options(s, new.translation) for s in new.streams])
        try:
            await self.outputs.update(tracks, options.youtube)
        except Exception as exc:
            problems.append(f"outputs not updated: {type(exc).__name__}")
        return problems
