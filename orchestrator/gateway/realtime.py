"""Babelcast's own vLLM-compatible `/v1/realtime` WebSocket endpoint.

An existing realtime client pushes audio exactly as it would to `vllm serve`;
the audio goes into a push stream of the event (`?stream=ID`, or the event's
only push stream), so it is captioned and delivered as usual, and the client
gets the stream's committed text back as `transcription.delta` events. Deltas
are append-only: they carry the stable part of captions (what will never
change), never the tentative tail. A bad event gets an `error` event with the
protocol's code; the socket and the stream survive.

Bounds: one append carries at most `append_max_bytes` of decoded audio, at most
`precommit_max_s` of audio waits for the first commit (a larger append is refused with
`invalid_audio`; what was taken stays), a text message is at most `MAX_TEXT_CHARS`, and
the audio is paced like pushed PCM (the `admit` callback raises the close).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import WebSocket, WebSocketDisconnect

from orchestrator.gateway.hub import CaptionHub, ClientQueue, Resync, SlowClient
from orchestrator.gateway.limits import RateLimited
from orchestrator.gateway.realtime_protocol import (
    AudioAppend,
    AudioCommit,
    ProtocolError,
    SessionUpdate,
    decode_audio,
    error_event,
    parse_client_event,
    server_event,
)
from workers.aio import wait_for
from workers.bus import RedisBus, captions_key
from workers.events import SAMPLE_RATE, CaptionSegment
from workers.ingest import AudioClock, write_audio

DONE_WAIT_S = 15.0  # after the final commit: how long the last words may take
MAX_TEXT_CHARS = 96 * 1024
"""A 64 KiB append is 87,382 base64 characters; JSON around it fits in this."""


@dataclass(frozen=True, slots=True)
class RealtimeLimits:
    append_max_bytes: int = 65_536
    precommit_max_s: float = 30.0
    admit: Callable[[int], bool] | None = None
    """The publisher's pace: False for an append past it (the socket is closed)."""


class TranscriptText:
    """Turns caption publications into append-only text: the stable prefix of each
    segment (all of a final), segments joined by spaces, in segment order."""

    def __init__(self) -> None:
        self._stable: dict[int, str] = {}
        self.sent = ""

    def update(self, seg: CaptionSegment) -> str:
        stable = seg.text if seg.is_final else seg.text[: seg.stable_prefix_len]
        if len(stable.strip()) >= len(self._stable.get(seg.segment_id, "")):
            self._stable[seg.segment_id] = stable.strip()
        full = " ".join(t for _, t in sorted(self._stable.items()) if t)
        if not full.startswith(self.sent) or len(full) == len(self.sent):
            return ""
        delta, self.sent = full[len(self.sent) :], full
        return delta


class RealtimeConnection:
    """One `/v1/realtime` socket bound to one push stream."""

    def __init__(self, ws: WebSocket, *, stream_id: str, lang: str, bus: RedisBus,
                 hub: CaptionHub, clock_for: Callable[[str], AudioClock],
                 accepts: Callable[[str], bool],
                 writer: Callable[[bytes], Awaitable[None]] | None = None,
                 limits: RealtimeLimits | None = None,
                 ) -> None:
        self.ws = ws
        self.stream_id = stream_id
        self.lang = lang
        self.bus = bus
        self.hub = hub
        self.clock_for = clock_for
        self.accepts = accepts
        self.writer = writer
        self.limits = limits or RealtimeLimits()
        self.pending_bytes = 0
        self.model: str | None = None
        self.started = False
        self.pending: list[bytes] = []
        self.audio_samples = 0
        self.text = TranscriptText()
        self.listener: asyncio.Task[None] | None = None
        self.last_audio_end_s = 0.0
        self.final_seen_to_s = 0.0
        self.progress = asyncio.Event()

    async def send(self, raw: str) -> None:
        await self.ws.send_text(raw)

    async def run(self) -> None:
        await self.send(server_event("session.created", id=f"sess_{uuid.uuid4().hex[:16]}",
                                     created=int(time.time())))
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                raw = msg.get("text")
                if raw is None:
                    await self.send(error_event("invalid_event", "send JSON text events"))
                    continue
                if len(raw) > MAX_TEXT_CHARS:
                    await self.send(error_event(
                        "invalid_event", f"message of {len(raw)} characters: at most "
                        f"{MAX_TEXT_CHARS}; send audio in smaller appends"))
                    continue
                try:
                    await self.handle(parse_client_event(raw))
                except ProtocolError as exc:
                    await self.send(error_event(exc.code, str(exc)))
        except WebSocketDisconnect:
            return
        finally:
            await self.stop_listening()
            self.clock_for(self.stream_id).pending_reason = "realtime-disconnected"

    async def handle(self, event: SessionUpdate | AudioAppend | AudioCommit) -> None:
        if isinstance(event, SessionUpdate):
            if not self.accepts(event.model):
                raise ProtocolError("model_not_found", f"no engine profile {event.model[:64]!r}")
            self.model = event.model
            return
        if isinstance(event, AudioAppend):
            pcm = decode_audio(event)
            lim = self.limits
            if len(pcm) > lim.append_max_bytes:
                raise ProtocolError("invalid_audio", f"append of {len(pcm)} bytes: at most "
                                    f"{lim.append_max_bytes} decoded bytes each; split it")
            if not self.started:
                held_s = (self.pending_bytes + len(pcm)) / 2 / SAMPLE_RATE
                if held_s > lim.precommit_max_s:
                    raise ProtocolError(
                        "invalid_audio", f"more than {lim.precommit_max_s:g} s of audio before "
                        "the first commit; send input_audio_buffer.commit to start (this "
                        "append was not taken)")
            if lim.admit is not None and not lim.admit(len(pcm)):
                raise RateLimited
            if self.started:
                await self.write(pcm)
            else:
                self.pending.append(pcm)
                self.pending_bytes += len(pcm)
            return
        if self.model is None:
            raise ProtocolError("model_not_validated", "send session.update with a model first")
        if not self.started:
            await self.start()
        if event.final:
            await self.finish()

    async def start(self) -> None:
        self.started = True
        queue = ClientQueue()
        await self.hub.subscribe(captions_key(self.stream_id, self.lang), queue)
        latest = await self.bus.last_caption(self.stream_id, self.lang)
        self.listener = asyncio.create_task(self.listen(queue, latest.seq if latest else 0))
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        for pcm in pending:
            await self.write(pcm)

    async def write(self, pcm: bytes) -> None:
        clock = self.clock_for(self.stream_id)
        if self.writer is not None:
            await self.writer(pcm)
        else:
            await write_audio(self.bus, clock, pcm)
        self.audio_samples += len(pcm) // 2
        self.last_audio_end_s = clock.pos / SAMPLE_RATE

    async def listen(self, queue: ClientQueue, after_seq: int) -> None:
        last = after_seq
        try:
            while True:
                try:
                    batch = [await queue.get()]
                except Resync:  # Redis came back: what was published meanwhile
                    batch = await self.bus.captions_after(self.stream_id, self.lang, last)
                except SlowClient:
                    return
                for seg in batch:
                    if seg.seq <= last:
                        continue
                    last = seg.seq
                    await self.on_caption(seg)
        finally:
            await self.hub.unsubscribe(captions_key(self.stream_id, self.lang), queue)

    async def on_caption(self, seg: CaptionSegment) -> None:
        delta = self.text.update(seg)
        if delta:
            await self.send(server_event("transcription.delta", delta=delta))
        if seg.is_final:
            self.final_seen_to_s = max(self.final_seen_to_s, seg.audio_end_s)
            self.progress.set()

    async def finish(self) -> None:
        """The client's audio ended: wait for the last words, then `transcription.done`."""
        deadline = time.monotonic() + DONE_WAIT_S
        # Speech ends a little before the audio does; a final past that point (or
        # the deadline) means every word of this session has been sent.
        target = self.last_audio_end_s - 1.5
        while self.final_seen_to_s < target and time.monotonic() < deadline:
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                await wait_for(self.progress.wait(), deadline - time.monotonic())
        await asyncio.sleep(0.3)  # a closing final published with it
        await self.stop_listening()
        await self.send(server_event(
            "transcription.done", text=self.text.sent,
            usage={"audio_seconds": round(self.audio_samples / SAMPLE_RATE, 3)},
        ))
        self.started = False
        self.text = TranscriptText()
        self.audio_samples = 0

    async def stop_listening(self) -> None:
        if self.listener is not None:
            self.listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.listener
            self.listener = None
