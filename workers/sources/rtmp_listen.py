"""An RTMP(S) listener: encoders (OBS, hardware encoders, ffmpeg) publish to Babelcast.

FFmpeg can listen for RTMP (`-listen 1`) but takes any stream name (it only
warns on a wrong one) and one connection per open, so Babelcast speaks the
server side of RTMP itself (`rtmp_protocol`) on an asyncio server:

- One listener per stream and port, for the stream's whole life: an encoder that
  drops and reconnects finds it listening. The source says `idle` while nobody
  publishes and `refused` for every publisher turned away.
- The stream key comes from the stream's `key_env` and is compared with
  `hmac.compare_digest` (constant time). A wrong key gets RTMP's
  `NetStream.Publish.BadName` and the connection is closed; nothing it sent is
  used. Neither key ever appears in a message or log line.
- A publisher with the right key takes over from an earlier one (OBS reconnects
  while the old TCP connection may linger half-open); the audio of both is not
  glued together (a `gap`).
- Audio is decoded frame by frame as it arrives (AAC or MP3 in FLV audio tags,
  PyAV's decoders): no probing, so no probe delay. Video is read and dropped.
- rtmps: the same over TLS (`ssl`), with the certificate and key files the
  stream names. Clients that verify certificates (OBS) need one they trust.

Bounds: a handshake must finish in `handshake_timeout_s`; a publisher silent for
`idle_timeout_s` is dropped; at most `MAX_CONNECTIONS` connections at once; the
audio queue to the consumer holds `QUEUE_CHUNKS` chunks and then stops reading
the socket (TCP backpressure to the encoder, nothing dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import ssl
import struct
from collections.abc import AsyncIterator
from typing import Any

import av
from av.audio.frame import AudioFrame

from workers.aio import wait_for
from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError, SourceEvent, SourceItem
from workers.sources.listen import RtmpListen, parse_rtmp_listen
from workers.sources.pyav import CHUNK_BYTES, LIVE_LEAD_S, Pacer
from workers.sources.rtmp_protocol import (
    ACK,
    AUDIO,
    COMMAND_AMF0,
    COMMAND_AMF3,
    SET_CHUNK_SIZE,
    SET_PEER_BANDWIDTH,
    USER_CONTROL,
    WINDOW_ACK_SIZE,
    ChunkReader,
    RtmpProtocolError,
    amf0_decode,
    build_message,
    command,
    control,
    server_handshake,
)

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
QUEUE_CHUNKS = 100  # 10 s of audio
OUT_CHUNK_SIZE = 4096
WINDOW = 2_500_000
_FLV_AUDIO = {0: "linear PCM", 1: "ADPCM", 3: "PCM LE", 4: "Nellymoser 16k",
              5: "Nellymoser 8k", 6: "Nellymoser", 7: "G.711 A-law", 8: "G.711 mu-law",
              9: "enhanced RTMP (Opus, FLAC, AC-3...)", 11: "Speex"}


class UnsupportedAudio(Exception):
    """The publisher's audio codec is one this listener does not decode."""


class FlvAudioDecoder:
    """FLV audio tag bodies (RTMP audio messages) → 16 kHz mono PCM16: AAC and MP3."""

    def __init__(self) -> None:
        self._ctx: Any = None
        self._codec = ""
        self._resampler: av.AudioResampler | None = None
        self._layout: tuple[str, str, int] | None = None

    def _open(self, codec: str, extradata: bytes | None) -> None:
        ctx = av.CodecContext.create(codec, "r")
        if extradata:
            ctx.extradata = extradata
        self._ctx, self._codec = ctx, codec

    def decode(self, body: bytes) -> bytes:
        if not body:
            return b""
        fmt = body[0] >> 4
        if fmt == 10:  # AAC: a sequence header (AudioSpecificConfig), then raw frames
            if len(body) < 2:
                return b""
            if body[1] == 0:
                self._open("aac", body[2:])
                return b""
            if self._ctx is None or self._codec != "aac":
                raise UnsupportedAudio("AAC frames came before the AAC sequence header")
            packets = [av.Packet(body[2:])]
        elif fmt in (2, 14):  # MP3 (14: MP3 at 8 kHz)
            if self._ctx is None or self._codec != "mp3":
                self._open("mp3", None)
            packets = list(self._ctx.parse(body[1:]))
        else:
            name = _FLV_AUDIO.get(fmt, f"FLV sound format {fmt}")
            raise UnsupportedAudio(f"the encoder sends {name} audio; set its audio codec "
                                   "to AAC (or MP3)")
        out = bytearray()
        for packet in packets:
            for frame in self._ctx.decode(packet):
                out += self._resample(frame)
        return bytes(out)

    def _resample(self, frame: AudioFrame) -> bytes:
        key = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._resampler is None or key != self._layout:
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            self._layout = key
        return b"".join(f.to_ndarray().tobytes() for f in self._resampler.resample(frame))


def _command_values(msg_type: int, payload: bytes) -> list[Any]:
    # An AMF3 command message is AMF0 after one format byte (RTMP 1.0 §7.1.1).
    return amf0_decode(payload[1:] if msg_type == COMMAND_AMF3 else payload)


def _status(level: str, code: str, description: str) -> dict[str, Any]:
    return {"level": level, "code": code, "description": description}


class _Connection:
    """One TCP (or TLS) connection: handshake, commands, and audio once it publishes."""

    def __init__(self, owner: RtmpListenSource, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.owner = owner
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self.publishing = False
        self.stream_id = 0
        self._chunks = ChunkReader(reader)
        self._acked = 0
        self._peer_window = WINDOW
        self._decoder = FlvAudioDecoder()
        self._pending = bytearray()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def run(self) -> None:
        await wait_for(server_handshake(self.reader, self.writer),
                       self.owner.handshake_timeout_s)
        connected = False
        while True:
            msg = await wait_for(self._chunks.read_message(), self.owner.idle_timeout_s)
            await self._ack()
            if msg.type_id == AUDIO:
                if self.publishing and self.owner.is_publisher(self):
                    await self._audio(msg.payload)
            elif msg.type_id in (COMMAND_AMF0, COMMAND_AMF3):
                values = _command_values(msg.type_id, msg.payload)
                if len(values) < 2 or not isinstance(values[0], str):
                    raise RtmpProtocolError("a command without name and transaction id")
                name, txn, args = values[0], values[1], values[2:]
                if name == "connect":
                    connected = await self._connect(txn, args)
                    if not connected:
                        return
                elif not connected:
                    raise RtmpProtocolError(f"{name!r} before connect")
                elif name == "createStream":
                    self.stream_id = 1
                    await self.send(command(3, 0, OUT_CHUNK_SIZE, "_result", txn, None, 1))
                elif name == "publish":
                    if not await self._publish(args):
                        return
                elif name in ("FCUnpublish", "deleteStream", "closeStream"):
                    if self.publishing:
                        return  # the encoder stopped on purpose
                elif name in ("releaseStream", "FCPublish"):
                    await self.send(command(3, 0, OUT_CHUNK_SIZE, "_result", txn, None))
            elif msg.type_id == WINDOW_ACK_SIZE and len(msg.payload) >= 4:
                self._peer_window = max(1, struct.unpack(">I", msg.payload[:4])[0])

    async def _ack(self) -> None:
        """Acknowledge what the peer sent, once per its window (RTMP 1.0 §5.4.3)."""
        read = self._chunks.bytes_read
        if read - self._acked >= self._peer_window:
            self._acked = read
            await self.send(control(ACK, read & 0xFFFFFFFF))

    async def _connect(self, txn: Any, args: list[Any]) -> bool:
        props = args[0] if args and isinstance(args[0], dict) else {}
        app = str(props.get("app", "")).split("?", 1)[0].strip("/")
        if app != self.owner.listen.app:
            await self.send(command(3, 0, OUT_CHUNK_SIZE, "_error", txn, None, _status(
                "error", "NetConnection.Connect.Rejected", "unknown application")))
            self.owner.refuse("rtmp-bad-app", f"a publisher from {self.peer} asked for "
                              f"application {app[:64]!r}, not {self.owner.listen.app!r}")
            return False
        await self.send(control(WINDOW_ACK_SIZE, WINDOW)
                        + control(SET_PEER_BANDWIDTH, WINDOW, b"\x02")
                        + control(SET_CHUNK_SIZE, OUT_CHUNK_SIZE))
        await self.send(command(3, 0, OUT_CHUNK_SIZE, "_result", txn,
                                {"fmsVer": "FMS/3,0,1,123", "capabilities": 31},
                                {**_status("status", "NetConnection.Connect.Success",
                                           "Connection succeeded."), "objectEncoding": 0}))
        return True

    async def _publish(self, args: list[Any]) -> bool:
        offered = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        offered = offered.split("?", 1)[0]  # some encoders append ?options to the key
        if not self.owner.key_matches(offered):
            await self.send(command(5, self.stream_id, OUT_CHUNK_SIZE, "onStatus", 0, None,
                                    _status("error", "NetStream.Publish.BadName",
                                            "wrong stream key")))
            self.owner.refuse("rtmp-bad-key", f"a publisher from {self.peer} to "
                              f"{self.owner.listen.shown} was refused: wrong stream key")
            return False
        # Stream Begin (user control event 0) for the stream, then the publish status.
        await self.send(build_message(2, USER_CONTROL, 0, struct.pack(">HI", 0, self.stream_id),
                                      OUT_CHUNK_SIZE))
        await self.send(command(5, self.stream_id, OUT_CHUNK_SIZE, "onStatus", 0, None,
                                _status("status", "NetStream.Publish.Start", "publishing")))
        self.publishing = True
        await self.owner.take_over(self)
        return True

    async def _audio(self, body: bytes) -> None:
        self._pending += self._decoder.decode(body)
        end = len(self._pending) // CHUNK_BYTES * CHUNK_BYTES
        for i in range(0, end, CHUNK_BYTES):
            await self.owner.put(bytes(self._pending[i : i + CHUNK_BYTES]))
        del self._pending[:end]

    async def flush(self) -> None:
        tail = bytes(self._pending[: len(self._pending) // 2 * 2])
        self._pending.clear()
        if tail:
            await self.owner.put(tail)


class RtmpListenSource(AudioSource):
    """`rtmp://0.0.0.0:1935/live` (or `?listen=1`, or rtmps:// with `tls_cert`/`tls_key`):
    one stream's listener. `key` is the stream key every publisher must send."""

    gap_reasons = ("rtmp-takeover", "rtmp-disconnect", "rtmp-waiting")

    def __init__(self, url: str, *, key: str, tls_cert: str = "", tls_key: str = "",
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 10.0) -> None:
        self.url = url
        self.listen: RtmpListen = parse_rtmp_listen(url)
        if not key:
            raise ValueError("an RTMP listener needs a stream key (the stream's key_env)")
        if self.listen.tls and not (tls_cert and tls_key):
            raise ValueError("an rtmps listener needs tls_cert and tls_key files")
        self._key = key.encode()
        self._tls = (tls_cert, tls_key)
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._items: asyncio.Queue[SourceItem] = asyncio.Queue(QUEUE_CHUNKS)
        self._publisher: _Connection | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    def __repr__(self) -> str:
        return f"RtmpListenSource({self.listen.shown!r})"

    # ---- called by connections ----------------------------------------------------
    def key_matches(self, offered: str) -> bool:
        return hmac.compare_digest(offered.encode(), self._key)

    def is_publisher(self, conn: _Connection) -> bool:
        return self._publisher is conn

    async def put(self, item: SourceItem) -> None:
        await self._items.put(item)

    def refuse(self, reason: str, detail: str) -> None:
        # Never blocks a connection: a full queue loses the count, not audio.
        with contextlib.suppress(asyncio.QueueFull):
            self._items.put_nowait(SourceEvent("refused", reason, detail))

    async def take_over(self, conn: _Connection) -> None:
        old, self._publisher = self._publisher, conn
        if old is not None:
            old.close()
            await self.put(SourceEvent("gap", "rtmp-takeover",
                                       f"a new publisher from {conn.peer} took over"))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = _Connection(self, reader, writer)
        try:
            if len(self._handlers) > MAX_CONNECTIONS:
                return
            await conn.run()
        except UnsupportedAudio as exc:
            self.refuse("rtmp-codec", f"publisher from {conn.peer}: {exc}")
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError,
                RtmpProtocolError, av.FFmpegError, OSError) as exc:
            log.debug("rtmp listener %s: connection from %s ended: %s", self.listen.shown,
                      conn.peer, type(exc).__name__)
        finally:
            conn.close()
            self._handlers.discard(task)
            if self._publisher is conn:
                self._publisher = None
                with contextlib.suppress(Exception):
                    await conn.flush()
                    await self.put(SourceEvent(
                        "idle", "rtmp-disconnect",
                        f"the encoder left; waiting for one to publish to {self.listen.shown}"))

    # ---- the source ---------------------------------------------------------------
    def _ssl(self) -> ssl.SSLContext | None:
        if not self.listen.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(*self._tls)
        except (OSError, ssl.SSLError) as exc:
            raise SourceError(f"RTMP listener {self.listen.shown}: cannot load the TLS "
                              f"certificate or key ({type(exc).__name__}: "
                              f"{getattr(exc, 'strerror', None) or exc}); check tls_cert "
                              "and tls_key", retryable=False) from None
        return ctx

    async def chunks(self) -> AsyncIterator[SourceItem]:
        ctx = self._ssl()
        try:
            self._server = await asyncio.start_server(
                self._serve, self.listen.host, self.listen.port, ssl=ctx,
                reuse_address=True, ssl_handshake_timeout=self.handshake_timeout_s if ctx
                else None)
        except OSError as exc:
            raise SourceError(
                f"RTMP listener {self.listen.shown}: cannot listen on port "
                f"{self.listen.port} ({exc.strerror or type(exc).__name__}); check that no "
                "other program or stream uses it and that the address is this host's") from None
        yield SourceEvent("idle", "rtmp-waiting",
                          f"waiting for an encoder to publish to {self.listen.shown}")
        pacer = Pacer(lead_s=LIVE_LEAD_S)
        try:
            while True:
                item = await self._items.get()
                if isinstance(item, bytes):
                    await pacer.wait(len(item) // 2)
                elif item.kind != "refused":
                    pacer = Pacer(lead_s=LIVE_LEAD_S)  # a new publisher, a new schedule
                yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        self._publisher = None
        while not self._items.empty():  # a later chunks() starts clean
            self._items.get_nowait()
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await wait_for(server.wait_closed(), 5)
