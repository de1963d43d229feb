"""Feeds the caption outputs (archives, YouTube) from the caption Streams in Redis.

One task reads every (stream, lang) Stream with one blocking XREAD: reading the
Streams, not pub/sub, means a restarted runner resumes where each output left
off and nothing published in between is missed. Each sink has its own cursor
(an archive resumes after the last seq in its file, a YouTube sink at the live
edge), and a failing sink is logged and counted without stopping the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from redis.asyncio import Redis

from orchestrator import metrics
from orchestrator.outputs.archive import ArchiveError, ArchiveWriter
from orchestrator.outputs.cues import as_note
from orchestrator.outputs.youtube import YoutubeCaptionSink, YoutubeOptions
from workers.aio import wait_for
from workers.bus import RedisBus, caption_from_json, captions_key
from workers.captions.linebreak import WEB, LineProfile
from workers.events import CaptionSegment

log = logging.getLogger(__name__)

READ_COUNT = 200
DRAIN_S = 3.0
"""How long closing waits for an output that has stopped moving to write what Redis already
holds. While the outputs keep writing, closing waits on (up to `DRAIN_MAX_S`): a loaded host
or a slow disk is slow, not stuck, and the captions of the stop's last seconds belong in the
archive."""
DRAIN_MAX_S = 30.0
"""The most closing waits for the outputs however they move (a stop must end)."""


def youtube_state_key(stream: str, lang: str) -> str:
    return f"outputs:youtube:{stream}:{lang}"


@dataclass(frozen=True, slots=True)
class OutputsOptions:
    """What the runner runs, as plain options (`outputs.config` builds them)."""

    archive_dir: Path | None = None
    archive_profile: LineProfile = field(default=WEB)
    youtube: tuple[YoutubeOptions, ...] = ()
    block_ms: int = 1000


class Sink(Protocol):
    name: str
    after_seq: int

    async def handle(self, seg: CaptionSegment) -> None: ...

    async def aclose(self) -> None: ...


class ArchiveSink:
    def __init__(self, writer: ArchiveWriter) -> None:
        self.writer = writer
        self.name = f"archive {writer.stream}/{writer.lang}"
        self.after_seq = 0
        self._cues = metrics.ARCHIVE_CUES.labels(stream=writer.stream, lang=writer.lang)

    async def open(self, latest_seq: int) -> None:
        held = await asyncio.to_thread(self.writer.open)
        if held > latest_seq:
            # Redis holds fewer captions than the file: a new event (or a flushed Redis)
            # reuses this folder. Keep the old files and start new ones.
            log.warning("%s: the files hold seq %d but Redis only %d; keeping them as "
                        "%s.until-*.vtt/srt and starting new ones", self.name, held,
                        latest_seq, self.writer.lang)
            await asyncio.to_thread(self.writer.rotate)
            held = 0
        self.after_seq = held

    async def handle(self, seg: CaptionSegment) -> None:
        # Audio skipped to catch up (the shedding policy): the archive says so where it
        # happened, as a cue of its own.
        seg = as_note(seg)
        if not seg.is_final:
            return  # interims are most publications; no thread hop for them
        n = await asyncio.to_thread(self.writer.write, seg)
        if n:
            self._cues.inc(n)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.writer.close)


class YoutubeSinkAdapter:
    def __init__(self, sink: YoutubeCaptionSink, after_seq: int) -> None:
        self.sink = sink
        self.name = sink.name
        self.after_seq = after_seq

    async def handle(self, seg: CaptionSegment) -> None:
        self.sink.offer(seg)

    async def aclose(self) -> None:
        # A moment for the last finals of the event to reach YouTube.
        await self.sink.aclose(drain_s=2.0)


class OutputsRunner:
    def __init__(self, redis: Redis, tracks: Sequence[tuple[str, str]],
                 options: OutputsOptions, *, own_redis: bool = False) -> None:
        self.redis = redis
        self._own_redis = own_redis
        self.bus = RedisBus(redis)
        self.tracks = list(dict.fromkeys(tracks))
        self.options = options
        self.sinks: dict[tuple[str, str], list[Sink]] = {}
        self._task: asyncio.Task[None] | None = None
        # Held while a caption is handed to sinks: `update` takes it before it stops the
        # reader, so a file is never closed under a write in flight.
        self._dispatching = asyncio.Lock()
        self.undecodable = 0

    async def start(self) -> None:
        for stream, lang in self.tracks:
            await self._open_track(stream, lang)
        if self.sinks:
            self._task = asyncio.create_task(self._read(), name="outputs-runner")

    async def _open_track(self, stream: str, lang: str) -> None:
        yt = {(o.stream, o.lang): o for o in self.options.youtube}
        latest = await self.bus.last_caption(stream, lang)
        latest_seq = latest.seq if latest else 0
        sinks: list[Sink] = []
        if self.options.archive_dir is not None:
            archive = ArchiveSink(ArchiveWriter(self.options.archive_dir, stream, lang,
                                                self.options.archive_profile))
            try:
                await archive.open(latest_seq)
            except (ArchiveError, OSError) as exc:
                metrics.OUTPUT_ERRORS.labels(output="archive").inc()
                log.error("%s: not archiving: %s", archive.name, exc)
            else:
                sinks.append(archive)
        if (stream, lang) in yt:
            sinks.append(await self._youtube(yt[(stream, lang)], latest_seq))
        if sinks:
            self.sinks[(stream, lang)] = sinks

    async def _restart_reader(self) -> None:
        """The read task again over the current tracks; each key resumes after its
        sinks' last seq, so nothing is read twice or skipped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.sinks:
            self._task = asyncio.create_task(self._read(), name="outputs-runner")

    async def update(self, tracks: Sequence[tuple[str, str]],
                     youtube: tuple[YoutubeOptions, ...] | None = None) -> list[str]:
        """A hot apply: start the outputs of new tracks, close (flushed) those of tracks
        that are gone, and restart a track whose YouTube sink changed. Tracks that did
        not change keep their sinks and files. Returns the closed tracks' names."""
        wanted = list(dict.fromkeys(tracks))
        changed: set[tuple[str, str]] = set()
        if youtube is not None:
            old = {(o.stream, o.lang): o for o in self.options.youtube}
            new = {(o.stream, o.lang): o for o in youtube}
            changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
            self.options = replace(self.options, youtube=youtube)
        gone = [t for t in self.tracks if t not in wanted or t in changed]
        added = [t for t in wanted if t not in self.tracks or t in changed]
        if not gone and not added:
            return []
        async with self._dispatching:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
                self._task = None
        closed: list[str] = []
        for key in gone:
            for sink in self.sinks.pop(key, []):
                try:
                    await sink.aclose()
                except Exception as exc:
                    log.error("%s: close failed: %s", sink.name, type(exc).__name__)
                closed.append(sink.name)
        self.tracks = wanted
        for stream, lang in added:
            await self._open_track(stream, lang)
        await self._restart_reader()
        return closed

    async def caught_up(self, stream: str, lang: str, seq: int, timeout_s: float) -> bool:
        """Until every sink of (stream, lang) has handled seq (True), or `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            sinks = self.sinks.get((stream, lang), [])
            if all(s.after_seq >= seq for s in sinks):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def _youtube(self, options: YoutubeOptions, latest_seq: int) -> YoutubeSinkAdapter:
        key = youtube_state_key(options.stream, options.lang)
        stored = await self.redis.hget(key, "seq")
        redis = self.redis

        async def remember(seq: int) -> None:
            await redis.hset(key, "seq", str(seq))

        sink = YoutubeCaptionSink(options, first_seq=int(stored or 0) + 1, on_posted=remember)
        await sink.start()
        # YouTube shows captions live only: a restarted sink starts at the live edge.
        return YoutubeSinkAdapter(sink, after_seq=latest_seq)

    async def aclose(self, drain_s: float = DRAIN_S, max_s: float = DRAIN_MAX_S) -> None:
        """Close the outputs once they hold what Redis holds: a stop publishes the open
        captions' finals just before (`AsrHost.stop`), and those belong in the archive
        (issue 36: the sentence open at SIGTERM was missing). Closing gives up when no
        output has written anything for `drain_s`, or after `max_s` in all."""
        held = False
        if self._task is not None and not self._task.done() and drain_s > 0:
            await self._drain(drain_s, max_s)
            # The caption being written as the drain ended is finished, not cut off
            # (`_dispatch` counts a caption as handled as it starts writing it).
            with contextlib.suppress(TimeoutError):
                await wait_for(self._dispatching.acquire(), drain_s)
                held = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if held:
            self._dispatching.release()
        for sinks in self.sinks.values():
            for sink in sinks:
                try:
                    await sink.aclose()
                except Exception as exc:
                    log.error("%s: close failed: %s", sink.name, type(exc).__name__)
        self.sinks.clear()
        if self._own_redis:
            await self.redis.aclose()

    async def _drain(self, stall_s: float, max_s: float) -> None:
        """Wait until every sink has handled the last seq Redis held when closing began,
        while the sinks keep moving (any of them: the reader serves the tracks in turn)."""
        latest: dict[tuple[str, str], int] = {}
        for stream, lang in list(self.sinks):
            try:
                latest[(stream, lang)] = await self.bus.last_seq(stream, lang)
            except Exception as exc:  # Redis away: close with what was read
                log.warning("outputs: cannot read %s/%s at close: %s", stream, lang,
                            type(exc).__name__)
                return
        loop = asyncio.get_running_loop()
        started = moved_at = loop.time()

        def behind() -> dict[tuple[str, str], int]:
            return {key: seq for key, seq in latest.items()
                    if any(s.after_seq < seq for s in self.sinks.get(key, []))}

        def written() -> int:
            return sum(s.after_seq for sinks in self.sinks.values() for s in sinks)

        seen = written()
        while left := behind():
            now = loop.time()
            if (total := written()) != seen:
                seen, moved_at = total, now
            if now - moved_at >= stall_s or now - started >= max_s:
                for (stream, lang), seq in left.items():
                    log.warning("outputs: %s/%s closed before seq %d was written (%s)",
                                stream, lang, seq,
                                f"nothing written for {stall_s:.0f} s"
                                if now - moved_at >= stall_s else f"{max_s:.0f} s in all")
                return
            await asyncio.sleep(0.05)

    async def _read(self) -> None:
        cursors = {captions_key(s, lang): min(k.after_seq for k in sinks)
                   for (s, lang), sinks in self.sinks.items()}
        by_key = {captions_key(s, lang): sinks for (s, lang), sinks in self.sinks.items()}
        backoff = 0.5
        while True:
            try:
                resp: Any = await self.redis.xread(
                    {k: f"{v}-0" for k, v in cursors.items()}, block=self.options.block_ms,
                    count=READ_COUNT)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                metrics.OUTPUT_ERRORS.labels(output="runner").inc()
                metrics.REDIS_ERRORS.labels(component="outputs").inc()
                log.warning("outputs: Redis read failed (%s); retrying in %.1f s",
                            type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.5
            for raw_key, entries in resp or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
                for entry_id, fields in entries:
                    seq = int((entry_id.decode() if isinstance(entry_id, bytes)
                               else str(entry_id)).split("-")[0])
                    if seq > cursors[key] + 1:
                        log.warning("outputs: %s jumped from seq %d to %d (captions trimmed "
                                    "from Redis before they were read?)", key, cursors[key],
                                    seq)
                    cursors[key] = seq
                    try:
                        seg = caption_from_json(fields[b"d"])
                    except (KeyError, ValueError, TypeError):
                        self.undecodable += 1
                        metrics.UNDECODABLE.labels(component="outputs").inc()
                        continue
                    async with self._dispatching:
                        await self._dispatch(by_key[key], seg)

    async def _dispatch(self, sinks: list[Sink], seg: CaptionSegment) -> None:
        for sink in sinks:
            if seg.seq <= sink.after_seq:
                continue
            sink.after_seq = seg.seq
            try:
                await sink.handle(seg)
            except Exception as exc:
                metrics.OUTPUT_ERRORS.labels(output=sink.name.split()[0]).inc()
                log.error("%s: caption seq %d not written: %s", sink.name, seg.seq,
                          type(exc).__name__ if not isinstance(exc, OSError)
                          else f"{exc.strerror} ({exc.filename})")
