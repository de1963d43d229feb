"""The `realtime-ws` engine: a client of any vLLM-compatible `/v1/realtime` server.

One WebSocket per session (stock `vllm serve`, a build with re-anchoring, or
Babelcast's own gateway). Audio goes out as `input_audio_buffer.append`; text
comes back as `transcription.delta` pieces, which become committed words
stamped with the audio position at their arrival minus the model's delay
(the protocol carries no timestamps). A `transcription.done` while we are still
streaming means the server ended the session (its length cap): the session
ends and the session manager opens the next one. Connection failures raise a
retryable `EngineError`, so the manager reconnects with backoff; server
`error` events are counted and surfaced, and only the fatal ones
(`model_not_found`, `model_not_validated`) end the session.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import websockets

from workers.aio import wait_for
from workers.engines.base import (
    END,
    DelayedTextStamps,
    EngineCapabilities,
    EngineError,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
)
from workers.events import AudioChunk, TranscriptDelta

log = logging.getLogger(__name__)

FATAL_CODES = {"model_not_found", "model_not_validated"}


@dataclass(frozen=True, slots=True)
class RealtimeWsOptions:
    url: str
    model: str
    delay_s: float = 0.48
    """How far the server's text lags its audio (Voxtral's default delay)."""
    max_session_s: float | None = None
    """The server's session cap in audio seconds, if known (stock vLLM: max_model_len × 80 ms)."""
    reanchors_natively: bool = False
    multilingual: bool = True
    connect_timeout_s: float = 10.0
    done_timeout_s: float = 20.0
    token: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer` (another Babelcast's publish token)."""
    text_lag_s: float = 0.0
    """Speech the server may hear before it sends text. vLLM's Voxtral sends words as it
    decodes (0). Another Babelcast's `/v1/realtime` sends a caption's text once it is final,
    at the speaker's pause (up to ~20 s of speech with the embedded engine): without this
    allowance the rut watchdog takes a long sentence for a mute engine and replays audio
    into that event's stream."""


class RealtimeWsEngine(SpeechEngine):
    def __init__(self, options: RealtimeWsOptions) -> None:
        self.options = options
        self.server_errors: dict[str, int] = {}

    @property
    def capabilities(self) -> EngineCapabilities:
        o = self.options
        return EngineCapabilities(max_session_s=o.max_session_s,
                                  reanchors_natively=o.reanchors_natively,
                                  multilingual=o.multilingual, text_lag_s=o.text_lag_s)

    async def start(self) -> None:
        """Nothing to load: each session connects on its own."""

    async def aclose(self) -> None:
        """Sessions own their sockets."""

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = RealtimeWsSession(self, options)
        session.start()
        return session

    def stats(self) -> dict[str, float]:
        return {f"server_error_{k}": float(v) for k, v in self.server_errors.items()}


class RealtimeWsSession(RecognizeSession):
    def __init__(self, engine: RealtimeWsEngine, options: SessionOptions) -> None:
        super().__init__(options)
        self.engine = engine
        self.opts = engine.options
        self._stamps = DelayedTextStamps(self.opts.delay_s, first_piece_s=0.3)
        self._final_sent = False

    async def _reader(self, ws: Any) -> None:
        async for raw in ws:
            try:
                event = json.loads(raw)
            except (TypeError, ValueError):
                continue  # a message we cannot read is skipped, not fatal
            kind = event.get("type")
            if kind == "transcription.delta":
                delta = event.get("delta") or ""
                if delta:
                    await self._emit(TranscriptDelta(committed=(self._stamps.word(delta),)))
            elif kind == "transcription.done":
                if not self._final_sent:
                    log.info("stream %s: server ended the session", self.options.stream_id)
                await self._emit(TranscriptDelta(end_of_utterance=True))
                return
            elif kind == "error":
                code = str(event.get("code", "unknown"))
                errors = self.engine.server_errors
                errors[code] = errors.get(code, 0) + 1
                log.warning("stream %s: realtime server error %s", self.options.stream_id, code)
                if code in FATAL_CODES:
                    raise EngineError(f"realtime server refused the session: {code}",
                                      retryable=False)

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        try:
            headers = {"Authorization": f"Bearer {self.opts.token}"} if self.opts.token else {}
            ws = await websockets.connect(self.opts.url, open_timeout=self.opts.connect_timeout_s,
                                          max_size=2**22, additional_headers=headers)
        except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
            raise EngineError(f"cannot reach realtime server: {type(exc).__name__}") from exc
        reader: asyncio.Task[None] | None = None
        try:
            await ws.send(json.dumps({"type": "session.update", "model": self.opts.model}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": False}))
            reader = asyncio.create_task(self._reader(ws))
            while True:
                get = asyncio.ensure_future(inputs.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    get.cancel()
                    reader.result()  # raises what the reader raised
                    return  # the server ended the session
                item = get.result()
                if item is END:
                    self._final_sent = True
                    await ws.send(json.dumps({"type": "input_audio_buffer.commit",
                                              "final": True}))
                    await wait_for(reader, self.opts.done_timeout_s)
                    return
                if isinstance(item, AudioChunk):
                    self._stamps.fed(item)
                    await ws.send(json.dumps({
                        "type": "input_audio_buffer.append",
                        "audio": base64.b64encode(item.pcm).decode("ascii"),
                    }))
        except websockets.ConnectionClosed as exc:
            raise EngineError(f"realtime server closed the connection ({exc.code})") from exc
        finally:
            if reader is not None and not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            with contextlib.suppress(Exception):
                await ws.close()
