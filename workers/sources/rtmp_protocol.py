"""The server side of RTMP, as far as an ingest needs it: handshake, chunk stream, AMF0.

Enough to take a publish from OBS, hardware encoders and ffmpeg (Adobe's RTMP
1.0 specification, 2012): the plain handshake (no digest: publishing clients
do not check it), the chunk stream in both directions, protocol control
messages, and AMF0 commands (connect, releaseStream, FCPublish, createStream,
publish, deleteStream). Pure parsing and building, no sockets: `ChunkReader`
reads from any `asyncio.StreamReader`, the `build_*` helpers return bytes.

Bounds (an RTMP port is open to the network): a message this reader keeps is at
most `MAX_MESSAGE_BYTES` (commands, metadata, audio frames are a few kB; video,
which can be larger, is never kept: its bytes are read and dropped).
"""

from __future__ import annotations

import asyncio
import os
import struct
from dataclasses import dataclass, field
from typing import Any

HANDSHAKE_SIZE = 1536
RTMP_VERSION = 3
DEFAULT_CHUNK_SIZE = 128
MAX_MESSAGE_BYTES = 1 << 20

# Message types (RTMP 1.0 §5.4, §7.1).
SET_CHUNK_SIZE = 1
ABORT = 2
ACK = 3
USER_CONTROL = 4
WINDOW_ACK_SIZE = 5
SET_PEER_BANDWIDTH = 6
AUDIO = 8
VIDEO = 9
DATA_AMF3 = 15
COMMAND_AMF3 = 17
DATA_AMF0 = 18
COMMAND_AMF0 = 20
AGGREGATE = 22

# Message types whose payload is dropped unread.
SKIPPED = frozenset({VIDEO, AGGREGATE})


class RtmpProtocolError(Exception):
    """The peer broke the protocol (or a bound); the connection is closed."""


# ---- AMF0 ----------------------------------------------------------------------------


class _Undefined:
    def __repr__(self) -> str:
        return "undefined"


UNDEFINED = _Undefined()
_END = object()


def amf0_encode(*values: Any) -> bytes:
    out = bytearray()
    for v in values:
        _enc(out, v)
    return bytes(out)


def _enc_str(out: bytearray, s: str) -> None:
    raw = s.encode()
    out += struct.pack(">H", len(raw)) + raw


def _enc(out: bytearray, v: Any) -> None:
    if v is None:
        out.append(0x05)
    elif v is UNDEFINED:
        out.append(0x06)
    elif isinstance(v, bool):
        out += bytes((0x01, int(v)))
    elif isinstance(v, int | float):
        out.append(0x00)
        out += struct.pack(">d", float(v))
    elif isinstance(v, str):
        raw = v.encode()
        if len(raw) > 0xFFFF:
            out.append(0x0C)
            out += struct.pack(">I", len(raw)) + raw
        else:
            out.append(0x02)
            _enc_str(out, v)
    elif isinstance(v, dict):
        out.append(0x03)
        for key, value in v.items():
            _enc_str(out, str(key))
            _enc(out, value)
        out += b"\x00\x00\x09"
    else:
        raise TypeError(f"cannot encode {type(v).__name__} as AMF0")


def amf0_decode(data: bytes) -> list[Any]:
    """Every value in `data`; raises RtmpProtocolError on malformed input."""
    values: list[Any] = []
    pos = 0
    try:
        while pos < len(data):
            value, pos = _dec(data, pos, 0)
            values.append(value)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise RtmpProtocolError(f"malformed AMF0 ({type(exc).__name__})") from None
    return values


def _dec_str(data: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">H", data, pos)
    end = pos + 2 + n
    if end > len(data):
        raise IndexError
    return data[pos + 2 : end].decode(), end


def _dec_pairs(data: bytes, pos: int, depth: int) -> tuple[dict[str, Any], int]:
    obj: dict[str, Any] = {}
    while True:
        key, pos = _dec_str(data, pos)
        if not key and data[pos] == 0x09:
            return obj, pos + 1
        value, pos = _dec(data, pos, depth + 1)
        obj[key] = value


def _dec(data: bytes, pos: int, depth: int) -> tuple[Any, int]:
    if depth > 32:
        raise RtmpProtocolError("AMF0 nested too deep")
    marker = data[pos]
    pos += 1
    if marker == 0x00:
        return struct.unpack_from(">d", data, pos)[0], pos + 8
    if marker == 0x01:
        return data[pos] != 0, pos + 1
    if marker == 0x02:
        return _dec_str(data, pos)
    if marker == 0x03:
        return _dec_pairs(data, pos, depth)
    if marker in (0x05, 0x06):
        return (None if marker == 0x05 else UNDEFINED), pos
    if marker == 0x08:  # ECMA array: a count (not trusted), then pairs as an object
        return _dec_pairs(data, pos + 4, depth)
    if marker == 0x0A:
        (n,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if n > len(data):
            raise RtmpProtocolError("AMF0 array longer than its message")
        items = []
        for _ in range(n):
            item, pos = _dec(data, pos, depth + 1)
            items.append(item)
        return items, pos
    if marker == 0x0B:  # date: ms since the epoch, then a time zone nobody uses
        return struct.unpack_from(">d", data, pos)[0], pos + 10
    if marker == 0x0C:
        (n,) = struct.unpack_from(">I", data, pos)
        end = pos + 4 + n
        if end > len(data):
            raise IndexError
        return data[pos + 4 : end].decode(), end
    raise RtmpProtocolError(f"unsupported AMF0 marker 0x{marker:02x}")


# ---- handshake -----------------------------------------------------------------------


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """C0+C1 → S0+S1+S2 → C2. S2 echoes C1 (what every publishing client accepts)."""
    c0c1 = await reader.readexactly(1 + HANDSHAKE_SIZE)
    if c0c1[0] != RTMP_VERSION:
        raise RtmpProtocolError(f"RTMP version {c0c1[0]} (RTMPE and other variants are "
                                "not supported)")
    s1 = bytes(8) + os.urandom(HANDSHAKE_SIZE - 8)
    writer.write(bytes((RTMP_VERSION,)) + s1 + c0c1[1:])
    await writer.drain()
    await reader.readexactly(HANDSHAKE_SIZE)


# ---- chunk stream --------------------------------------------------------------------


@dataclass(slots=True)
class Message:
    type_id: int
    stream_id: int
    timestamp: int
    payload: bytes


@dataclass(slots=True)
class _ChunkState:
    timestamp: int = 0
    delta: int = 0
    length: int = 0
    type_id: int = 0
    stream_id: int = 0
    extended: bool = False
    received: int = 0
    parts: list[bytes] = field(default_factory=list)


class ChunkReader:
    """Reassembles RTMP messages from the peer's chunk stream; applies its Set Chunk Size."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._r = reader
        self.chunk_size = DEFAULT_CHUNK_SIZE
        self.bytes_read = 0
        self._states: dict[int, _ChunkState] = {}

    async def _read(self, n: int) -> bytes:
        data = await self._r.readexactly(n)
        self.bytes_read += n
        return data

    async def read_message(self) -> Message:
        while True:
            msg = await self._read_chunk()
            if msg is None:
                continue
            if msg.type_id == SET_CHUNK_SIZE:
                if len(msg.payload) < 4:
                    raise RtmpProtocolError("short Set Chunk Size")
                size = struct.unpack(">I", msg.payload[:4])[0] & 0x7FFFFFFF
                if size < 1:
                    raise RtmpProtocolError("chunk size 0")
                self.chunk_size = size
                continue
            if msg.type_id == ABORT and len(msg.payload) >= 4:
                csid = struct.unpack(">I", msg.payload[:4])[0]
                st = self._states.get(csid)
                if st is not None:
                    st.received, st.parts = 0, []
                continue
            return msg

    async def _read_chunk(self) -> Message | None:
        b0 = (await self._read(1))[0]
        fmt, csid = b0 >> 6, b0 & 0x3F
        if csid == 0:
            csid = 64 + (await self._read(1))[0]
        elif csid == 1:
            lo, hi = await self._read(2)
            csid = 64 + lo + 256 * hi
        st = self._states.get(csid)
        if st is None:
            if fmt != 0:
                raise RtmpProtocolError(f"chunk stream {csid} starts without a full header")
            st = self._states[csid] = _ChunkState()
        if fmt == 0 and st.received:
            st.received, st.parts = 0, []  # a full header starts a new message
        starting = st.received == 0
        if fmt <= 2:
            header = await self._read((11, 7, 3)[fmt])
            ts = int.from_bytes(header[0:3], "big")
            if fmt <= 1:
                st.length = int.from_bytes(header[3:6], "big")
                st.type_id = header[6]
            if fmt == 0:
                st.stream_id = int.from_bytes(header[7:11], "little")
            st.extended = ts == 0xFFFFFF
            if st.extended:
                ts = int.from_bytes(await self._read(4), "big")
            if fmt == 0:
                st.timestamp, st.delta = ts, 0
            else:
                st.delta = ts
                if starting:
                    st.timestamp += ts
        else:
            if st.extended:
                await self._read(4)  # repeated on every continuation chunk
            if starting:
                st.timestamp += st.delta
        if starting and st.type_id not in SKIPPED and st.length > MAX_MESSAGE_BYTES:
            raise RtmpProtocolError(f"message of {st.length} bytes (type {st.type_id}) is "
                                    f"over the {MAX_MESSAGE_BYTES}-byte bound")
        n = min(self.chunk_size, st.length - st.received)
        if st.type_id in SKIPPED:
            while n:  # read and drop, in bounded pieces
                part = min(n, 65536)
                await self._read(part)
                n -= part
                st.received += part
        else:
            st.parts.append(await self._read(n))
            st.received += n
        if st.received < st.length:
            return None
        payload = b"".join(st.parts)
        st.received, st.parts = 0, []
        return Message(st.type_id, st.stream_id, st.timestamp, payload)


def build_message(csid: int, type_id: int, stream_id: int, payload: bytes,
                  chunk_size: int, timestamp: int = 0) -> bytes:
    """One message as chunks: a type-0 header, then type-3 continuations."""
    if csid >= 64:
        raise ValueError("only chunk stream ids 2..63 are sent")
    ts = min(timestamp, 0xFFFFFF)
    out = bytearray((csid,))
    out += ts.to_bytes(3, "big") + len(payload).to_bytes(3, "big") + bytes((type_id,))
    out += stream_id.to_bytes(4, "little")
    for i in range(0, max(len(payload), 1), chunk_size):
        if i:
            out.append(0xC0 | csid)
        out += payload[i : i + chunk_size]
    return bytes(out)


def control(type_id: int, value: int, extra: bytes = b"") -> bytes:
    """A protocol control message (chunk stream 2, message stream 0), chunk size irrelevant."""
    return build_message(2, type_id, 0, struct.pack(">I", value) + extra, DEFAULT_CHUNK_SIZE)


def command(csid: int, stream_id: int, chunk_size: int, *values: Any) -> bytes:
    return build_message(csid, COMMAND_AMF0, stream_id, amf0_encode(*values), chunk_size)
