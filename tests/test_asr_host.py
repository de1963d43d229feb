"""The ASR host on real parts: the embedded Whisper engine (tiny.en) and a real redis-server.

The tests write audio into `audio:{stream}` themselves, at real-time pace, the
way the ingest host would, and read what the host publishes back from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import replace

import jiwer
import pytest

from tests.speech import AUDIO, decode_pcm16, normalize
from tests.waiting import eventually
from workers.asr import AsrHost, AsrHostOptions
from workers.bus import RedisBus
from workers.engines.base import (
    END,
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
    WrappedEngine,
)
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.events import (
    SAMPLE_RATE,
    SOURCE_ENDED,
    AudioChunk,
    AudioGap,
    CaptionSegment,
    StreamOptions,
    TranscriptDelta,
    Word,
)

pytestmark = pytest.mark.integration

CHUNK_BYTES = SAMPLE_RATE // 10 * 2  # 100 ms of PCM16, what ingest writes
# Beyond room-b's own trailing second: enough silence for the engine's pause
# detection to close the last utterance.
TRAILING_SILENCE = bytes(SAMPLE_RATE * 2)
# Generous on a 2-core machine: two streams share one decode thread.
CAPTIONS_TIMEOUT_S = 30.0
CRASH_AFTER_CHUNKS = 10
SCRIPTED_PARTIAL = TranscriptDelta(
    committed=(Word(" Scripted", 0.2, 0.6),), tentative=(Word(" partial", 0.6, 0.9),)
)


# --- helpers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def room_b() -> bytes:
    return decode_pcm16(AUDIO / "room-b.flac")


async def feed(bus: RedisBus, stream: str, pcm: bytes, *, pos: int = 0) -> int:
    """Write `pcm` to `audio:{stream}` in 100 ms chunks at real-time pace; returns the end pos."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i, off in enumerate(range(0, len(pcm), CHUNK_BYTES)):
        # A chunk is written when its last sample has been "captured".
        delay = started + (i + 1) * 0.1 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        piece = pcm[off : off + CHUNK_BYTES]
        await bus.add_audio(AudioChunk(stream=stream, pos=pos, pcm=piece, wall=time.time()))
        pos += len(piece) // 2
    return pos


def stream_options(stream_id: str) -> StreamOptions:
    return StreamOptions(stream_id=stream_id, name=stream_id, source="push", language="en")


def host_options(redis_url: str, restart_backoff_s: float = 0.2) -> AsrHostOptions:
    return AsrHostOptions(
        actor_id="asr-t", redis_url=redis_url, max_streams=2,
        restart_backoff_s=restart_backoff_s, read_block_ms=100,
    )


def real_engine() -> EmbeddedWhisperEngine:
    return EmbeddedWhisperEngine(EmbeddedEngineOptions(model="tiny.en", cpu_threads=2))


def finals_text(captions: list[CaptionSegment]) -> str:
    return normalize(" ".join(c.text for c in captions if c.is_final))


# --- fault injection ------------------------------------------------------------------------


class _CrashAfterChunks(RecognizeSession):
    """Takes audio like a real session; after `after` chunks it emits one scripted
    partial (so a caption is open on screen) and fails."""

    def __init__(self, options: SessionOptions, after: int) -> None:
        super().__init__(options)
        self.after = after
        self.received = 0

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        while True:
            item = await inputs.get()
            if item is END:
                return
            if isinstance(item, AudioChunk):
                self.received += 1
                if self.received >= self.after:
                    await self._emit(SCRIPTED_PARTIAL)
                    raise RuntimeError("injected session fault")


class CrashingSessionEngine(WrappedEngine):
    """Fault injection for tests: the real engine, except that the first
    `crash_sessions` sessions opened for `crash_stream` fail after `after_chunks`
    chunks of audio. Counts `open_session` calls per stream."""

    def __init__(
        self, inner: SpeechEngine, crash_stream: str, *, after_chunks: int, crash_sessions: int = 1
    ) -> None:
        super().__init__(inner)
        self.crash_stream = crash_stream
        self.after_chunks = after_chunks
        self.crash_sessions = crash_sessions
        self.opened: Counter[str] = Counter()

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        self.opened[options.stream_id] += 1
        if (
            options.stream_id == self.crash_stream
            and self.opened[options.stream_id] <= self.crash_sessions
        ):
            session = _CrashAfterChunks(options, self.after_chunks)
            session.start()
            return session
        return self.inner.open_session(options)


# --- tests --------------------------------------------------------------------------------


async def test_one_stream_whose_session_crashes_does_not_stop_another(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    engine = CrashingSessionEngine(
        real_engine(), "crashy", after_chunks=CRASH_AFTER_CHUNKS, crash_sessions=1
    )
    host = AsrHost(host_options(redis_url), engine)
    audio = room_b + TRAILING_SILENCE
    feeding: asyncio.Future[tuple[int, int]] | None = None
    try:
        await asyncio.wait_for(host.start(), 60)
        await host.add_stream(stream_options("healthy"))
        await host.add_stream(stream_options("crashy"))
        feeding = feeding_both = asyncio.gather(
            feed(bus, "healthy", audio), feed(bus, "crashy", audio)
        )

        async def crashed() -> bool:
            return "rollovers_engine_error" in await bus.get_status("crashy")

        # The session manager replaces the failed session and reports it in the status.
        await eventually(crashed, 10, "the crashing stream's status to count a replacement")
        status = await bus.get_status("crashy")
        assert float(status["rollovers_engine_error"]) >= 1

        await asyncio.wait_for(feeding_both, len(audio) / 2 / SAMPLE_RATE + 10)

        async def healthy_done() -> bool:
            # room-b's last word ends at ~9.7 s. Any final that reaches it, not the last
            # caption: tentative words on trailing audio may follow it, withdrawn.
            captions = await bus.captions_after("healthy", "en", 0)
            return any(c.is_final and c.text and c.audio_end_s > 9.0 for c in captions)

        await eventually(healthy_done, CAPTIONS_TIMEOUT_S, "the healthy stream's last final")
        healthy = await bus.captions_after("healthy", "en", 0)
        reference = normalize((AUDIO / "room-b.txt").read_text())
        wer = jiwer.wer(reference, finals_text(healthy))
        assert wer <= 0.2, f"WER {wer:.3f}"

        health = await host.health()
        # Absorbed by the session manager: the stream runner itself never failed.
        assert health["streams"]["crashy"]["failures"] == 0
        assert health["streams"]["healthy"]["failures"] == 0
        assert engine.opened["crashy"] >= 2, "no new session after the crash"
        assert engine.opened["healthy"] == 1
        crashy = await bus.captions_after("crashy", "en", 0)
        # What the failed session had on screen was closed before anything new came.
        scripted = [c for c in crashy if c.segment_id == crashy[0].segment_id]
        assert [c.text for c in scripted] == ["Scripted partial", "Scripted"]
        assert [c.is_final for c in scripted] == [False, True]
        assert crashy[: len(scripted)] == scripted
        # The replacement session is a real one: the stream captions again.
        assert any(c.text for c in crashy[len(scripted) :])
        assert (await bus.get_status("crashy"))["asr_state"] == "captioning"
        assert "rollovers_engine_error" not in await bus.get_status("healthy")
    finally:
        if feeding is not None and not feeding.done():
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeding
        await asyncio.wait_for(host.stop(), 30)


async def test_seq_and_segment_ids_continue_after_host_restart(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    # room-b's first utterance ends at ~5.9 s and the second starts at ~7.0 s.
    split = 7 * SAMPLE_RATE * 2
    first, second = room_b[:split], room_b[split:] + TRAILING_SILENCE

    async def has_final() -> bool:
        return any(c.is_final for c in await bus.captions_after("talk", "en", 0))

    host = AsrHost(host_options(redis_url), real_engine())
    try:
        await asyncio.wait_for(host.start(), 60)
        await host.add_stream(stream_options("talk"))
        pos = await asyncio.wait_for(feed(bus, "talk", first), 20)
        await eventually(has_final, CAPTIONS_TIMEOUT_S, "a final from the first host")
    finally:
        await asyncio.wait_for(host.stop(), 30)
    before = await bus.captions_after("talk", "en", 0)
    last_seq = before[-1].seq
    last_segment = max(c.segment_id for c in before)

    host = AsrHost(host_options(redis_url), real_engine())
    try:
        await asyncio.wait_for(host.start(), 60)
        await host.add_stream(stream_options("talk"))
        await asyncio.wait_for(feed(bus, "talk", second, pos=pos), 20)

        async def new_final() -> bool:
            return any(c.is_final for c in await bus.captions_after("talk", "en", last_seq))

        await eventually(new_final, CAPTIONS_TIMEOUT_S, "a final from the second host")
    finally:
        await asyncio.wait_for(host.stop(), 30)
    after = await bus.captions_after("talk", "en", last_seq)
    assert [c.seq for c in after] == list(range(last_seq + 1, last_seq + 1 + len(after)))
    assert all(c.segment_id > last_segment for c in after)


async def test_an_actor_cut_off_cannot_write_once_another_took_its_stream(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    """A node lost to Ray leaves its actor running for a while (~15 s on the failover
    bench) while the stream moves to another actor. Both read the stream's audio; only
    the new owner may publish: the old one is refused at its next caption and lets the
    stream go, so seq stays contiguous, no final is doubled and none is left open."""
    split = 7 * SAMPLE_RATE * 2
    first, second = room_b[:split], room_b[split:] + TRAILING_SILENCE

    async def has_final() -> bool:
        return any(c.is_final for c in await bus.captions_after("talk", "en", 0))

    old = AsrHost(replace(host_options(redis_url), actor_id="asr-old"), real_engine())
    new = AsrHost(replace(host_options(redis_url), actor_id="asr-new"), real_engine())
    try:
        await asyncio.wait_for(old.start(), 60)
        await old.add_stream(stream_options("talk"))
        pos = await asyncio.wait_for(feed(bus, "talk", first), 20)
        await eventually(has_final, CAPTIONS_TIMEOUT_S, "a final from the first owner")
        taken_at = (await bus.captions_after("talk", "en", 0))[-1].seq
        await asyncio.wait_for(new.start(), 60)
        await new.add_stream(stream_options("talk"))  # the old owner is never told
        await asyncio.wait_for(feed(bus, "talk", second, pos=pos), 20)

        async def settled() -> bool:
            caps = await bus.captions_after("talk", "en", taken_at)
            return bool(caps) and caps[-1].is_final and "talk" not in old.streams()

        await eventually(settled, CAPTIONS_TIMEOUT_S, "the new owner's last final")
        owners = (old.streams(), new.streams())
    finally:
        await asyncio.wait_for(old.stop(), 30)
        await asyncio.wait_for(new.stop(), 30)
    caps = await bus.captions_after("talk", "en", 0)
    assert [c.seq for c in caps] == list(range(1, len(caps) + 1)), "seq has a hole"
    finals = [c.segment_id for c in caps if c.is_final and c.text]
    assert len(finals) == len(set(finals)), "a caption was made final twice"
    assert {c.segment_id for c in caps if c.text} <= {c.segment_id for c in caps
                                                     if c.is_final}, "a caption left open"
    assert (await bus.get_status("talk"))["asr_actor"] == "asr-new"
    assert owners == ([], ["talk"]), owners


async def test_a_stop_mid_sentence_makes_the_open_caption_final(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    """What SIGTERM does to an ASR actor (`babelcast run` stops each actor): the session
    finishes what it heard and the sentence being spoken is published final, with its
    text and audio times, and the cursor moves past it. Before, the stop left it open,
    and a restart brought it back as an empty final (issue 36)."""
    host = AsrHost(host_options(redis_url), real_engine())

    async def partial_open() -> bool:
        caps = await bus.captions_after("talk", "en", 0)
        return bool(caps) and not caps[-1].is_final and bool(caps[-1].text)

    try:
        await asyncio.wait_for(host.start(), 60)
        await host.add_stream(stream_options("talk"))
        # room-b's first utterance runs to ~5.9 s: stop while it is being spoken.
        feeding = asyncio.create_task(feed(bus, "talk", room_b[: 5 * SAMPLE_RATE * 2]))
        await eventually(partial_open, CAPTIONS_TIMEOUT_S, "a partial on screen")
        await feeding
    finally:
        await asyncio.wait_for(host.stop(), 30)
    caps = await bus.captions_after("talk", "en", 0)
    last = caps[-1]
    assert last.is_final and last.text, "the open sentence was not made final"
    assert 0 <= last.audio_start_s < last.audio_end_s <= 5.0
    # Every segment ended final or withdrawn, and no final is empty.
    ends = {c.segment_id: c for c in caps}
    assert all(c.is_final or c.withdrawn for c in ends.values())
    assert all(c.text for c in caps if c.is_final)
    cursor = await bus.load_cursor("talk")
    assert cursor is not None and cursor[1] == pytest.approx(last.audio_end_s)


async def test_a_stream_whose_source_ended_finishes_and_frees_its_session(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    """The ingest marks the end of a source (a file, an HLS playlist that ended) in the
    audio Stream: the ASR side makes the last words final, frees the session and feeds no
    filler from then on (issue 36: an ended HLS room kept its session and its FILLER
    count kept rising, while /v1/streams said captioning)."""
    host = AsrHost(host_options(redis_url), real_engine())
    try:
        await asyncio.wait_for(host.start(), 60)
        await host.add_stream(stream_options("talk"))
        pos = await asyncio.wait_for(feed(bus, "talk", room_b[: 7 * SAMPLE_RATE * 2]), 20)
        await bus.add_gap(AudioGap("talk", pos, 0.0, SOURCE_ENDED, time.time()))

        async def ended() -> bool:
            return (await bus.get_status("talk")).get("asr_state") == "ended"

        await eventually(ended, CAPTIONS_TIMEOUT_S, "the stream's session to finish")
        runner = host._runners["talk"]  # test tool: the runner's session is freed
        assert runner.session is None and runner.task is not None and runner.task.done()
        filled = (await bus.get_status("talk")).get("gap_fill_s")
        await asyncio.sleep(3.0)  # past the stall threshold: no filler is fed
        assert (await bus.get_status("talk")).get("gap_fill_s") == filled
    finally:
        await asyncio.wait_for(host.stop(), 30)
    caps = await bus.captions_after("talk", "en", 0)
    assert caps and caps[-1].is_final and caps[-1].text  # its last words are final
    assert (await bus.get_status("talk"))["caption_lag_s"] == "0.0"


async def test_a_new_owner_reads_again_from_the_start_when_no_final_was_made(
    redis_url: str, bus: RedisBus, room_b: bytes
) -> None:
    """An owner lost before its stream's first final leaves no cursor (bench.failover's
    baseline: half the streams started their new owner at the live edge and lost their
    words). The new owner reads the stream's audio again from its start (within
    max_catchup_s), so the first words are captioned, by it, once."""
    split = int(2.0 * SAMPLE_RATE) * 2  # the first words, before any pause
    first, second = room_b[:split], room_b[split:] + TRAILING_SILENCE
    old = AsrHost(replace(host_options(redis_url), actor_id="asr-old"), real_engine())
    new = AsrHost(replace(host_options(redis_url), actor_id="asr-new"), real_engine())
    try:
        # Both up before any audio: a pause between the two halves while the new host
        # loaded its model let the old session take the pause for the end of the
        # sentence and make it final (a cursor at the live edge: nothing to read again).
        await asyncio.wait_for(asyncio.gather(old.start(), new.start()), 60)
        await old.add_stream(stream_options("talk"))
        pos = await asyncio.wait_for(feed(bus, "talk", first), 20)
        assert not [c for c in await bus.captions_after("talk", "en", 0) if c.is_final]
        assert await bus.load_cursor("talk") is None  # nothing final: no cursor
        await new.add_stream(stream_options("talk"))  # the old owner is never told
        await asyncio.wait_for(feed(bus, "talk", second, pos=pos), 30)

        async def settled() -> bool:
            caps = await bus.captions_after("talk", "en", 0)
            return bool(caps) and caps[-1].is_final and "talk" not in old.streams()

        await eventually(settled, CAPTIONS_TIMEOUT_S, "the new owner's last final")
    finally:
        await asyncio.wait_for(old.stop(finish_s=0), 30)
        await asyncio.wait_for(new.stop(), 30)
    caps = await bus.captions_after("talk", "en", 0)
    finals = [c for c in caps if c.is_final and c.text]
    # The sentence under way at the handover is decoded whole by the new owner, not
    # closed as the old one last showed it (0.05-1.97 s, then 2.0-5.74 s, without this).
    assert finals and finals[0].audio_start_s < 1.0 < split / 2 / SAMPLE_RATE \
        < finals[0].audio_end_s, [(f.audio_start_s, f.audio_end_s) for f in finals]
    assert [c.seq for c in caps] == list(range(1, len(caps) + 1)), "seq has a hole"
    ids = [c.segment_id for c in finals]
    assert len(ids) == len(set(ids)), "a caption was made final twice"
    assert (await bus.get_status("talk")).get("resumes") == "1"


class _CountingSession(RecognizeSession):
    """Takes audio and says nothing; remembers each chunk's position (the host's read
    pacing is under test here, not recognition)."""

    def __init__(self, options: SessionOptions, got: list[int]) -> None:
        super().__init__(options)
        self.got = got

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        while (item := await inputs.get()) is not END:
            if isinstance(item, AudioChunk):
                self.got.append(item.pos)


class _CountingEngine(WrappedEngine):
    """The real engine's capabilities and start; sessions that only count (a stand-in for
    recognition, which this test does not look at)."""

    def __init__(self, inner: SpeechEngine) -> None:
        super().__init__(inner)
        self.got: dict[str, list[int]] = {}

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = _CountingSession(options, self.got.setdefault(options.stream_id, []))
        session.start()
        return session


async def _xreads(bus: RedisBus) -> int:
    stats = await bus.redis.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def test_the_reader_gathers_many_streams_chunks_into_one_read(
    redis_url: str, bus: RedisBus
) -> None:
    """Encoders send each stream's chunks at their own instants. Reading again as soon as
    a read returns, the host made one XREAD per chunk, ~45 % of its own CPU at 25
    streams (bench.actor_cpu). With `read_every_ms` it reads at most
    that often, and every chunk still reaches its session, in order. Both legs run here:
    the unpaced one (0) must exceed the paced leg's bound, or the count proves nothing."""
    streams, seconds, every_ms = 12, 3.0, 20
    chunk_s = CHUNK_BYTES / 2 / SAMPLE_RATE
    pcm = bytes(CHUNK_BYTES)

    async def leg(read_every_ms: int) -> tuple[int, float, dict[str, list[int]]]:
        engine = _CountingEngine(real_engine())
        host = AsrHost(replace(host_options(redis_url), max_streams=streams,
                               read_every_ms=read_every_ms), engine)
        ids = [f"r{read_every_ms}-{i}" for i in range(streams)]
        await asyncio.wait_for(host.start(), 60)
        try:
            for sid in ids:
                await host.add_stream(stream_options(sid))
            loop = asyncio.get_running_loop()
            before, t0 = await _xreads(bus), loop.time()
            for k in range(round(seconds / chunk_s)):
                for i, sid in enumerate(ids):  # stream i at i/N of each chunk's cycle
                    delay = t0 + (k + i / streams) * chunk_s - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await bus.add_audio(AudioChunk(sid, k * CHUNK_BYTES // 2, pcm, time.time()))
            fed = round(seconds / chunk_s)

            async def all_handed() -> bool:
                return all(len(engine.got.get(sid, [])) >= fed for sid in ids)

            await eventually(all_handed, 10, "every chunk handed to its session")
            reads, elapsed = await _xreads(bus) - before, loop.time() - t0
        finally:
            await asyncio.wait_for(host.stop(finish_s=0), 30)
        return reads, elapsed, {sid: engine.got[sid] for sid in ids}

    reads, elapsed, got = await leg(every_ms)
    bound = elapsed / (every_ms / 1000) + 2
    fed = round(seconds / chunk_s)
    expected = [k * CHUNK_BYTES // 2 for k in range(fed)]
    assert all(positions == expected for positions in got.values()), "a chunk lost or reordered"
    assert reads <= bound, f"{reads} reads in {elapsed:.1f} s: more than one per {every_ms} ms"
    unpaced, _elapsed, got = await leg(0)
    assert all(positions == expected for positions in got.values())
    assert unpaced > bound, (
        f"unpaced: {unpaced} reads for {streams * fed} chunks; the count cannot tell")
