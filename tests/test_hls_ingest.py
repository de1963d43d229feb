"""HLS as a live source: the playlist bookkeeping on its own, then real segments over HTTP.

A scripted playlist server (real HTTP, real AAC segments made by ffmpeg) advances,
stalls, comes back, restarts its media sequence (reusing segment names, as ffmpeg
does) and ends; every segment must be fetched once and heard once. Then a real
ffmpeg HLS encoder (`-f hls -hls_time 2 -hls_list_size 6`) that ends cleanly.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.redis_server import free_port
from tests.speech import decode_pcm16
from workers.events import SAMPLE_RATE
from workers.sources.base import SourceError, SourceEvent, SourceItem
from workers.sources.hls import HlsSource
from workers.sources.hls_playlist import (
    Playlist,
    PlaylistError,
    Segment,
    SegmentTracker,
    parse_playlist,
    pick_audio_playlist,
)

needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs Debian ffmpeg")


# --- the bookkeeping on its own (unit) --------------------------------------------------


def live(first: int, count: int, *, ended: bool = False, target: float = 2.0) -> Playlist:
    segs = tuple(Segment(first + i, f"http://h/s{first + i}.ts", target) for i in range(count))
    return Playlist(target, first, segs, ended)


@pytest.mark.unit
def test_parse_reads_a_media_playlist_and_makes_uris_absolute() -> None:
    pl = parse_playlist("#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:41\n"
                        "#EXTINF:1.98,\nlive41.ts\n#EXT-X-DISCONTINUITY\n#EXTINF:2.0,\n"
                        "/other/live42.ts\n#EXT-X-ENDLIST\n", "http://h/a/live.m3u8")
    assert (pl.target_duration_s, pl.media_sequence, pl.ended) == (2.0, 41, True)
    assert [(s.seq, s.uri, s.discontinuity) for s in pl.segments] == [
        (41, "http://h/a/live41.ts", False), (42, "http://h/other/live42.ts", True)]


@pytest.mark.unit
def test_a_master_playlist_leads_to_its_audio_rendition_or_its_lightest_variant() -> None:
    master = parse_playlist(
        '#EXTM3U\n#EXT-X-MEDIA:TYPE=AUDIO,GROUP-ID="aud",NAME="en",DEFAULT=YES,URI="a/en.m3u8"\n'
        '#EXT-X-STREAM-INF:BANDWIDTH=3000000,AUDIO="aud"\nhi.m3u8\n'
        '#EXT-X-STREAM-INF:BANDWIDTH=800000,AUDIO="aud"\nlo.m3u8\n', "http://h/m.m3u8")
    assert pick_audio_playlist(master) == "http://h/a/en.m3u8"
    plain = parse_playlist("#EXTM3U\n#EXT-X-STREAM-INF:BANDWIDTH=3000000\nhi.m3u8\n"
                           "#EXT-X-STREAM-INF:BANDWIDTH=800000\nlo.m3u8\n", "http://h/m.m3u8")
    assert pick_audio_playlist(plain) == "http://h/lo.m3u8"


@pytest.mark.unit
@pytest.mark.parametrize("text", ["not a playlist", "#EXTM3U\n#EXT-X-KEY:METHOD=AES-128,URI=k\n"
                                  "#EXTINF:2,\na.ts\n"])
def test_what_cannot_be_followed_is_refused_with_a_reason(text: str) -> None:
    with pytest.raises(PlaylistError):
        parse_playlist(text, "http://h/x.m3u8")


@pytest.mark.unit
def test_tracker_starts_at_the_live_edge_and_reads_each_new_segment_once() -> None:
    t = SegmentTracker(start_segments=1)
    assert [s.seq for s in t.plan(live(10, 6), 0.0).segments] == [15]
    assert t.plan(live(10, 6), 1.0).segments == ()  # nothing new
    assert [s.seq for s in t.plan(live(12, 6), 2.0).segments] == [16, 17]
    two = SegmentTracker(start_segments=2)
    assert [s.seq for s in two.plan(live(10, 6), 0.0).segments] == [14, 15]


@pytest.mark.unit
def test_segments_gone_before_they_were_read_are_a_gap() -> None:
    t = SegmentTracker()
    t.plan(live(10, 3), 0.0)  # read 12
    plan = t.plan(live(20, 3), 1.0)  # 13..19 are gone
    assert (plan.gap, plan.skipped, [s.seq for s in plan.segments]) == (
        "hls-skipped", 7, [20, 21, 22])


@pytest.mark.unit
def test_a_restarted_sequence_is_a_gap_read_from_its_start_while_it_is_young() -> None:
    t = SegmentTracker()
    t.plan(live(100, 6), 0.0)  # read 105
    plan = t.plan(live(0, 3), 1.0)  # seen within ~2 segments: its first words are kept
    assert (plan.gap, [s.seq for s in plan.segments]) == ("hls-restart", [0, 1, 2])
    assert [s.seq for s in t.plan(live(0, 4), 2.0).segments] == [3]
    late = SegmentTracker()
    late.plan(live(100, 6), 0.0)
    plan = late.plan(live(0, 6), 1.0)  # seen late: from the live edge, not 12 s behind
    assert (plan.gap, [s.seq for s in plan.segments]) == ("hls-restart", [5])


@pytest.mark.unit
def test_a_playlist_that_stops_advancing_is_stalled_once_until_it_moves() -> None:
    t = SegmentTracker(stall_after=2.0)
    t.plan(live(0, 3), 0.0)
    assert not t.plan(live(0, 3), 3.9).stalled  # 2 target durations of 2 s: not yet
    assert t.plan(live(0, 3), 4.1).stalled
    assert not t.plan(live(0, 3), 9.0).stalled  # said once
    assert [s.seq for s in t.plan(live(1, 3), 10.0).segments] == [3]
    assert t.plan(live(1, 3), 14.5).stalled  # a new stall after it moved again


@pytest.mark.unit
def test_the_end_comes_after_the_last_segment_and_never_replays() -> None:
    t = SegmentTracker()
    t.plan(live(0, 4), 0.0)
    plan = t.plan(live(0, 5, ended=True), 1.0)
    assert ([s.seq for s in plan.segments], plan.ended) == ([4], True)
    again = t.plan(live(0, 5, ended=True), 2.0)
    assert (again.segments, again.ended) == ((), True)


# --- a scripted playlist server with real segments ---------------------------------------


@dataclass
class ScriptedHls:
    """The playlist a live encoder would publish: a window of `window` segments."""

    folder: Path
    window: int = 3
    target_s: float = 1.0
    first: int = 0
    count: int = 0
    ended: bool = False
    epoch: int = 0  # bumped when the encoder "restarts": same names, new content
    requests: list[tuple[int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def playlist(self) -> str:
        with self.lock:
            start = max(self.first, self.first + self.count - self.window)
            lines = ["#EXTM3U", "#EXT-X-VERSION:3",
                     f"#EXT-X-TARGETDURATION:{int(self.target_s)}",
                     f"#EXT-X-MEDIA-SEQUENCE:{start - self.first}"]
            for n in range(start, self.first + self.count):
                lines += [f"#EXTINF:{self.target_s:.3f},", f"s{n - self.first}.ts"]
            if self.ended:
                lines.append("#EXT-X-ENDLIST")
            return "\n".join(lines) + "\n"

    def advance(self) -> None:
        with self.lock:
            self.count += 1

    def restart(self) -> None:
        with self.lock:
            self.epoch += 1
            self.first += self.count
            self.count = 1


def make_segments(folder: Path, count: int) -> list[Path]:
    """`count` one-second AAC segments in MPEG-TS, each its own tone."""
    out = []
    for i in range(count):
        path = folder / f"tone{i}.ts"
        subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-f", "lavfi", "-i",
                        f"sine=frequency={300 + 50 * i}:sample_rate=44100:duration=1",
                        "-c:a", "aac", "-f", "mpegts", str(path)], check=True, timeout=60)
        out.append(path)
    return out


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[str, ScriptedHls, list[Path]]]:
    hls = ScriptedHls(tmp_path)
    segments = make_segments(tmp_path, 12)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/live.m3u8":
                body = hls.playlist().encode()
            elif not self.path.startswith("/s"):
                self.send_error(404)
                return
            else:
                n = int(self.path.removeprefix("/s").removesuffix(".ts"))
                with hls.lock:
                    hls.requests.append((hls.epoch, self.path))
                    # Content of "s{n}.ts" depends on the epoch: names are reused.
                    body = segments[(n + 5 * hls.epoch) % len(segments)].read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/live.m3u8", hls, segments
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def read_all(source: HlsSource, limit_s: float) -> list[SourceItem]:
    items: list[SourceItem] = []

    async def run() -> None:
        async for item in source.chunks():
            items.append(item)

    await asyncio.wait_for(run(), limit_s)
    return items


def audio_s(items: list[SourceItem]) -> float:
    return sum(len(i) for i in items if isinstance(i, bytes)) / 2 / SAMPLE_RATE


@pytest.mark.integration
@needs_ffmpeg
async def test_a_playlist_that_stalls_restarts_and_ends_is_read_once_segment_by_segment(
    scripted: tuple[str, ScriptedHls, list[Path]],
) -> None:
    url, hls, segments = scripted
    for _ in range(3):
        hls.advance()

    async def encoder() -> None:
        for _ in range(3):  # live: a new segment every second
            await asyncio.sleep(1.0)
            hls.advance()
        await asyncio.sleep(3.5)  # stalls: more than 2 target durations
        for _ in range(2):
            hls.advance()
            await asyncio.sleep(1.0)
        hls.restart()  # the encoder restarts: media sequence 0 again, same names
        for _ in range(2):
            await asyncio.sleep(1.0)
            hls.advance()
        hls.ended = True

    source = HlsSource(url)
    items, _ = await asyncio.gather(read_all(source, 30), encoder())

    events = [(i.kind, i.reason) for i in items if isinstance(i, SourceEvent)]
    assert events == [("idle", "hls-stalled"), ("gap", "hls-restart")]
    # Every segment fetched once: the newest at the start, then each new one.
    assert len(hls.requests) == len(set(hls.requests))
    assert [p for e, p in hls.requests if e == 0] == [f"/s{n}.ts" for n in range(2, 8)]
    assert [p for e, p in hls.requests if e == 1] == ["/s0.ts", "/s1.ts", "/s2.ts"]
    # ... and heard once: each segment's audio (1 s of tone, AAC's priming and padding
    # make it 1.045 s) once, nothing replayed.
    per_segment = len(decode_pcm16(segments[0])) / 2 / SAMPLE_RATE
    assert audio_s(items) == pytest.approx(len(hls.requests) * per_segment, abs=0.2)


@pytest.mark.integration
async def test_a_playlist_server_that_is_down_is_a_retryable_error_that_keeps_its_place(
    scripted: tuple[str, ScriptedHls, list[Path]],
) -> None:
    url, hls, _ = scripted
    for _ in range(4):
        hls.advance()
    down = HlsSource(f"http://127.0.0.1:{free_port()}/live.m3u8")
    with pytest.raises(SourceError) as failed:
        await read_all(down, 10)
    assert failed.value.retryable and "playlist" in str(failed.value)
    # A playlist not written yet is waited for, and said once.
    missing = HlsSource(url.replace("/live.m3u8", "/later.m3u8")).chunks()
    said = await asyncio.wait_for(anext(missing), 10)
    assert isinstance(said, SourceEvent) and said.reason == "hls-missing"
    await missing.aclose()
    source = HlsSource(url)
    first = source.chunks()
    while not isinstance(await asyncio.wait_for(anext(first), 10), bytes):
        pass
    await first.aclose()  # "the connection drops"
    hls.advance()
    hls.ended = True
    await read_all(source, 10)  # the same source, reconnecting
    assert source.segments_fetched == [3, 4]  # continued after 3, no replay


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.integration
@needs_ffmpeg
async def test_an_ffmpeg_hls_encoder_that_ends_cleanly_ends_the_source_without_replay(
    tmp_path: Path,
) -> None:
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietFiles, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        encoder = await asyncio.create_subprocess_exec(
            "ffmpeg", "-nostdin", "-loglevel", "error", "-re", "-f", "lavfi", "-i",
            "sine=frequency=440:sample_rate=44100:duration=9", "-c:a", "aac", "-f", "hls",
            "-hls_time", "2", "-hls_list_size", "6", str(root / "live.m3u8"))
        deadline = time.monotonic() + 10
        while not (root / "live.m3u8").exists() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        source = HlsSource(f"http://127.0.0.1:{server.server_address[1]}/live.m3u8")
        items = await read_all(source, 30)
        assert await encoder.wait() == 0
    finally:
        server.shutdown()
        server.server_close()
    # From the live edge (the first segment, 2 s in) to the end: ~9 s minus the head
    # start; the source returned (ended) and no segment came twice.
    fetched = source.segments_fetched
    assert fetched == sorted(set(fetched)) and fetched[-1] == 4
    assert 6.0 <= audio_s(items) <= 9.2
