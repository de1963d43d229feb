"""Every ingest path an operator's encoder uses, end to end: real ffmpeg encoders, real
sockets, the ingest and ASR hosts with the embedded Whisper engine, a real Redis.

- HLS from an encoder that stops cleanly: every sentence captioned once, the
  source `ended`, and the delay behind the encoder measured.
- RTMP push: the right stream key is captioned; a wrong one is refused, counted
  and never captioned.
- SRT listener with default settings: over a minute of speech with no real audio
  thrown away, and a WER within one point of a file source of the same speech.
- An encoder killed for 20 s and restarted, on every transport at once: each
  room says `source lost` within 5 s, its audio is back within 4 s of the
  encoder having audio to send, from its first second of speech, and its next
  caption waits on nothing but its own speech and the shared decode thread's
  turns (measured per room, not guessed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jiwer
import numpy as np
import pytest

from tests.ingest_support import (
    TRANSPORTS,
    Encoder,
    Pipeline,
    caption_delays,
    first_write_after,
    from_beep,
    offline_text,
    pipeline,
    serve_folder,
    transport,
    with_beep,
)
from tests.speech import AUDIO, decode_pcm16, normalize
from workers.bus import audio_key
from workers.engines.embedded_options import EmbeddedEngineOptions
from workers.events import SAMPLE_RATE

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs Debian ffmpeg")]

ROOM_A = decode_pcm16(AUDIO / "room-a.flac")
ROOM_B = decode_pcm16(AUDIO / "room-b.flac")
TEXT_A = normalize((AUDIO / "room-a.txt").read_text())
TEXT_B = normalize((AUDIO / "room-b.txt").read_text())
SILENCE_2S = bytes(2 * SAMPLE_RATE * 2)
STEP_S = EmbeddedEngineOptions().step_s
"""Speech a session gathers between interims (the pipeline's engine keeps the default)."""


def speech_onset_s(pcm: bytes, frame_s: float = 0.02) -> float:
    """Where speech starts in `pcm`: its first frame louder than a tenth of its loudest."""
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    n = int(frame_s * SAMPLE_RATE)
    rms = np.sqrt((x[: x.size // n * n].reshape(-1, n) ** 2).mean(axis=1))
    return float(np.flatnonzero(rms > rms.max() / 10)[0] * frame_s)


FIRST_WORD_S = speech_onset_s(ROOM_B)


def finals(captions: list[Any]) -> str:
    return normalize(" ".join(c.text for c in captions if c.is_final))


class LoopLag:
    """How long the event loop was held up: the most a short sleep woke up late (s)."""

    max_s = 0.0


@contextlib.contextmanager
def loop_lag(every_s: float = 0.05) -> Iterator[LoopLag]:
    """Watches the running event loop while the block runs (the pipeline's ingest and
    ASR share it with the test): what froze it shows as `max_s`, not only as a late
    caption."""
    lag = LoopLag()

    async def watch() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(every_s)
            lag.max_s = max(lag.max_s, time.monotonic() - t0 - every_s)

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield lag
    finally:
        task.cancel()


async def until(check: Any, timeout_s: float, what: str, every_s: float = 0.1) -> float:
    """Poll the async `check` until it is true; returns when (time.time())."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)
    return time.time()


async def test_hls_that_ends_cleanly_is_captioned_once_and_ends(
        redis_url: str, tmp_path: Path, record_property: Any) -> None:
    folder = tmp_path / "www" / "hall"
    folder.mkdir(parents=True)
    with serve_folder(folder.parent) as base:
        hls = transport("hls", folder, base)
        async with pipeline(redis_url) as run:
            await run.add("hall", hls.source)
            encoder = Encoder(hls.output)
            await encoder.start(with_beep(ROOM_B + SILENCE_2S))
            assert await encoder.finish() == 0  # ffmpeg writes #EXT-X-ENDLIST

            async def ended() -> bool:
                return (await run.room("hall"))["state"] == "ended"

            await until(ended, 20, "the room to say ended")
            await asyncio.sleep(3)  # the last pause closes the last caption
            captions = await run.captions("hall")
            offset = await run.beep_offset_s("hall")
            room = await run.room("hall")
    assert room["source_state"] == "ended"
    text = finals(captions)
    # Captioned once: as many words as were spoken, not the talk again and again.
    assert len(text.split()) <= len(TEXT_B.split()) + 3, text
    assert jiwer.wer(TEXT_B, text) <= 0.25, text
    assert offset is not None
    delays = caption_delays(captions, encoder, offset)
    report = {"transport": "hls", "finals": len(delays),
              "delay_behind_encoder_p50_s": round(statistics.median(delays), 2),
              "delay_behind_encoder_max_s": round(max(delays), 2)}
    record_property("hls_delay", json.dumps(report))
    print(json.dumps(report))
    # 2 s segments, read from the live edge: was 7.2 s behind with FFmpeg's reader.
    assert report["delay_behind_encoder_p50_s"] <= 5.0


async def test_rtmp_push_with_the_right_key_is_captioned_and_a_wrong_key_is_refused(
        redis_url: str, tmp_path: Path) -> None:
    rtmp = transport("rtmp-push", tmp_path)
    async with pipeline(redis_url) as run:
        await run.add("obs", rtmp.source, key=rtmp.key)

        async def listening() -> bool:
            return (await run.room("obs"))["source_state"] == "idle"

        await until(listening, 10, "the listener")
        wrong = Encoder(tuple(a.replace(rtmp.key, "not-the-key") for a in rtmp.output))
        await wrong.start(ROOM_A[: 3 * SAMPLE_RATE * 2])
        assert await wrong.finish() != 0  # refused: ffmpeg says "wrong stream key"

        async def refused() -> bool:
            return (await run.room("obs"))["source_refused"] == 1

        await until(refused, 5, "the refusal to be counted")
        assert run.bus is not None
        assert await run.bus.redis.xlen(audio_key("obs")) == 0
        assert await run.captions("obs") == []

        right = Encoder(rtmp.output)
        await right.start(ROOM_B + SILENCE_2S)
        assert await right.finish() == 0

        async def captioned() -> bool:
            text = finals(await run.captions("obs"))
            return "amiable himself" in text

        await until(captioned, 20, "the last sentence")
        room = await run.room("obs")
    assert jiwer.wer(TEXT_B, finals(await run.captions("obs"))) <= 0.25
    assert room["source_refused"] == 1 and room["dropped_audio_s"] == 0.0


async def test_srt_listener_with_default_settings_drops_no_audio_and_matches_a_file(
        redis_url: str, tmp_path: Path, record_property: Any) -> None:
    """The WER that must be within one point of a file's is that of what the engine
    was fed, decoded by the same Whisper model in one offline pass: the live captions'
    WER moves by about ±2 points between two runs of the same audio through the same
    engine (its decode steps follow arrival timing; measured here: file 0.059 vs SRT
    0.036 in one run, 0.059 vs 0.071 in another), which would hide what the transport
    does. Each stream's audio is cut from the beep on (`from_beep`): whole, what came
    before the clip differs per stream (0.8 s more on the file's), which moves
    Whisper's 30 s windows, and that alone moved the file's WER by 2 words in 4 of 14
    runs here. Cut so, the two decodes are the same in every run: 0.026 for the file
    (its bytes are the clip's), 0.009 for SRT (the clip through a codec) in 4 of 4, so
    Whisper's word-level jitter on slightly different audio is larger than one point
    both ways; the bound is what the transport may cost: two words over the file (the
    jitter reached 2 on 2026-12-04, see below). The
    live WERs are reported beside it and checked against the bound the pipeline test
    uses, once every utterance has its final."""
    talk = ROOM_A + ROOM_B + ROOM_A  # 46.5 s of speech
    reference = " ".join([TEXT_A, TEXT_B, TEXT_A])
    pcm = with_beep(talk) + SILENCE_2S
    wav = tmp_path / "talk.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    srt = transport("srt-listener", tmp_path)
    async with pipeline(redis_url, model="whisper-base") as run:
        await run.add("srt", srt.source, key=srt.key)
        await asyncio.sleep(1.0)  # the listener's ffmpeg binds its port
        encoder = Encoder(srt.output)
        await run.add("file", str(wav))  # the same speech, at the same time, from a file
        await encoder.start(pcm)
        assert await encoder.finish(timeout_s=120) == 0
        # The last utterance's final: 3.8-9.1 s after the talk on a 2-core host (a
        # fixed 4 s wait lost one or more utterances, WER 0.13-0.39, in 5 of 14 runs).
        talk_end_s = (len(pcm) - len(SILENCE_2S)) / 2 / SAMPLE_RATE

        async def closed() -> bool:
            for s in ("srt", "file"):
                if not any(c.is_final and c.audio_end_s >= talk_end_s - 3.0
                           for c in await run.captions(s)):
                    return False
            return True

        await until(closed, 60, "the last utterance's final")
        srt_room = await run.room("srt")
        live = {s: float(jiwer.wer(reference, finals(await run.captions(s))))
                for s in ("srt", "file")}
        assert run.bus is not None and run.engine is not None
        entries = await run.bus.redis.xrange(audio_key("srt"))
        fed = {s: run.engine.audio(s) for s in ("srt", "file")}
    offline = {s: float(jiwer.wer(reference,
                                  normalize(offline_text(from_beep(fed[s], len(pcm))))))
               for s in ("srt", "file")}
    report = {"offline_wer": offline, "live_wer": live,
              "fed_s": {s: round(len(a) / 2 / SAMPLE_RATE, 2) for s, a in fed.items()},
              **{k: srt_room[k] for k in ("stalls", "filler_s", "dropped_audio_s",
                                          "stall_threshold_s")}}
    record_property("srt_listener", json.dumps(report))
    print(json.dumps(report))
    assert srt_room["dropped_audio_s"] == 0.0
    # Ingest kept the audio contiguous: no hole invented inside the talk.
    gaps = [f for _, f in entries if f[b"k"] != b"pcm"]
    assert len(gaps) <= 1, gaps  # at most the connect itself
    # Two words over the file's offline decode (of 115): on 2026-12-04 the file decoded to
    # 1 error in every run and SRT to 1 (here) or 3 (a fresh-clone run), with both live
    # WERs 1 error: Whisper's jitter on the codec's audio reached 2 words, while a dropped
    # or doubled stretch (checked exactly above) costs a sentence.
    assert offline["srt"] - offline["file"] <= 0.02, report
    assert live["srt"] <= 0.10 and live["file"] <= 0.10, report


async def test_an_encoder_killed_for_20_s_is_shown_lost_and_captioned_again_on_every_transport(
        redis_url: str, tmp_path: Path) -> None:
    www = tmp_path / "www"
    www.mkdir()
    with serve_folder(www) as base:
        paths = {}
        for name in TRANSPORTS:
            folder = www / name
            folder.mkdir()
            paths[name] = transport(name, folder, base)
        async with pipeline(redis_url) as run:
            for name, t in paths.items():
                await run.add(name, t.source, key=t.key)
            await asyncio.sleep(1.0)  # listeners bind
            encoders = {name: Encoder(t.output) for name, t in paths.items()}
            for enc in encoders.values():
                await enc.start(ROOM_A + ROOM_A)  # longer than it will get to play
            with loop_lag() as lag:
                results = await asyncio.gather(*(
                    outage(run, name, encoders[name],
                           www / name / "live.m3u8" if name == "hls" else None)
                    for name in TRANSPORTS))
    # Where each room's audio after the return starts in what its encoder was fed: a
    # cross-correlation of seconds of audio, ~1 s of CPU on a busy core, so it is done
    # here, after the pipeline has stopped. Done inside `outage`, on the event loop the
    # pipeline runs on, it froze ingest and ASR for 3-9 s (measured beside a CPU hog)
    # while other rooms were still waiting for their first caption after the return,
    # and their `idle_before_caption_s` read 5-11 s.
    report = {name: {**r, "first_audio_from_s": round(where_in(pcm, ROOM_B), 2)}
              for name, (r, pcm) in zip(TRANSPORTS, results, strict=True)}
    print(json.dumps({"loop_lag_max_s": round(lag.max_s, 2), **report}))
    for name, r in report.items():
        assert r["lost_after_s"] <= 5.0, (name, report)
        # The transport's part of the return: from when the encoder had audio to send
        # (an HLS encoder: when it listed its first segment, a segment's length after it
        # started; the others: at once) to that audio's first chunk in Redis. 4 s: the
        # slowest retry of these transports (SRT caller: a 1 s connect timeout, then 1 s
        # of backoff) and 2 s for an encoder's process to start and be read on 2 busy cores.
        assert r["audio_after_s"] - r["available_after_s"] <= 4.0, (name, report)
        # The caption after it waits for its turn on the one decode thread all five rooms
        # share, behind the others' queued decodes (finals go first): that busy time is
        # measured, not bounded. What is bounded is the rest, the time the thread was free
        # while the room still had no caption: the room's own audio has to come (its first
        # word, then `step_s` = 1 s of speech before an interim; 2 steps if the first shows
        # no word of the talk yet) plus its publication and this test's 0.1 s poll.
        assert r["idle_before_caption_s"] <= FIRST_WORD_S + 2 * STEP_S + 1.0, (name, report)
        assert r["first_audio_from_s"] <= 0.3, (name, report)


async def outage(run: Pipeline, name: str, encoder: Encoder,
                 playlist: Path | None) -> tuple[dict[str, float], bytes]:
    """`playlist`: an HLS encoder's, whose first write after the return says when its
    audio became available. Returns the room's timings and its first 2 s of audio after
    the return."""
    async def captioning() -> bool:
        return (await run.room(name))["state"] == "captioning"

    await until(captioning, 30, f"{name}: captions before the outage")
    await asyncio.sleep(3)
    before_kill = await run.room(name)
    killed = await encoder.kill()

    async def lost() -> bool:
        return (await run.room(name))["state"] == "source lost"

    lost_at = await until(lost, 15, f"{name}: the room to say source lost")
    await asyncio.sleep(20 - (time.time() - killed))
    assert run.bus is not None and run.whisper is not None
    before = (await run.bus.redis.xrevrange(audio_key(name), count=1))[0][0]
    seen = {c.seq for c in await run.captions(name)}
    await encoder.start(ROOM_B + SILENCE_2S)
    back = encoder.started_at
    listed = (asyncio.create_task(first_write_after(playlist, back, 20))
              if playlist is not None else None)

    async def captioned_again() -> bool:
        new = [c for c in await run.captions(name) if c.seq not in seen and c.text]
        return any(set(normalize(c.text).split()) & set(TEXT_B.split()) for c in new)

    try:
        again_at = await until(captioned_again, 20, f"{name}: captions after the return")
        available = await listed if listed is not None else back
    finally:
        if listed is not None:
            listed.cancel()  # a failure above leaves no watcher behind

    async def heard() -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The audio entries written since the encoder came back: (id, fields)."""
        assert run.bus is not None
        return [(i, f) for i, f in await run.bus.redis.xrange(audio_key(name), min=before)
                if f[b"k"] == b"pcm" and i != before]

    async def enough() -> bool:  # 2 s after the return: what where_in() compares
        return sum(len(f[b"pcm"]) for _, f in await heard()) >= 2 * SAMPLE_RATE * 2

    await until(enough, 10, f"{name}: 2 s of audio after the return")
    # Stop talking once the point is made: the rooms that come back later (HLS is ~2 s
    # behind) share the one decode thread with fewer talking rooms, as in an event
    # where rooms do not all return at once.
    await encoder.kill()
    after = await heard()
    pcm = b"".join(f[b"pcm"] for _, f in after)[: 2 * SAMPLE_RATE * 2]
    # When the first audio after the return reached Redis (a chunk's wall is the
    # capture time of its end): the transport's part of captions_after_s.
    first_id, first_entry = after[0]
    first = float(first_entry[b"wall"]) - len(first_entry[b"pcm"]) / 2 / SAMPLE_RATE
    # ... and when it was written there (the entry's id is Redis's clock, in ms).
    written = int(first_id.split(b"-")[0]) / 1000
    busy = run.whisper.busy_s(first, again_at)
    at_caption = await run.room(name)
    return {"lost_after_s": round(lost_at - killed, 2),
            "available_after_s": round(available - back, 2),
            "audio_after_s": round(first - back, 2),
            "written_after_s": round(written - back, 2),
            # Real audio the ASR side threw away as late for time its filler had
            # covered, from just before the kill to the caption after the return.
            "dropped_audio_s": round(at_caption["dropped_audio_s"]
                                     - before_kill["dropped_audio_s"], 1),
            "captions_after_s": round(again_at - back, 2),
            "decode_busy_s": round(busy, 2),
            "idle_before_caption_s": round(again_at - first - busy, 2)}, pcm


def where_in(pcm: bytes, spoken: bytes) -> float:
    """Where in `spoken` the audio `pcm` starts (s), by cross-correlation: how much of the
    start of what the encoder was fed after its return never reached the stream. A
    second from 0.5 s into `pcm` is looked for, so an early start (AAC's priming adds
    ~64 ms in front) reads as a small negative number instead of a false match."""
    skip = SAMPLE_RATE // 2
    probe = np.frombuffer(pcm, dtype="<i2").astype(np.float64)[skip : skip + SAMPLE_RATE]
    ref = np.frombuffer(spoken, dtype="<i2").astype(np.float64)[: 4 * SAMPLE_RATE]
    corr = np.correlate(ref, probe, mode="valid")
    return float(np.argmax(corr) - skip) / SAMPLE_RATE
