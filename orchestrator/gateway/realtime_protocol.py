"""Wire events of the vLLM-compatible `/v1/realtime` protocol (see VLLM.md).

Client → server: `session.update {model}`, `input_audio_buffer.append {audio}`
(base64 PCM16 LE 16 kHz mono), `input_audio_buffer.commit {final}`.
Server → client: `session.created {id, created}`, `transcription.delta {delta}`,
`transcription.done {text, usage}`, `error {error, code}`.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from orchestrator.gateway import json_bounds

ERROR_CODES = (
    "invalid_json", "invalid_event", "model_not_found", "invalid_audio",
    "model_not_validated", "unknown_event", "processing_error",
)


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionUpdate(_Event):
    type: Literal["session.update"]
    model: str = Field(description="model (engine profile) to transcribe with")


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = Field(description="base64 PCM16 LE, 16 kHz, mono")


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]
    final: bool = Field(default=False, description="true: the audio has ended")


ClientEvent = Annotated[SessionUpdate | AudioAppend | AudioCommit, Field(discriminator="type")]
_client = TypeAdapter(ClientEvent)
KNOWN_TYPES = {"session.update", "input_audio_buffer.append", "input_audio_buffer.commit"}


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_client_event(raw: str) -> SessionUpdate | AudioAppend | AudioCommit:
    try:
        data = json_bounds.loads(raw)
    except json_bounds.JsonTooDeep as exc:
        raise ProtocolError("invalid_json", f"{exc}; events are flat objects") from None
    except (ValueError, TypeError):
        raise ProtocolError("invalid_json", "message is not valid JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("invalid_event", "an event is a JSON object with a string `type`")
    if data["type"] not in KNOWN_TYPES:
        raise ProtocolError("unknown_event", f"unknown event type {data['type'][:64]!r}")
    try:
        return _client.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "event"
        raise ProtocolError("invalid_event", f"{where}: {first['msg']}") from None


def decode_audio(event: AudioAppend) -> bytes:
    try:
        pcm = base64.b64decode(event.audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_audio", "audio is not valid base64") from None
    if len(pcm) % 2:
        raise ProtocolError("invalid_audio", "PCM16 audio needs an even number of bytes")
    return pcm


def server_event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields}, ensure_ascii=False)


def error_event(code: str, message: str) -> str:
    return server_event("error", error=message, code=code)
