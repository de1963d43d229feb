"""Live HLS WebVTT from the real gateway on a real Redis: the rolling playlist, its
segments (parsed with webvtt-py), and cue times that are the captions' audio times."""

from __future__ import annotations

import math
import re

import httpx
import pytest
import webvtt

from orchestrator.outputs.hls import HlsOptions, HlsTrack
from tests.outputs_support import caption, hall, running_gateway
from workers.bus import RedisBus
from workers.events import SAMPLE_RATE, AudioChunk

integration = pytest.mark.integration
unit = pytest.mark.unit

TIMEOUT_S = 10.0
TIMESTAMP_MAP = "X-TIMESTAMP-MAP=MPEGTS:900000,LOCAL:00:00:00.000"


def parse_playlist(text: str) -> tuple[dict[str, str], list[tuple[float, str]]]:
    """Tags and (duration, uri) entries of a media playlist; fails on anything malformed."""
    lines = text.splitlines()
    assert lines[0] == "#EXTM3U"
    tags: dict[str, str] = {}
    entries: list[tuple[float, str]] = []
    i = 1
    while i < len(lines):
        line = lines[i]
        if line.startswith("#EXTINF:"):
            m = re.fullmatch(r"#EXTINF:(\d+(?:\.\d+)?),.*", line)
            assert m, line
            uri = lines[i + 1]
            assert uri and not uri.startswith("#"), f"EXTINF without a URI: {lines[i:i + 2]}"
            entries.append((float(m.group(1)), uri))
            i += 2
            continue
        name, _, value = line.partition(":")
        assert name.startswith("#EXT-X-"), line
        tags[name] = value
        i += 1
    assert "#EXT-X-ENDLIST" not in tags, "a live playlist has no end"
    return tags, entries


async def set_audio_clock(bus: RedisBus, stream: str, seconds: float) -> None:
    """Make the stream's audio clock read `seconds` (one 0.1 s chunk ending there)."""
    samples = SAMPLE_RATE // 10
    pos = round(seconds * SAMPLE_RATE) - samples
    await bus.add_audio(AudioChunk(stream=stream, pos=pos, pcm=b"\0\0" * samples, wall=0.0))


def cue_times(vtt: str) -> list[tuple[str | None, float, float, str]]:
    return [(c.identifier, c.start_time.in_milliseconds() / 1000,
             c.end_time.in_milliseconds() / 1000, c.text)
            for c in webvtt.from_string(vtt).captions]


@integration
async def test_playlist_and_segments_carry_the_finals_at_their_audio_times(
    redis_url: str, bus: RedisBus
) -> None:
    finals = [
        caption(2, 1, "Good morning everyone.", 0.5, 1.5),
        caption(4, 2, "Welcome to the main hall.", 1.8, 2.6),  # crosses the 2 s boundary
        caption(6, 3, "Let us begin.", 4.1, 5.0),
    ]
    interims = [caption(1, 1, "Good", 0.5, 0.9, final=False),
                caption(3, 2, "Welcome", 1.8, 2.0, final=False),
                caption(5, 3, "Let", 4.1, 4.3, final=False)]
    for seg in sorted(finals + interims, key=lambda s: s.seq):
        await bus.publish_caption(seg)
    await set_audio_clock(bus, "hall", 8.0)
    options = HlsOptions(segment_s=2.0, window=5, delay_s=0.0, mpegts=900_000, refresh_s=0)

    async with running_gateway(redis_url, [hall()], hls=options) as gw, \
            httpx.AsyncClient(base_url=gw.base, timeout=TIMEOUT_S) as http:
        resp = await http.get("/hls/hall/en.m3u8")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/vnd.apple.mpegurl")
        assert resp.headers["access-control-allow-origin"] == "*"
        tags, entries = parse_playlist(resp.text)
        assert tags["#EXT-X-TARGETDURATION"] == "2"
        assert tags["#EXT-X-MEDIA-SEQUENCE"] == "0"
        # Audio at 8 s: segments [0,2) [2,4) [4,6) [6,8) are complete.
        assert entries == [(2.0, f"en/{n}.vtt") for n in range(4)]

        cues_by_segment = {}
        for n, (_, uri) in enumerate(entries):
            seg = await http.get(f"/hls/hall/{uri}")
            assert seg.status_code == 200
            assert seg.headers["content-type"].startswith("text/vtt")
            assert seg.text.splitlines()[:2] == ["WEBVTT", TIMESTAMP_MAP]
            cues = cue_times(seg.text)
            for _, start, end, _ in cues:
                assert start < (n + 1) * 2.0 and end > n * 2.0, "a cue outside its segment"
            cues_by_segment[n] = cues

    # Every final, once per segment it overlaps, at exactly its audio times.
    assert [c[3] for c in cues_by_segment[0]] == ["Good morning everyone.",
                                                  "Welcome to the main hall."]
    assert [c[3] for c in cues_by_segment[1]] == ["Welcome to the main hall."]
    assert [c[3] for c in cues_by_segment[2]] == ["Let us begin."]
    assert cues_by_segment[3] == []
    assert cues_by_segment[0][1] == cues_by_segment[1][0], "a repeated cue is identical"
    seen = {c[0]: (c[1], c[2]) for cues in cues_by_segment.values() for c in cues}
    for f in finals:
        ident = f"{f.seq}-{f.segment_id}-1"
        assert seen[ident] == (f.audio_start_s, f.audio_end_s)


@integration
async def test_playlist_rolls_forward_with_the_audio_clock(
    redis_url: str, bus: RedisBus
) -> None:
    await bus.publish_caption(caption(1, 1, "Early words.", 1.0, 2.0))
    await set_audio_clock(bus, "hall", 6.0)
    options = HlsOptions(segment_s=2.0, window=3, delay_s=1.0, refresh_s=0)
    async with running_gateway(redis_url, [hall()], hls=options) as gw, \
            httpx.AsyncClient(base_url=gw.base, timeout=TIMEOUT_S) as http:
        tags, entries = parse_playlist((await http.get("/hls/hall/en.m3u8")).text)
        # 6 s of audio, 1 s of hold-back: only [0,2) and [2,4) are published.
        assert [uri for _, uri in entries] == ["en/0.vtt", "en/1.vtt"]
        assert (await http.get("/hls/hall/en/2.vtt")).status_code == 404, "not yet published"

        await bus.publish_caption(caption(2, 2, "Much later words.", 20.5, 21.5))
        await set_audio_clock(bus, "hall", 23.0)
        tags, entries = parse_playlist((await http.get("/hls/hall/en.m3u8")).text)
        last = math.floor((23.0 - 1.0) / 2.0) - 1  # 10
        assert tags["#EXT-X-MEDIA-SEQUENCE"] == str(last - 2)
        assert [uri for _, uri in entries] == [f"en/{n}.vtt" for n in range(last - 2, last + 1)]
        assert (await http.get("/hls/hall/en/0.vtt")).status_code == 404, "left the window"
        cues = cue_times((await http.get("/hls/hall/en/10.vtt")).text)
        assert [(c[1], c[2], c[3]) for c in cues] == [(20.5, 21.5, "Much later words.")]


@integration
async def test_translation_track_shows_each_segment_once_whatever_its_order(
    redis_url: str, bus: RedisBus
) -> None:
    # Translations of segments 2 and 1 arrive out of order; segment 2's is published
    # twice (a re-claimed job) and segment 3's failed.
    for seg in [
        caption(1, 2, "Bienvenue dans la grande salle.", 1.8, 2.6, lang="fr"),
        caption(2, 1, "Bonjour à tous.", 0.5, 1.5, lang="fr"),
        caption(3, 2, "Bienvenue dans la salle.", 1.8, 2.6, lang="fr"),
        caption(4, 3, "", 3.0, 3.5, lang="fr", error="translation_failed"),
    ]:
        await bus.publish_caption(seg)
    await set_audio_clock(bus, "hall", 4.0)
    options = HlsOptions(segment_s=2.0, window=5, delay_s=0.0, refresh_s=0)
    async with running_gateway(redis_url, [hall()], hls=options) as gw, \
            httpx.AsyncClient(base_url=gw.base, timeout=TIMEOUT_S) as http:
        first = cue_times((await http.get("/hls/hall/fr/0.vtt")).text)
        second = cue_times((await http.get("/hls/hall/fr/1.vtt")).text)
        assert (await http.get("/hls/hall/de.m3u8")).status_code == 404
        assert (await http.get("/hls/nowhere/fr.m3u8")).status_code == 404
    assert [c[3] for c in first] == ["Bonjour à tous.", "Bienvenue dans la grande salle."]
    assert [c[3] for c in second] == ["Bienvenue dans la grande salle."]


@unit
def test_a_long_final_is_split_into_timed_screens_across_segments() -> None:
    track = HlsTrack(HlsOptions(segment_s=4.0, window=5, delay_s=0.0))
    text = ("This sentence is long enough to need more than two lines of forty-two "
            "characters, so it is shown as two screens one after the other.")
    track.add(caption(1, 1, text, 2.0, 10.0))
    track.advance(12.0)
    cues = [c for n in range(3) for c in cue_times(track.segment(n) or "")]
    unique = sorted(set(cues), key=lambda c: c[1])
    assert len(unique) == 2
    (_, s1, e1, t1), (_, s2, e2, t2) = unique
    assert (s1, e2) == (2.0, 10.0) and e1 == s2 and s1 < e1 < e2
    assert " ".join(f"{t1} {t2}".split()) == text
    assert all(len(line) <= 42 for line in f"{t1}\n{t2}".splitlines())


@unit
def test_a_gap_event_shows_where_the_audio_was_skipped_and_moves_the_clock() -> None:
    from dataclasses import replace

    track = HlsTrack(HlsOptions(segment_s=4.0, window=10, delay_s=0.0))
    track.add(caption(1, 1, "Before.", 1.0, 2.0))
    track.add(replace(caption(2, 2, "", 2.5, 22.5, final=False), lines=(), gap_s=20.0))
    assert track.clock_s == 22.5  # the skipped audio is behind us
    segments = [track.segment(n) for n in range(track.last_segment() + 1)]
    cues = {(s, e, t) for seg in segments if seg for _, s, e, t in cue_times(seg)}
    assert (2.5, 22.5, "[20 s not captioned]") in cues
