"""`babelcast export`: rebuild a WebVTT or SRT file of one stream's finals from Redis.

Reads the whole caption Stream `captions:{stream}:{lang}` (capped at
`workers.bus.CAPTIONS_MAXLEN` publications, so a long event's oldest captions
may be gone: the archive files written during the event keep everything).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.exceptions import RedisError

from orchestrator.outputs.archive import build_srt, build_vtt, sort_key
from orchestrator.outputs.cues import Cue, FinalFilter, final_cues
from workers.bus import RedisBus, captions_key, connect_redis, status_key
from workers.captions.linebreak import LineProfile
from workers.events import CaptionSegment

Format = Literal["vtt", "srt"]
FORMATS: tuple[Format, ...] = ("vtt", "srt")
_BATCH = 1000


class ExportError(RuntimeError):
    """A problem the operator can fix; the message says how."""


def safe_url(url: str) -> str:
    """`url` without a password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=f"***@{netloc}"))


async def read_finals(bus: RedisBus, stream: str, lang: str) -> list[CaptionSegment]:
    """Every final in the Stream, each segment once (the first final wins)."""
    finals: list[CaptionSegment] = []
    keep = FinalFilter(remember=1 << 30)
    since = 0
    while True:
        batch = await bus.captions_after(stream, lang, since, count=_BATCH)
        finals.extend(seg for seg in batch if keep.accept(seg))
        if len(batch) < _BATCH:
            return finals
        since = batch[-1].seq


def render(finals: list[CaptionSegment], fmt: Format, profile: LineProfile) -> str:
    cues: list[Cue] = sorted((c for seg in finals for c in final_cues(seg, profile)),
                             key=sort_key)
    return build_vtt(cues) if fmt == "vtt" else build_srt(cues)


async def languages_of(redis: Redis, stream: str) -> list[str]:
    prefix = captions_key(stream, "")
    found = [key.decode() if isinstance(key, bytes) else str(key)
             async for key in redis.scan_iter(match=f"{prefix}*", count=500)]
    return sorted(key[len(prefix):] for key in found)


async def known_streams(redis: Redis) -> list[str]:
    """Streams this Redis has status or captions for (an event's streams, past or running)."""
    found: set[str] = set()
    # "status:{stream}" and "captions:{stream}:{lang}"
    for prefix in (status_key(""), captions_key("", "").removesuffix(":")):
        async for key in redis.scan_iter(match=f"{prefix}*", count=500):
            name = (key.decode() if isinstance(key, bytes) else str(key))[len(prefix):]
            found.add(name.split(":", 1)[0])
    return sorted(found)


async def export_captions(redis_url: str, stream: str, lang: str | None, fmt: Format,
                          profile: LineProfile) -> tuple[str, str, int]:
    """(file text, language, number of finals) for one stream; ExportError on problems."""
    redis = connect_redis(redis_url)
    try:
        try:
            await redis.ping()
            langs = await languages_of(redis, stream)
        except (RedisError, OSError) as exc:
            raise ExportError(
                f"cannot reach Redis at {safe_url(redis_url)} ({type(exc).__name__}); pass "
                "the event's Redis with --redis URL or BABELCAST_REDIS_URL") from None
        if not langs and stream not in await known_streams(redis):
            have = ", ".join(await known_streams(redis)) or "none"
            raise ExportError(f"unknown stream {stream!r}: Redis at {safe_url(redis_url)} "
                              f"has no status or captions for it (streams there: {have}); "
                              "check the stream id and --redis")
        if lang is None:
            if len(langs) != 1:
                have = ", ".join(langs) if langs else "none"
                raise ExportError(f"stream {stream!r}: say which language with --lang "
                                  f"(captions in Redis: {have})")
            lang = langs[0]
        if lang not in langs:
            have = ", ".join(langs) if langs else "none for this stream"
            raise ExportError(f"no captions for stream {stream!r} in language {lang!r} at "
                              f"{safe_url(redis_url)} (languages there: {have})")
        finals = await read_finals(RedisBus(redis), stream, lang)
    finally:
        await redis.aclose()
    return render(finals, fmt, profile), lang, len(finals)
