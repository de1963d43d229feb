"""What the worker floor reports to its metrics sink, on a real redis-server.

The ASR host runs real speech (room-b, through the session manager's voice activity)
into a scripted engine: one stream's sessions never say a word (a stuck model), one
stream is silent, one says a word after a second. The ingest host runs a scripted
source that fails once. A recording sink stands in for the runtime's Ray sink; the
last test checks that every key they report reaches a catalog metric.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from redis.asyncio import Redis

from orchestrator import ray_metrics
from orchestrator.metric_catalog import spec
from orchestrator.redis_server import LocalRedisServer
from tests.engine_doubles import IdleEngine
from tests.speech import AUDIO, decode_pcm16
from tests.test_asr_host import feed, host_options, stream_options
from tests.waiting import eventually
from workers.asr import ZERO_AT_START, AsrHost
from workers.bus import RedisBus
from workers.engines.base import (
    END,
    RecognizeSession,
    SessionInput,
    SessionOptions,
)
from workers.events import SAMPLE_RATE, AudioChunk, StreamOptions, TranscriptDelta, Word
from workers.ingest import INGEST_GAP_REASONS, IngestHost, IngestHostOptions
from workers.sessions.manager import ROLLOVER_REASONS
from workers.sources.base import AudioSource, SourceError
from workers.telemetry import RecordingSink

pytestmark = pytest.mark.integration

CHUNK = bytes(SAMPLE_RATE // 10 * 2)  # 100 ms of silence
STREAMS = ("stuck", "quiet", "talk")


class _MuteSession(RecognizeSession):
    """Takes audio and never says a word: a model stuck in a blank rut."""

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        while await inputs.get() is not END:
            pass


class _OneWordSession(RecognizeSession):
    """Says one final word about the audio's first second, then nothing."""

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        fed = 0
        said = False
        while (item := await inputs.get()) is not END:
            if isinstance(item, AudioChunk):
                fed += item.samples
                if not said and fed >= SAMPLE_RATE:
                    said = True
                    end_s = (item.pos + item.samples) / SAMPLE_RATE
                    await self._emit(TranscriptDelta(
                        committed=(Word(" Hello.", end_s - 0.4, end_s - 0.1),),
                        end_of_utterance=True))


class ScriptedEngine(IdleEngine):
    """Stream `talk` gets a session that says one word; every other stream a mute one.
    Reports busy seconds and steps like the embedded engine does."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.calls = 0

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = (_OneWordSession(options) if options.stream_id == "talk"
                   else _MuteSession(options))
        session.start()
        return session

    def stats(self) -> dict[str, float]:
        self.calls += 1
        self.busy_s += 0.25
        return {"decode_busy_s": self.busy_s, "decode_calls": float(self.calls)}


@dataclass
class AsrRun:
    sink: RecordingSink
    seconds: float
    """Audio fed to each stream."""
    status: dict[str, dict[str, str]]


async def _run_asr(redis_url: str) -> AsrRun:
    """room-b's speech into `stuck`, silence into `quiet` and `talk`, at real-time pace."""
    redis = Redis.from_url(redis_url)
    await redis.flushdb()
    bus = RedisBus(redis)
    sink = RecordingSink()
    host = AsrHost(replace(host_options(redis_url), max_streams=3), ScriptedEngine(), sink)
    speech = decode_pcm16(AUDIO / "room-b.flac")
    seconds = len(speech) / 2 / SAMPLE_RATE
    try:
        await host.start()
        for sid in STREAMS:
            await host.add_stream(stream_options(sid))
        await asyncio.gather(feed(bus, "stuck", speech),
                             feed(bus, "quiet", bytes(len(speech))),
                             feed(bus, "talk", bytes(len(speech))))

        async def exported() -> bool:  # the reporter runs every second
            return all(sink.counters.get((sid, "asr_audio_s"), 0.0) >= seconds - 0.05
                       for sid in STREAMS)
        await eventually(exported, 5, "the last audio to be exported")
        return AsrRun(sink, seconds, {sid: await bus.get_status(sid) for sid in STREAMS})
    finally:
        await asyncio.wait_for(host.stop(), 30)
        await redis.aclose()


@pytest.fixture(scope="module")
def asr_run(redis_server: LocalRedisServer) -> AsrRun:
    return asyncio.run(_run_asr(redis_server.url))


def test_speech_without_captions_keeps_growing_across_rut_rollovers(asr_run: AsrRun) -> None:
    sink = asr_run.sink
    # room-b holds ~8.5 s of speech; the rut watchdog rolls the mute session over after
    # 6 s of it, and its own count restarts there: the room's count does not.
    assert sink.counters.get(("stuck", "rollovers_rut"), 0) >= 1
    assert sink.gauges[("stuck", "speech_without_caption_s")] >= 7.0
    assert sink.gauges[("stuck", "voiced_without_text_s")] < 6.0
    assert float(asr_run.status["stuck"]["speech_without_caption_s"]) >= 7.0
    # A silent room with no captions is not a stuck one.
    assert sink.gauges[("quiet", "speech_without_caption_s")] == 0.0
    assert sink.counters[("quiet", "rollovers_rut")] == 0.0
    assert not [c for c in sink.captions if c[0] in ("stuck", "quiet")]


def test_every_stream_counter_series_exists_at_zero_from_the_start(asr_run: AsrRun) -> None:
    # A series that first appears at its first event reads "No data" on a dashboard and
    # a rate() alert misses that first increment.
    sink = asr_run.sink
    keys = [*ZERO_AT_START, *(f"rollovers_{r}" for r in ROLLOVER_REASONS)]
    for sid in STREAMS:
        assert all((sid, key) in sink.counters for key in keys), sid
    # The silent room had none of these events: its series are there, at 0.
    assert all(sink.counters[("quiet", key)] == 0.0 for key in keys)


def test_captions_are_counted_with_their_speech_to_screen_latency(asr_run: AsrRun) -> None:
    sink = asr_run.sink
    talk = [c for c in sink.captions if c[0] == "talk"]
    assert talk, "the scripted word was not published"
    latencies = [lat for _, _, lat in talk if lat is not None]
    # The word ended 0.1 s before the audio that carried it: a few tenths on screen.
    assert latencies and all(0.0 <= lat < 3.0 for lat in latencies)
    assert any(final for _, final, _ in talk)
    assert sink.gauges[("talk", "last_caption_at")] > 0
    assert sink.gauges[("talk", "speech_without_caption_s")] == 0.0


def test_audio_activity_and_engine_load_are_reported(asr_run: AsrRun) -> None:
    sink, seconds = asr_run.sink, asr_run.seconds
    for sid in STREAMS:
        assert sink.gauges[(sid, "active")] == 1.0
        assert sink.counters[(sid, "asr_audio_s")] == pytest.approx(seconds, abs=0.05)
    # The deltas the host exports add up to the engine's cumulative figures (the
    # scripted engine is busy 0.25 s per step).
    steps = sink.actor_counters[("asr-t", "engine_steps")]
    assert steps >= 5
    assert sink.actor_counters[("asr-t", "engine_busy_s")] == pytest.approx(0.25 * steps)


class _FlakySource(AudioSource):
    """First opening: 0.5 s of audio, then a failure; second: 1 s, then the end."""

    url = "scripted://flaky"
    opened = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        type(self).opened += 1
        for _ in range(5 if type(self).opened == 1 else 10):
            await asyncio.sleep(0.01)
            yield CHUNK
        if type(self).opened == 1:
            raise SourceError("scripted failure: check nothing, it is a test")


async def test_ingest_reports_reconnects_gaps_and_audio(redis_url: str, bus: RedisBus) -> None:
    sink = RecordingSink()
    _FlakySource.opened = 0

    def factory(opts: StreamOptions, executor: Any) -> AudioSource:
        return _FlakySource()

    host = IngestHost(IngestHostOptions(actor_id="ingest-t", redis_url=redis_url,
                                        backoff_initial_s=0.05), factory, sink)
    await host.start()
    try:
        await host.add_stream(StreamOptions(stream_id="flaky", name="flaky", source="x",
                                            language="en"))

        async def ended() -> bool:
            return (await bus.get_status("flaky")).get("source_state") == "ended"
        await eventually(ended, 10, "the scripted source to end")
    finally:
        await host.stop()
    assert sink.counters[("flaky", "source_reconnects")] == 1
    assert sink.counters[("flaky", "source_gaps_source-error")] == 1
    # Every other gap reason of ingest exists too, at 0, from the start.
    assert all(sink.counters[("flaky", f"source_gaps_{r}")] == 0.0
               for r in INGEST_GAP_REASONS if r != "source-error")
    assert sink.counters[("flaky", "source_audio_s")] == pytest.approx(1.5)
    # Never refused: its series exists anyway, at 0 (a dashboard panel and an alert read it).
    assert sink.counters[("flaky", "source_refused")] == 0.0


def test_every_reported_key_reaches_a_catalog_metric(asr_run: AsrRun) -> None:
    sink = asr_run.sink
    keys = {k for _, k in sink.counters} | {k for _, k in sink.gauges}
    keys |= {"source_reconnects", "source_audio_s", "source_gaps_late"}  # ingest's (above)
    unmapped = []
    for key in sorted(keys):
        name = (ray_metrics.STREAM_COUNTERS.get(key) or ray_metrics.STREAM_GAUGES.get(key)
                or next((n for p, n in ray_metrics.STREAM_COUNTER_PREFIXES.items()
                         if key.startswith(p)), None))
        if name is None:
            if key not in ray_metrics.STATUS_ONLY:
                unmapped.append(key)
            continue
        assert spec(name).source == "ray"
    assert not unmapped, f"worker keys that reach no metric (map or list them): {unmapped}"
    for key in {k for _, k in sink.actor_counters}:
        assert spec(ray_metrics.ACTOR_COUNTERS[key]).source == "ray"

