"""The Redis data plane: key names, serialization, Streams and pub/sub.

Keys
- `audio:{stream}`            Stream of audio chunks and gap markers (capped, ~60 s).
- `captions:{stream}:{lang}`  Stream of caption publications, entry id `{seq}-0`, so
                              "everything after seq N" is one XRANGE; capped.
- `captions:{stream}:{lang}`  pub/sub channel of the same name, for live fan-out.
- `status:{stream}`           Hash with the stream's current state and counters.
- `mt:jobs`                   Stream of translation jobs, read through the consumer
                              group `translators` (see `translation.jobs`).
- `mt:done:{stream}:{lang}:{segment_id}`  Seq of the published final translation of a
                              segment (expires), so a re-claimed job publishes nothing twice.
- `babelcast:epoch`           Random id of this Redis's data set: when it is missing,
                              Redis came back empty (see `orchestrator.epoch`).

The bus takes an injected `redis.asyncio.Redis` client and never creates one; every
process makes its clients with `connect_redis` (or passes its own through `cancel_safe`).
A message it cannot decode is skipped and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from workers.events import AudioChunk, AudioGap, CaptionSegment, TranslationJob

log = logging.getLogger(__name__)

AUDIO_CHUNK_S = 0.1
AUDIO_MAXLEN = int(60 / AUDIO_CHUNK_S)
CAPTIONS_MAXLEN = 20_000
JOBS_KEY = "mt:jobs"
JOBS_MAXLEN = 100_000
DONE_TTL_S = 6 * 3600
EPOCH_KEY = "babelcast:epoch"


def audio_key(stream: str) -> str:
    return f"audio:{stream}"


def captions_key(stream: str, lang: str) -> str:
    return f"captions:{stream}:{lang}"


def status_key(stream: str) -> str:
    return f"status:{stream}"


def actor_key(actor_id: str) -> str:
    return f"actor:{actor_id}"


def cursor_key(stream: str) -> str:
    return f"asr:cursor:{stream}"


def owner_key(stream: str) -> str:
    """The token of the ASR runner that owns the stream's captions (`claim_stream`)."""
    return f"asr:owner:{stream}"


# Publish a caption only for the stream's owner: an actor cut off from Ray (its node lost)
# goes on for a while and must not write after the stream's new owner took it over.
# A missing owner (Redis came back empty) is taken by the first runner that publishes.
_PUBLISH_OWNED = """
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[4] then return -1 end
if not owner then redis.call('SET', KEYS[2], ARGV[4]) end
local function cursor()
  if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[3], 'after_id', ARGV[5], 'final_end_s', ARGV[6], 'at', ARGV[7])
  end
end
local ok = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], ARGV[1], 'd', ARGV[2])
if type(ok) == 'table' and ok.err then
  if string.find(ok.err, 'equal or smaller', 1, true) then cursor() return 0 end
  return redis.error_reply(ok.err)
end
redis.call('PUBLISH', KEYS[1], ARGV[2])
cursor()
return 1
"""


# ---- clients ----------------------------------------------------------------------
class _CancelSafeSend:
    """Sends a command under `asyncio.timeout` instead of `asyncio.wait_for`.

    redis-py (8.x: `socket_timeout` is 5 s by default) sends every command through
    `asyncio.wait_for(send, socket_timeout)`. On Python 3.11 `wait_for` runs the send as
    a task of its own, and a cancel that reaches the caller while that task has already
    finished is dropped: `wait_for` returns the send's result instead of raising. A loop
    of Redis commands stopped by `task.cancel()` then goes on as if never cancelled.
    Measured here (redis-py 8.1.0, Python 3.11.7, a loop of GETs cancelled 0-3 ms after
    it started): 233 of 300 cancels lost. `AsrHost.stop` waited on its audio reader for
    as long as its caller's own timeout (tests/test_redis_cancel.py). `asyncio.timeout`
    runs in the caller's task, so a cancel always comes out as CancelledError. Python
    3.12's `wait_for` is built on it, so there the base class's send is used as it is.
    """

    socket_timeout: float | None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        limit = self.socket_timeout
        if not limit or sys.version_info >= (3, 12):
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        self.socket_timeout = None  # the base class then writes without wait_for
        try:
            async with asyncio.timeout(limit):
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:  # ours: the base class closed the connection on the cancel
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = limit


_SAFE_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def cancel_safe(client: Redis) -> Redis:
    """`client`, its connections made cancel-safe (`_CancelSafeSend`): whatever class
    its URL chose (TCP, TLS, Unix socket). Call it before the client's first command."""
    pool = client.connection_pool
    base = pool.connection_class
    if not issubclass(base, _CancelSafeSend):
        if base not in _SAFE_CLASSES:
            _SAFE_CLASSES[base] = type(f"CancelSafe{base.__name__}", (_CancelSafeSend, base),
                                       {"__module__": __name__})
        pool.connection_class = _SAFE_CLASSES[base]
    return client


def connect_redis(url: str, **kwargs: Any) -> Redis:
    """`Redis.from_url(url, **kwargs)`, cancel-safe (see `_CancelSafeSend`)."""
    return cancel_safe(Redis.from_url(url, **kwargs))


def entry_ms(entry_id: str) -> int:
    """The millisecond part of a Redis Stream entry id (Redis's clock when it was added)."""
    return int(entry_id.split("-", 1)[0])


def done_key(stream: str, lang: str, segment_id: int) -> str:
    return f"mt:done:{stream}:{lang}:{segment_id}"


def _caption_dict(seg: CaptionSegment) -> dict[str, Any]:
    # A withdraw is its own message type, so a client that knows only "caption" ignores
    # it instead of showing an empty caption; captions keep their fields as they were.
    kind = "withdraw" if seg.withdrawn else "gap" if seg.gap_s else "caption"
    data: dict[str, Any] = {"type": kind, **asdict(seg)}
    data.pop("withdrawn")
    if not seg.gap_s:
        data.pop("gap_s")
    data["lines"] = list(seg.lines)
    return data


def caption_to_json(seg: CaptionSegment) -> str:
    return json.dumps(_caption_dict(seg), ensure_ascii=False, separators=(",", ":"))


def caption_from_json(raw: str | bytes) -> CaptionSegment:
    """A caption, a withdraw (`CaptionSegment.withdrawn`) or a gap event (`gap_s`)."""
    data = json.loads(raw)
    kind = data.pop("type", None)
    data.pop("withdrawn", None)
    data["lines"] = tuple(data["lines"])
    return CaptionSegment(**data, withdrawn=kind == "withdraw")


def job_to_json(job: TranslationJob) -> str:
    data: dict[str, Any] = asdict(job)
    data["targets"] = list(job.targets)
    data["context"] = list(job.context)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def job_from_json(raw: str | bytes) -> TranslationJob:
    """Raises ValueError (or KeyError/TypeError) on a malformed job."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a job must be a JSON object")
    data["targets"] = tuple(str(t) for t in data["targets"])
    data["context"] = tuple(str(c) for c in data.get("context", ()))
    job = TranslationJob(**data)
    if not isinstance(job.text, str) or not isinstance(job.segment_id, int):
        raise ValueError("job text must be a string and segment_id an integer")
    return job


# Publishes one translation atomically: its seq is the next one on (stream, lang)
# whoever publishes (several translators may write the same language), and a final
# for a segment that already has one is not published again (a re-claimed job).
# A late non-final for a segment whose final is out is dropped too: it would jump back.
# The next seq follows the Stream's last generated id (which survives trimming and the
# floor `orchestrator.epoch` sets after Redis came back empty) and the caller's own
# floor (the last seq it knows was out), so a seq is never given twice.
# KEYS: captions key, done key, epoch key. ARGV: JSON after the seq, maxlen, done ttl,
# is_final, floor, expected epoch ('' : do not check).
# Returns the seq, 0 (already published) or -1 (the epoch changed: Redis was emptied).
_PUBLISH_TRANSLATION = """
if ARGV[6] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[6] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local top = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      top = tonumber(string.match(info[i + 1], '^(%d+)'))
    end
  end
end
local seq = math.max(top, tonumber(ARGV[5])) + 1
local payload = '{"seq":' .. seq .. ARGV[1]
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], seq .. '-0', 'd', payload)
redis.call('PUBLISH', KEYS[1], payload)
if ARGV[4] == '1' then redis.call('SET', KEYS[2], seq, 'EX', ARGV[3]) end
return seq
"""


AudioItem = AudioChunk | AudioGap


def _decode_audio(stream: str, fields: Mapping[bytes, bytes]) -> AudioItem:
    kind = fields[b"k"]
    pos = int(fields[b"pos"])
    wall = float(fields[b"wall"])
    if kind == b"pcm":
        return AudioChunk(stream=stream, pos=pos, pcm=bytes(fields[b"pcm"]), wall=wall)
    if kind == b"gap":
        return AudioGap(
            stream=stream,
            pos=pos,
            duration_s=float(fields[b"dur"]),
            reason=fields.get(b"reason", b"").decode(),
            wall=wall,
        )
    raise ValueError(f"unknown audio entry kind {kind!r}")


class RedisBus:
    """All reads and writes of the data plane go through here."""

    def __init__(self, redis: Redis) -> None:
        # Any: redis-py types every reply as a union of all RESP shapes; each
        # method below decodes the one shape its command returns.
        self.redis: Any = redis
        self.undecodable = 0
        self._publish_owned: Any = None

    # ---- audio -------------------------------------------------------------
    async def add_audio(self, chunk: AudioChunk) -> str:
        entry_id = await self.redis.xadd(
            audio_key(chunk.stream),
            {"k": "pcm", "pos": chunk.pos, "wall": repr(chunk.wall), "pcm": chunk.pcm},
            maxlen=AUDIO_MAXLEN,
            approximate=True,
        )
        return as_str(entry_id)

    async def add_gap(self, gap: AudioGap) -> str:
        entry_id = await self.redis.xadd(
            audio_key(gap.stream),
            {
                "k": "gap",
                "pos": gap.pos,
                "wall": repr(gap.wall),
                "dur": repr(gap.duration_s),
                "reason": gap.reason,
            },
            maxlen=AUDIO_MAXLEN,
            approximate=True,
        )
        return as_str(entry_id)

    async def last_audio_end(self, stream: str) -> tuple[int, float | None]:
        """Where the stream's audio clock stands and the wall time of that point
        ((0, None) for a new stream)."""
        entries = await self.redis.xrevrange(audio_key(stream), count=1)
        if not entries:
            return 0, None
        _, fields = entries[0]
        pos = int(fields[b"pos"])
        if fields[b"k"] == b"pcm":
            pos += len(fields[b"pcm"]) // 2
        return pos, float(fields[b"wall"])

    async def last_audio_id(self, stream: str) -> str:
        entries = await self.redis.xrevrange(audio_key(stream), count=1)
        return as_str(entries[0][0]) if entries else "0-0"

    async def first_audio_id(self, stream: str) -> str:
        entries = await self.redis.xrange(audio_key(stream), count=1)
        return as_str(entries[0][0]) if entries else "0-0"

    async def had_owner(self, stream: str) -> bool:
        """Some ASR runner claimed the stream's captions before (`claim_stream`)."""
        return bool(await self.redis.exists(owner_key(stream)))

    async def load_cursor(self, stream: str) -> tuple[str, float] | None:
        """Where a new owner of the stream resumes: after audio entry `after_id` (the
        last one that ended at or before the last final), words up to `final_end_s`
        already captioned. Written with each final (`publish_caption`'s `cursor`)."""
        raw = await self.redis.hgetall(cursor_key(stream))
        try:
            return as_str(raw[b"after_id"]), float(raw[b"final_end_s"])
        except (KeyError, ValueError):
            return None

    async def read_audio(
        self, cursors: Mapping[str, str], block_ms: int = 500, count: int = 50
    ) -> list[tuple[str, str, AudioItem | None]]:
        """Read new audio for several streams at once: [(stream, entry_id, item)].

        An entry that cannot be decoded comes back as `None` (so the caller still
        advances its cursor); the hole it leaves shows as a jump of `pos`.
        """
        if not cursors:
            return []
        resp = await self.redis.xread(
            {audio_key(s): c for s, c in cursors.items()}, block=block_ms, count=count
        )
        out: list[tuple[str, str, AudioItem | None]] = []
        for key, entries in resp or []:
            stream = as_str(key).split(":", 1)[1]
            for entry_id, fields in entries:
                try:
                    out.append((stream, as_str(entry_id), _decode_audio(stream, fields)))
                except (KeyError, ValueError) as exc:
                    self.undecodable += 1
                    log.warning("skipping undecodable audio entry on %s: %s", stream, exc)
                    out.append((stream, as_str(entry_id), None))
        return out

    # ---- captions ----------------------------------------------------------
    async def claim_stream(self, stream: str, token: str) -> None:
        """Make `token` the stream's caption owner: publications with another owner
        token are refused from now on (see `publish_caption`)."""
        await self.redis.set(owner_key(stream), token)

    async def publish_caption(self, seg: CaptionSegment, owner: str | None = None,
                              cursor: tuple[str, float] | None = None) -> bool:
        """XADD at id `{seq}-0` and PUBLISH. Safe to call again after a connection
        error: an entry that did reach the Stream is not written twice (the live copy
        may be missing; the gateway catches its clients up from the Stream).

        With `owner`, atomically and only while `owner` is the stream's claimed owner
        (`claim_stream`): False, and nothing written, once another runner claimed it.
        `cursor` (with `owner`): the stream's cursor (`load_cursor`) written in the same
        step, so that no new owner finds a final published and its cursor not yet moved
        (it would caption the final's words again)."""
        key = captions_key(seg.stream, seg.lang)
        payload = caption_to_json(seg)
        if owner is not None:
            if self._publish_owned is None:  # EVALSHA from then on
                self._publish_owned = self.redis.register_script(_PUBLISH_OWNED)
            after_id, end_s = cursor if cursor is not None else ("", 0.0)
            done = int(await self._publish_owned(
                keys=[key, owner_key(seg.stream), cursor_key(seg.stream)],
                args=[f"{seg.seq}-0", payload, CAPTIONS_MAXLEN, owner, after_id,
                      repr(end_s), repr(time.time())]))
            if done == 0:
                log.warning("%s seq %d is already in its Stream; not written again", key,
                            seg.seq)
            return done >= 0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(key, {"d": payload}, id=f"{seg.seq}-0", maxlen=CAPTIONS_MAXLEN,
                      approximate=True)
            pipe.publish(key, payload)
            try:
                await pipe.execute()
            except ResponseError as exc:
                if "equal or smaller" not in str(exc):
                    raise
                log.warning("%s seq %d is already in its Stream; not written again", key,
                            seg.seq)
        return True

    async def last_seq(self, stream: str, lang: str) -> int:
        """The highest seq ever given on (stream, lang): the Stream's last generated id,
        which stays when entries are trimmed (0 for a new key)."""
        try:
            info = await self.redis.xinfo_stream(captions_key(stream, lang))
        except ResponseError:  # no such key
            return 0
        return int(as_str(info["last-generated-id"]).split("-")[0])

    async def publish_translation(self, seg: CaptionSegment, *, floor: int = 0,
                                  epoch: str = "") -> int:
        """Publish a translated caption under the next seq of its (stream, lang), above
        `floor`. With `epoch`, nothing is published if Redis's epoch is another one.

        `seg.seq` is ignored. Returns the seq given, 0 when nothing was published
        because the segment's final translation is already out, or -1 for an epoch
        mismatch (Redis was emptied; see `orchestrator.epoch`).
        """
        data = _caption_dict(seg)
        data.pop("seq")
        tail = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        seq = await self.redis.eval(
            _PUBLISH_TRANSLATION, 3, captions_key(seg.stream, seg.lang),
            done_key(seg.stream, seg.lang, seg.segment_id), EPOCH_KEY,
            "," + tail[1:], CAPTIONS_MAXLEN, DONE_TTL_S, "1" if seg.is_final else "0",
            floor, epoch,
        )
        return int(seq)

    async def epoch(self) -> str:
        """This Redis's data-set id ('' when unset: new, or emptied)."""
        value = await self.redis.get(EPOCH_KEY)
        return as_str(value) if value is not None else ""

    # ---- translation jobs ----------------------------------------------------
    async def enqueue_job(self, job: TranslationJob) -> str:
        entry_id = await self.redis.xadd(JOBS_KEY, {"d": job_to_json(job)},
                                         maxlen=JOBS_MAXLEN, approximate=True)
        return as_str(entry_id)

    async def last_caption(self, stream: str, lang: str) -> CaptionSegment | None:
        entries = await self.redis.xrevrange(captions_key(stream, lang), count=1)
        if not entries:
            return None
        return caption_from_json(entries[0][1][b"d"])

    async def captions_after(
        self, stream: str, lang: str, since: int, count: int = 1000
    ) -> list[CaptionSegment]:
        """Publications with seq > since, oldest first (at most `count`)."""
        entries = await self.redis.xrange(
            captions_key(stream, lang), min=f"({since}-0" if since >= 0 else "-", count=count
        )
        out: list[CaptionSegment] = []
        for _, fields in entries:
            try:
                out.append(caption_from_json(fields[b"d"]))
            except (KeyError, ValueError, TypeError):
                self.undecodable += 1
        return out

    # ---- status ------------------------------------------------------------
    async def set_status(self, stream: str, **fields: str | float | int) -> None:
        mapping: dict[str, str] = {k: str(v) for k, v in fields.items()}
        mapping["updated"] = repr(time.time())
        await self.redis.hset(status_key(stream), mapping=mapping)

    async def incr_status(self, stream: str, counter: str, amount: float = 1) -> None:
        await self.redis.hincrbyfloat(status_key(stream), counter, amount)

    async def set_actor_status(self, actor_id: str, fields: Mapping[str, float | str]) -> None:
        mapping = {k: str(v) for k, v in fields.items()}
        mapping["updated"] = repr(time.time())
        await self.redis.hset(actor_key(actor_id), mapping=mapping)

    async def get_status(self, stream: str) -> dict[str, str]:
        raw = await self.redis.hgetall(status_key(stream))
        return {as_str(k): as_str(v) for k, v in raw.items()}


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---- riding out a Redis restart --------------------------------------------------------
# Redis restarting (a crash, a failover, the local child being started again) shows as
# connection errors for a few seconds. Audio and captions in flight are held and written
# once it is back instead of being dropped, and the task that holds them stays alive;
# without this, file ingest died for good on the first error and the ASR side skipped a
# seq for the caption it could not write.
T = TypeVar("T")

RETRYABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError,
                                              ConnectionError, TimeoutError)
"""Redis unreachable, restarting or still loading its data (BusyLoadingError is a
ConnectionError); never a command error, which would fail again the same way."""

RETRY_FIRST_DELAY_S = 0.1
RETRY_MAX_DELAY_S = 1.0


async def retry_redis(op: Callable[[], Awaitable[T]], *, what: str, log: logging.Logger,
                      max_wait_s: float | None = None) -> T:
    """`op()`, retried with backoff (0.1 s doubling to 1 s) while Redis is unreachable;
    after `max_wait_s` (None: never) the last error is raised."""
    started = time.monotonic()
    delay = RETRY_FIRST_DELAY_S
    warned = False
    while True:
        try:
            result = await op()
        except RETRYABLE as exc:
            if max_wait_s is not None and time.monotonic() - started >= max_wait_s:
                raise
            if not warned:
                log.warning("%s: Redis unavailable (%s); holding it and retrying", what,
                            type(exc).__name__)
                warned = True
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_DELAY_S, delay * 2)
            continue
        if warned:
            log.warning("%s: Redis is back after %.1f s", what, time.monotonic() - started)
        return result
