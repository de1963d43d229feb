"""WebVTT/SRT archives on a real Redis: written as finals arrive, complete after a crash
(a SIGKILLed writer), and rebuilt by `babelcast export`; parsed with webvtt-py and srt."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import srt
import webvtt

from orchestrator.outputs.archive import ArchiveWriter
from orchestrator.outputs.config import ArchiveConfig, OutputsConfig, start_outputs
from orchestrator.outputs.cues import final_cues
from orchestrator.outputs.runner import DRAIN_S, OutputsRunner
from tests.outputs_support import caption
from tests.speech import ROOT
from tests.waiting import eventually
from workers.bus import RedisBus
from workers.captions.linebreak import WEB
from workers.events import CaptionSegment, StreamOptions

integration = pytest.mark.integration
unit = pytest.mark.unit

WAIT_S = 15.0
HALL = StreamOptions(stream_id="hall", name="Hall", source="push", language="en",
                     targets=("fr",))

ENGLISH = [
    caption(1, 1, "Good", 0.4, 0.8, final=False),
    caption(2, 1, "Good morning, everyone.", 0.4, 1.9),
    caption(3, 2, "Welcome to", 2.2, 2.9, final=False),
    caption(4, 2, "Welcome to the main hall & the <annex> -- enjoy.", 2.2, 4.6),
    caption(5, 3, "This sentence is long enough to need more than two lines of "
                  "forty-two characters, so the archive shows it as two cues.", 5.0, 12.0),
]
FRENCH = [  # translations: out of order, one repeated, one failed
    caption(1, 2, "Bienvenue dans la grande salle et l'annexe.", 2.2, 4.6, lang="fr"),
    caption(2, 1, "Bonjour à tous.", 0.4, 1.9, lang="fr"),
    caption(3, 2, "Bienvenue dans la salle.", 2.2, 4.6, lang="fr"),
    caption(4, 3, "", 5.0, 12.0, lang="fr", error="translation_failed"),
]


def vtt_cues(path: Path) -> list[tuple[float, float, str]]:
    return [(c.start_time.in_milliseconds() / 1000, c.end_time.in_milliseconds() / 1000,
             c.text) for c in webvtt.read(str(path))]


def srt_cues(text: str) -> list[tuple[float, float, str]]:
    return [(s.start.total_seconds(), s.end.total_seconds(), s.content)
            for s in srt.parse(text)]


def expected(finals: list[CaptionSegment]) -> list[tuple[float, float, str]]:
    cues = [c for seg in finals for c in final_cues(seg, WEB)]
    return [(round(c.start_s, 3), round(c.end_s, 3), c.text) for c in cues]


def unescape(cues: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    # webvtt-py returns cue text as written: WebVTT escapes & < >.
    return [(a, b, t.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
            for a, b, t in cues]


async def publish(bus: RedisBus, segs: list[CaptionSegment]) -> None:
    for seg in segs:
        await bus.publish_caption(seg)


@pytest.fixture
async def runner_factory(redis_url: str, tmp_path: Path) -> AsyncIterator[list[OutputsRunner]]:
    runners: list[OutputsRunner] = []
    yield runners
    for r in runners:
        await r.aclose()


async def start(redis_url: str, folder: Path, runners: list[OutputsRunner]) -> OutputsRunner:
    cfg = OutputsConfig(archive=ArchiveConfig(dir=str(folder)))
    runner = await start_outputs(redis_url, [HALL], cfg, environ={})
    runners.append(runner)
    return runner


def cue_count(path: Path) -> int:
    return len(webvtt.read(str(path)).captions) if path.exists() else 0


@integration
async def test_archives_hold_every_final_at_its_audio_time(
    redis_url: str, bus: RedisBus, tmp_path: Path, runner_factory: list[OutputsRunner]
) -> None:
    await start(redis_url, tmp_path, runner_factory)
    await publish(bus, ENGLISH + FRENCH)
    en_vtt, fr_vtt = tmp_path / "hall" / "en.vtt", tmp_path / "hall" / "fr.vtt"
    want_en = expected([s for s in ENGLISH if s.is_final])

    async def written() -> bool:
        return cue_count(en_vtt) == len(want_en) and cue_count(fr_vtt) == 2

    await eventually(written, WAIT_S, "the archives to hold every final")
    # Written as the event runs: readable before the runner stops.
    assert unescape(vtt_cues(en_vtt)) == want_en
    assert srt_cues((tmp_path / "hall" / "en.srt").read_text()) == want_en
    assert len(want_en) == 4, "the long final is two cues"
    assert all(len(line) <= 42 for _, _, text in want_en for line in text.splitlines())

    await runner_factory.pop().aclose()
    # French arrived out of order (segment 2 before 1): sorted when the writer closed;
    # the repeated final of segment 2 and the failed translation are not archived.
    want_fr = [(0.4, 1.9, "Bonjour à tous."),
               (2.2, 4.6, "Bienvenue dans la grande salle\net l'annexe.")]
    assert vtt_cues(fr_vtt) == want_fr
    assert srt_cues((tmp_path / "hall" / "fr.srt").read_text()) == want_fr
    assert [s.index for s in srt.parse((tmp_path / "hall" / "fr.srt").read_text())] == [1, 2]


CRASHING_WRITER = """
import asyncio, sys
from orchestrator.outputs.config import ArchiveConfig, OutputsConfig, start_outputs
from workers.events import StreamOptions

async def main():
    hall = StreamOptions(stream_id="hall", name="Hall", source="push", language="en")
    cfg = OutputsConfig(archive=ArchiveConfig(dir=sys.argv[2]))
    await start_outputs(sys.argv[1], [hall], cfg, environ={})
    print("started", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@integration
async def test_archive_is_complete_after_a_crash_and_resumes_without_repeats(
    redis_url: str, bus: RedisBus, tmp_path: Path, runner_factory: list[OutputsRunner]
) -> None:
    path = tmp_path / "hall" / "en.vtt"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_WRITER, redis_url, str(tmp_path), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
        assert line.strip() == b"started", line
        first = ENGLISH[:4]
        await publish(bus, first)

        async def has_first() -> bool:
            return cue_count(path) == 2

        await eventually(has_first, WAIT_S, "the writer to archive the first finals")
        os.kill(proc.pid, signal.SIGKILL)  # no close, no flush beyond what it did per cue
        await asyncio.wait_for(proc.wait(), WAIT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert unescape(vtt_cues(path)) == expected([s for s in first if s.is_final])

    # A power cut could also leave a torn cue at the end: the next writer cuts it off.
    with path.open("a", encoding="utf-8") as f:
        f.write("\n9-9-1\n00:00:20.000 --> 00:0")
    back = caption(6, 4, "And we are back.", 13.0, 14.0)
    await publish(bus, [*ENGLISH[4:], back])
    await start(redis_url, tmp_path, runner_factory)
    want = expected([*(s for s in ENGLISH if s.is_final), back])

    async def complete() -> bool:
        return cue_count(path) == len(want)

    await eventually(complete, WAIT_S, "the restarted writer to catch up")
    assert unescape(vtt_cues(path)) == want, "nothing repeated, nothing lost"
    assert srt_cues((tmp_path / "hall" / "en.srt").read_text()) == want


@integration
async def test_archive_of_a_new_event_in_the_same_folder_keeps_the_old_files(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    old = ArchiveWriter(tmp_path, "hall", "en")
    old.open()
    old.write(caption(50, 20, "From yesterday.", 100.0, 101.0))
    old.close()
    await publish(bus, [caption(1, 1, "Today.", 0.5, 1.0)])  # Redis only holds seq 1
    runners: list[OutputsRunner] = []
    try:
        await start(redis_url, tmp_path, runners)

        async def today() -> bool:
            return cue_count(tmp_path / "hall" / "en.vtt") == 1

        await eventually(today, WAIT_S, "the new archive")
    finally:
        for r in runners:
            await r.aclose()
    assert vtt_cues(tmp_path / "hall" / "en.vtt") == [(0.5, 1.0, "Today.")]
    kept = list((tmp_path / "hall").glob("en.until-*.vtt"))
    assert len(kept) == 1 and vtt_cues(kept[0]) == [(100.0, 101.0, "From yesterday.")]


def babelcast(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@integration
async def test_export_rebuilds_vtt_and_srt_from_redis(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    await publish(bus, ENGLISH + FRENCH)
    result = await asyncio.to_thread(babelcast, "export", "hall", "--lang", "fr", "--format",
                                     "srt", "--redis", redis_url)
    assert result.returncode == 0, result.stderr
    assert srt_cues(result.stdout) == [(0.4, 1.9, "Bonjour à tous."),
                                       (2.2, 4.6, "Bienvenue dans la grande salle\n"
                                                  "et l'annexe.")]
    out = tmp_path / "hall-en.vtt"
    result = await asyncio.to_thread(babelcast, "export", "hall", "--lang", "en", "-o",
                                     str(out), "--redis", redis_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert unescape(vtt_cues(out)) == expected([s for s in ENGLISH if s.is_final])

    missing = await asyncio.to_thread(babelcast, "export", "hall", "--lang", "de", "--redis",
                                      redis_url)
    assert missing.returncode == 2
    assert "no captions for stream 'hall' in language 'de'" in missing.stderr
    assert "en, fr" in missing.stderr
    # A stream this Redis never heard of is named as such, not blamed on the language.
    unknown = await asyncio.to_thread(babelcast, "export", "hal", "--lang", "en", "--redis",
                                      redis_url)
    assert unknown.returncode == 2
    assert "unknown stream 'hal'" in unknown.stderr and "streams there: hall" in unknown.stderr
    assert "language" not in unknown.stderr


@unit
def test_cue_text_that_looks_like_markup_survives_the_round_trip(tmp_path: Path) -> None:
    writer = ArchiveWriter(tmp_path, "hall", "en")
    writer.open()
    text = "a <b> & c --> d"
    writer.write(caption(1, 1, text, 0.0, 1.0))
    writer.close()
    raw = (tmp_path / "hall" / "en.vtt").read_text()
    assert "<b>" not in raw and "-->" not in raw.split("\n", 4)[-1]
    assert unescape(vtt_cues(tmp_path / "hall" / "en.vtt")) == [(0.0, 1.0, text)]
    assert srt_cues((tmp_path / "hall" / "en.srt").read_text()) == [(0.0, 1.0, text)]


@unit
def test_archive_folder_resolves_against_the_event_file_and_can_be_turned_off(
    tmp_path: Path
) -> None:
    cfg = OutputsConfig.model_validate({"archive": {"dir": "records"}},
                                       context={"base_dir": tmp_path})
    assert cfg.archive.resolved_dir == tmp_path / "records"
    off = OutputsConfig.model_validate({"archive": {"dir": None}})
    assert off.archive.resolved_dir is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        OutputsConfig.model_validate({"archive": {"dir": "file"}},
                                     context={"base_dir": tmp_path})
    with pytest.raises(ValueError, match=r"archive\.folder"):
        OutputsConfig.model_validate({"archive": {"folder": "x"}})


@integration
async def test_export_through_the_gateway_needs_only_a_viewer_token_and_matches_redis(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    """`babelcast export --url`: a user with the gateway and a token, no Redis access."""
    from orchestrator.gateway.access import GatewaySecurity
    from orchestrator.gateway.app import GatewayStream
    from orchestrator.gateway.auth import Authenticator, GatewaySecrets, mint_viewer_token
    from tests.outputs_support import ADMIN_TOKEN, running_gateway

    key = b"e" * 48
    security = GatewaySecurity(Authenticator(GatewaySecrets(admin=ADMIN_TOKEN, signing_key=key),
                                             viewers_public=False))
    fr_viewer = mint_viewer_token(key, streams=["hall"], langs=["fr"], ttl_s=600, subject="t")
    await publish(bus, ENGLISH + FRENCH)
    async with running_gateway(redis_url, [GatewayStream(HALL, "push")],
                               security=security) as gw:
        env_free = {k: v for k, v in os.environ.items() if k != "BABELCAST_TOKEN"}

        def export(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "orchestrator.cli", "export", "hall",
                                   "--url", gw.base, *args], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60, env=env_free)

        via_redis = await asyncio.to_thread(babelcast, "export", "hall", "--lang", "fr",
                                            "--format", "srt", "--redis", redis_url)
        result = await asyncio.to_thread(export, "--lang", "fr", "--format", "srt",
                                         "--token", fr_viewer)
        assert result.returncode == 0, result.stderr
        assert result.stdout == via_redis.stdout
        assert srt_cues(result.stdout)[0] == (0.4, 1.9, "Bonjour à tous.")

        out = tmp_path / "hall.vtt"  # the stream's own language by default; admin may
        result = await asyncio.to_thread(export, "-o", str(out), "--token", ADMIN_TOKEN)
        assert result.returncode == 0, result.stderr
        assert "captions of hall in 'en' (vtt)" in result.stderr
        assert unescape(vtt_cues(out)) == expected([s for s in ENGLISH if s.is_final])

        refused = {
            "no token": (await asyncio.to_thread(export, "--lang", "fr"), "401"),
            "another language": (await asyncio.to_thread(export, "--lang", "en", "--token",
                                                         fr_viewer), "403"),
        }
        for what, (res, code) in refused.items():
            assert res.returncode == 2 and f"answered {code}" in res.stderr, what
            assert "--token" in res.stderr and res.stdout == "", what
        missing = await asyncio.to_thread(export, "--lang", "de", "--token", ADMIN_TOKEN)
        assert missing.returncode == 2 and "answered 404" in missing.stderr
        assert "en, fr" in missing.stderr


@integration
async def test_finals_published_just_before_a_stop_are_in_the_archive(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    """`babelcast run` stops the ASR actors (which make the open captions final) and then
    the outputs: closing waits until the archive holds what Redis holds, so the sentence
    open at SIGTERM is archived (issue 36: it was missing)."""
    cfg = OutputsConfig(archive=ArchiveConfig(dir=str(tmp_path)))
    runner = await start_outputs(redis_url, [HALL], cfg, environ={})
    path = tmp_path / "hall" / "en.vtt"
    try:
        await publish(bus, ENGLISH[:2])

        async def has_first() -> bool:
            return cue_count(path) == 1

        await eventually(has_first, WAIT_S, "the first final archived")
        # The stop's finals, published the moment before the close.
        await publish(bus, ENGLISH[2:])
    finally:
        await runner.aclose()
    assert unescape(vtt_cues(path)) == expected([s for s in ENGLISH if s.is_final])


SLOW_WRITE_S = 0.4
"""A slow disk (a stand-in: the archive's own write, delayed): 12 finals take 4.8 s to
write, longer than the close waits for an output that has stopped (`DRAIN_S`, 3 s)."""


@integration
async def test_a_slow_archive_that_keeps_writing_gets_every_final_before_the_close(
    redis_url: str, bus: RedisBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded host or a slow disk is slow, not stuck: closing waits while the archive
    keeps writing (it once closed after a fixed 3 s and lost the stop's last captions)."""
    write = ArchiveWriter.write

    def slow_write(self: ArchiveWriter, seg: CaptionSegment) -> int:
        time.sleep(SLOW_WRITE_S)
        return write(self, seg)

    monkeypatch.setattr(ArchiveWriter, "write", slow_write)
    finals = [caption(i, i, f"Sentence number {i}.", 2.0 * i, 2.0 * i + 1.5)
              for i in range(1, 13)]
    assert len(finals) * SLOW_WRITE_S > DRAIN_S  # else this shows nothing
    cfg = OutputsConfig(archive=ArchiveConfig(dir=str(tmp_path)))
    runner = await start_outputs(redis_url, [HALL], cfg, environ={})
    await publish(bus, finals)  # the stop's finals, the moment before the close
    await runner.aclose()
    assert unescape(vtt_cues(tmp_path / "hall" / "en.vtt")) == expected(finals)


@integration
async def test_a_stuck_archive_does_not_hold_the_stop(
    redis_url: str, bus: RedisBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """An output that writes nothing (a hung mount) is given up on `drain_s` after its
    last write, with a warning naming the track and the seq it did not reach."""
    release = threading.Event()
    write = ArchiveWriter.write

    def stuck_write(self: ArchiveWriter, seg: CaptionSegment) -> int:
        if seg.seq >= 2:
            release.wait(60)
        return write(self, seg)

    monkeypatch.setattr(ArchiveWriter, "write", stuck_write)
    cfg = OutputsConfig(archive=ArchiveConfig(dir=str(tmp_path)))
    runner = await start_outputs(redis_url, [HALL], cfg, environ={})
    try:
        await publish(bus, [caption(i, i, f"Sentence {i}.", 2.0 * i, 2.0 * i + 1)
                            for i in (1, 2, 3)])
        path = tmp_path / "hall" / "en.vtt"

        async def first_written() -> bool:
            return cue_count(path) == 1

        await eventually(first_written, WAIT_S, "the first final archived")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="orchestrator.outputs.runner"):
            await runner.aclose(drain_s=1.0)
        took = time.monotonic() - t0
    finally:
        release.set()
    # Given up after 1 s without a write, then 1 s for the write in flight to end.
    assert took < 1.0 + 1.0 + 2.0, took
    assert any("hall/en closed before seq 3 was written (nothing written for 1 s)"
               in r.getMessage() for r in caplog.records), caplog.text


@integration
async def test_a_gap_event_is_archived_where_the_audio_was_skipped(
    redis_url: str, bus: RedisBus, tmp_path: Path
) -> None:
    from dataclasses import replace

    gap = replace(caption(3, 3, "", 5.0, 25.5, final=False), lines=(), gap_s=20.5)
    after = caption(4, 4, "And we are back.", 26.0, 27.0)
    cfg = OutputsConfig(archive=ArchiveConfig(dir=str(tmp_path)))
    runner = await start_outputs(redis_url, [HALL], cfg, environ={})
    path = tmp_path / "hall" / "en.vtt"
    try:
        await publish(bus, [*ENGLISH[:2], gap, after])

        async def all_written() -> bool:
            return cue_count(path) == 3

        # Written before the close: this test is about the gap's cue, not the close's
        # drain (the test above), whose 3 s a loaded suite host once ran out of.
        await eventually(all_written, WAIT_S, "the gap and the caption after it archived")
    finally:
        await runner.aclose()
    cues = unescape(vtt_cues(path))
    assert cues[-2:] == [(5.0, 25.5, "[20 s not captioned]"), (26.0, 27.0, "And we are back.")]
