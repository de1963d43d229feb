"""Push listeners on real sockets with real ffmpeg encoders: RTMP(S) and SRT.

The RTMP protocol parts are checked on their own first (no sockets); then
ffmpeg publishes to Babelcast's listener as OBS would, with the right key, a
wrong key, a wrong application, over TLS with a self-signed certificate, an
unsupported codec, and a second publisher taking over. The SRT listener takes
callers with the right and a wrong passphrase and keeps listening after one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceEvent, SourceItem
from workers.sources.rtmp_listen import RtmpListenSource
from workers.sources.rtmp_protocol import (
    AUDIO,
    MAX_MESSAGE_BYTES,
    SET_CHUNK_SIZE,
    UNDEFINED,
    VIDEO,
    ChunkReader,
    RtmpProtocolError,
    amf0_decode,
    amf0_encode,
    build_message,
)
from workers.sources.srt import SrtSource

pytestmark = pytest.mark.integration

needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs Debian ffmpeg")
KEY = "live_4f9a-obs-key"


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


# --- the protocol on its own --------------------------------------------------------------


def test_amf0_round_trips_what_encoders_send() -> None:
    connect = ["connect", 1.0, {"app": "live", "tcUrl": "rtmp://h:1935/live", "fpad": False,
                                "audioCodecs": 3191.0, "nested": {"x": None}}, None, UNDEFINED]
    assert amf0_decode(amf0_encode(*connect)) == connect
    long = "k" * 70_000  # a long string (marker 0x0C)
    assert amf0_decode(amf0_encode(long)) == [long]
    ecma = b"\x08" + struct.pack(">I", 1) + b"\x00\x01a" + amf0_encode(2.0) + b"\x00\x00\x09"
    strict = b"\x0a" + struct.pack(">I", 2) + amf0_encode(1.0, "b")
    assert amf0_decode(ecma + strict) == [{"a": 2.0}, [1.0, "b"]]


@pytest.mark.parametrize("bad", [b"\x02\x00\x09abc", b"\x03\x00\x01a", b"\x0d",
                                 b"\x0a\xff\xff\xff\xff"])
def test_malformed_amf0_is_a_protocol_error(bad: bytes) -> None:
    with pytest.raises(RtmpProtocolError):
        amf0_decode(bad)


async def test_chunk_reader_reassembles_interleaved_messages_across_chunk_sizes() -> None:
    audio = bytes(range(256)) * 2  # 512 bytes: four 128-byte chunks
    command = amf0_encode("publish", 5.0, None, KEY, "live")
    audio_msg = build_message(4, AUDIO, 1, audio, 128, timestamp=40)
    first_chunk = 12 + 128  # a type-0 header, then 128 bytes; type-3 chunks follow
    data = (audio_msg[:first_chunk]
            + build_message(3, 20, 1, command, 128)  # another chunk stream in between
            + audio_msg[first_chunk:]
            # The peer raises its chunk size; a 3000-byte message then takes one chunk.
            + build_message(2, SET_CHUNK_SIZE, 0, struct.pack(">I", 4096), 128)
            + build_message(4, AUDIO, 1, bytes(3000), 4096, timestamp=63))
    reader = ChunkReader(reader_of(data))
    second = await reader.read_message()  # the command completes first
    first = await reader.read_message()
    third = await reader.read_message()
    assert (first.type_id, first.timestamp, first.payload) == (AUDIO, 40, audio)
    assert amf0_decode(second.payload)[3] == KEY
    assert (third.payload, reader.chunk_size) == (bytes(3000), 4096)
    assert reader.bytes_read == len(data)


async def test_chunk_reader_reads_extended_timestamps_and_type_3_continuations() -> None:
    payload = bytes(200)
    header = bytes((0x04,)) + b"\xff\xff\xff" + len(payload).to_bytes(3, "big") + bytes(
        (AUDIO,)) + (1).to_bytes(4, "little") + (0x01000000).to_bytes(4, "big")
    # The extended timestamp is repeated on the continuation chunk (fmt 3).
    data = header + payload[:128] + bytes((0xC4,)) + (0x01000000).to_bytes(4, "big") + payload[
        128:]
    msg = await ChunkReader(reader_of(data)).read_message()
    assert (msg.timestamp, msg.payload) == (0x01000000, payload)


async def test_video_of_any_size_is_dropped_and_oversized_audio_refused() -> None:
    big = MAX_MESSAGE_BYTES + 10
    data = (build_message(2, SET_CHUNK_SIZE, 0, struct.pack(">I", 65536), 128)
            + build_message(6, VIDEO, 1, bytes(big), 65536)
            + build_message(4, AUDIO, 1, bytes(big), 65536))
    reader = ChunkReader(reader_of(data))
    video = await reader.read_message()  # its bytes went by, unkept
    assert (video.type_id, video.payload) == (VIDEO, b"")
    with pytest.raises(RtmpProtocolError, match="bound"):
        await reader.read_message()


# --- ffmpeg publishing to the listener ------------------------------------------------------


class Listening:
    """A source being read in the background: what it yielded, in order."""

    def __init__(self, source: AudioSource) -> None:
        self.source = source
        self.items: list[SourceItem] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for item in self.source.chunks():
            self.items.append(item)

    @property
    def audio(self) -> bytes:
        return b"".join(i for i in self.items if isinstance(i, bytes))

    def events(self, kind: str | None = None) -> list[SourceEvent]:
        return [i for i in self.items if isinstance(i, SourceEvent)
                and (kind is None or i.kind == kind)]

    async def wait_for(self, what: str, check: object, timeout_s: float = 10.0) -> None:
        async def poll() -> None:
            while not check():  # type: ignore[operator]
                if self.task.done():
                    self.task.result()
                    raise AssertionError(f"the source ended before {what}")
                await asyncio.sleep(0.05)

        await asyncio.wait_for(poll(), timeout_s)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await asyncio.wait_for(self.source.aclose(), 10)


@contextlib.asynccontextmanager
async def listening(source: AudioSource) -> AsyncIterator[Listening]:
    run = Listening(source)
    try:
        await run.wait_for("it listens", lambda: run.events("idle"))
        yield run
    finally:
        await run.close()


async def encode(url: str, *, seconds: float = 2.0, freq: int = 440, codec: str = "aac",
                 fmt: str = "flv") -> tuple[int, str]:
    """ffmpeg sends a sine tone to `url` in real time; returns (exit code, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        "ffmpeg", "-nostdin", "-loglevel", "error", "-re", "-f", "lavfi",
        "-i", f"sine=frequency={freq}:sample_rate=44100:duration={seconds}",
        "-c:a", codec, "-f", fmt, url,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), seconds + 20)
    return proc.returncode or 0, err.decode(errors="replace")


def peak_hz(pcm: bytes) -> int:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    spectrum = np.abs(np.fft.rfft(samples))
    return round(float(np.fft.rfftfreq(samples.size, 1 / SAMPLE_RATE)[spectrum.argmax()]) / 10) * 10


def rtmp_source(port: int, scheme: str = "rtmp", **tls: str) -> RtmpListenSource:
    return RtmpListenSource(f"{scheme}://127.0.0.1:{port}/live?listen=1", key=KEY, **tls)


@needs_ffmpeg
async def test_ffmpeg_publishing_with_the_right_key_is_heard_then_the_listener_waits_again(
) -> None:
    port = free_port()
    async with listening(rtmp_source(port)) as run:
        code, err = await encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=2.0)
        assert code == 0, err
        await run.wait_for("the encoder to leave", lambda: len(run.events("idle")) == 2)
        # All of it, decoded and resampled to 16 kHz mono at its pitch.
        assert len(run.audio) / 2 / SAMPLE_RATE == pytest.approx(2.0, abs=0.15)
        assert peak_hz(run.audio) == 440
        assert [e.reason for e in run.events()] == ["rtmp-waiting", "rtmp-disconnect"]
        # ... and it still listens: the encoder comes back.
        code, err = await encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=1.0, freq=880)
        assert code == 0, err
        await run.wait_for("the second publish", lambda: len(run.events("idle")) == 3)
        assert len(run.audio) / 2 / SAMPLE_RATE == pytest.approx(3.0, abs=0.25)


@needs_ffmpeg
async def test_a_wrong_key_or_application_is_refused_counted_and_never_heard() -> None:
    port = free_port()
    async with listening(rtmp_source(port)) as run:
        code, err = await encode(f"rtmp://127.0.0.1:{port}/live/not-the-key", seconds=1.0)
        assert code != 0 and "wrong stream key" in err  # what the encoder's operator sees
        code, _ = await encode(f"rtmp://127.0.0.1:{port}/other/{KEY}", seconds=1.0)
        assert code != 0
        await run.wait_for("two refusals", lambda: len(run.events("refused")) == 2)
        assert [e.reason for e in run.events("refused")] == ["rtmp-bad-key", "rtmp-bad-app"]
        assert run.audio == b""
        for event in run.events():
            assert KEY not in event.detail and "not-the-key" not in event.detail
        assert KEY not in repr(run.source)


@needs_ffmpeg
async def test_rtmps_works_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = await asyncio.create_subprocess_exec(
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    assert await asyncio.wait_for(openssl.wait(), 60) == 0
    port = free_port()
    async with listening(rtmp_source(port, "rtmps", tls_cert=str(cert),
                                     tls_key=str(key))) as run:
        # ffmpeg does not verify certificates unless told to (tls_verify=1).
        code, err = await encode(f"rtmps://127.0.0.1:{port}/live/{KEY}", seconds=1.5)
        assert code == 0, err
        await run.wait_for("the encoder to leave", lambda: len(run.events("idle")) == 2)
        assert len(run.audio) / 2 / SAMPLE_RATE == pytest.approx(1.5, abs=0.15)
        # Plain RTMP to the TLS port is not heard.
        code, _ = await encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=0.5)
        assert code != 0


@needs_ffmpeg
async def test_an_unsupported_codec_is_refused_with_what_to_change() -> None:
    port = free_port()
    async with listening(rtmp_source(port)) as run:
        await encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=1.0, codec="pcm_s16le")
        await run.wait_for("the refusal", lambda: run.events("refused"))
        refused = run.events("refused")[0]
        assert refused.reason == "rtmp-codec" and "AAC" in refused.detail


@needs_ffmpeg
async def test_a_second_publisher_with_the_key_takes_over_after_a_gap() -> None:
    port = free_port()
    async with listening(rtmp_source(port)) as run:
        first = asyncio.create_task(encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=6,
                                           freq=440))
        await run.wait_for("the first publisher's audio", lambda: len(run.audio) > 32000)
        code, err = await encode(f"rtmp://127.0.0.1:{port}/live/{KEY}", seconds=1.0, freq=880)
        assert code == 0, err
        await first  # its connection was closed under it
        gaps = run.events("gap")
        assert [g.reason for g in gaps] == ["rtmp-takeover"]
        after = run.items[run.items.index(gaps[0]) + 1:]
        assert peak_hz(b"".join(i for i in after if isinstance(i, bytes))) == 880


@needs_ffmpeg
async def test_srt_listener_takes_its_caller_refuses_a_wrong_passphrase_and_listens_again(
) -> None:
    port = free_port(socket.SOCK_DGRAM)
    passphrase = "correct-horse-battery"
    source = SrtSource(f"srt://127.0.0.1:{port}?mode=listener", passphrase=passphrase)
    async with listening(source) as run:
        code, _ = await encode(f"srt://127.0.0.1:{port}?mode=caller&passphrase=wrong-horse-1",
                               seconds=1.0, fmt="mpegts")
        assert code != 0
        await run.wait_for("the refusal", lambda: run.events("refused"))
        assert run.events("refused")[0].reason == "srt-bad-passphrase"
        assert run.audio == b""
        # linger: the caller sends what it still holds before it hangs up (live mode's
        # default, 0, drops the last ~0.3 s at the encoder, before anything is sent).
        url = f"srt://127.0.0.1:{port}?mode=caller&passphrase={passphrase}&linger=2"

        def left(n: int) -> bool:
            return sum(e.reason == "srt-disconnect" for e in run.events()) >= n

        code, err = await encode(url, seconds=1.5, fmt="mpegts")
        assert code == 0, err
        await run.wait_for("the caller to leave", lambda: left(1))
        assert len(run.audio) / 2 / SAMPLE_RATE == pytest.approx(1.5, abs=0.3)
        # Listening again: the next caller is heard in full.
        await run.wait_for("a new listener", lambda: run.events()[-1].reason == "srt-waiting")
        code, err = await encode(url, seconds=1.0, freq=880, fmt="mpegts")
        assert code == 0, err
        await run.wait_for("the second caller to leave", lambda: left(2))
        assert len(run.audio) / 2 / SAMPLE_RATE == pytest.approx(2.5, abs=0.3)
        for event in run.events():
            assert passphrase not in event.detail
