"""The session manager's parts on their own: rut watchdog, dither noise, audio ring."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from tests.engine_doubles import IdleEngine
from tests.speech import AUDIO, decode_pcm16
from workers.engines.base import INPUT_QUEUE_MAX, RecognizeSession, SessionInput, SessionOptions
from workers.engines.vad import VoiceActivity
from workers.events import SAMPLE_RATE, AudioChunk
from workers.sessions.manager import SessionManager
from workers.sessions.pacing import DitherNoise
from workers.sessions.ring import AudioRing
from workers.sessions.watchdog import RutPolicy, RutWatchdog

pytestmark = pytest.mark.unit

FRAME = 512


def speak(w: RutWatchdog, start_s: float, seconds: float) -> float:
    """Speech frames from start_s for `seconds`; returns the end time."""
    pos = int(start_s * SAMPLE_RATE)
    end = int((start_s + seconds) * SAMPLE_RATE)
    while pos < end:
        w.speech(pos, FRAME)
        pos += FRAME
    return end / SAMPLE_RATE


def test_sustained_speech_without_text_is_a_rut() -> None:
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1))
    speak(w, 0, 5.9)
    assert not w.in_rut()
    speak(w, 5.9, 0.3)
    assert w.in_rut()
    assert w.voiced_without_text_s >= 6


def test_healthy_text_keeps_the_watchdog_quiet() -> None:
    w = RutWatchdog(RutPolicy())
    for second in range(30):
        speak(w, second, 1.0)
        w.text(int((second + 1) * SAMPLE_RATE), 14)  # ~14 characters per second of talk
        assert not w.in_rut()


def watch_through_silero(pcm: bytes) -> RutWatchdog:
    """Real audio through real Silero, its speech frames into the watchdog (as the
    session manager does), with no text at all."""
    w = RutWatchdog(RutPolicy())
    flags = VoiceActivity().feed_pcm16(pcm)
    for i, speech in enumerate(flags):
        if speech:
            w.speech(i * FRAME, FRAME)
    return w


def test_silence_never_triggers_even_without_any_text() -> None:
    rng = np.random.default_rng(3)
    room_tone = rng.normal(0, 100, 30 * SAMPLE_RATE).astype("<i2").tobytes()  # ~-50 dBFS
    filler = DitherNoise(lsb=2, seed=2).pcm(30 * SAMPLE_RATE)  # what a stalled source gets
    w = watch_through_silero(room_tone + filler)
    assert not w.in_rut()
    assert w.voiced_without_text_s == 0


def test_the_same_minute_of_speech_without_text_is_a_rut() -> None:
    """The control for the test above: the same path does see speech."""
    speech = decode_pcm16(AUDIO / "room-b.flac")
    w = watch_through_silero(speech)
    assert w.in_rut()
    assert w.voiced_without_text_s >= 6


def test_text_from_before_the_rut_does_not_hide_it_for_a_whole_window() -> None:
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6))
    for second in range(10):
        speak(w, second, 1.0)
        w.text(int((second + 1) * SAMPLE_RATE), 20)
    speak(w, 10, 6.2)  # the engine goes quiet; plenty of text is still in the window
    assert w.in_rut()


def test_a_few_characters_do_not_count_as_recovery() -> None:
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1))
    speak(w, 0, 3)
    w.text(3 * SAMPLE_RATE, 2)  # a stray "a." over 8 s of speech
    speak(w, 3, 5)
    assert w.in_rut()


def test_only_speech_the_session_has_heard_is_judged() -> None:
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1, max_lag_s=30))
    speak(w, 0, 12)  # 12 s of speech fed, no text yet
    assert w.in_rut()  # a session that does not say how far it got is judged on all of it
    assert not w.in_rut(heard=int(5.9 * SAMPLE_RATE)), "a backlog is not a rut"
    assert w.in_rut(heard=int(6.1 * SAMPLE_RATE)), "6 s heard and nothing written is"
    # Text that comes late for the speech heard still counts.
    w.text(12 * SAMPLE_RATE, 80)
    assert not w.in_rut(heard=int(11 * SAMPLE_RATE))


def test_a_slow_session_is_never_judged_on_speech_it_has_not_heard() -> None:
    """A session far behind the newest audio whose recognition keeps moving and whose
    text keeps coming is slow, not stuck, however far behind: 48 s here, at 0.4 x real
    time (the old bound judged unheard speech past 30 s behind: replaced at 58 s)."""
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1, max_lag_s=30))
    for second in range(80):
        speak(w, second, 1.0)
        heard = int(second * 0.4 * SAMPLE_RATE)
        w.text(heard, 6)  # its text, stamped with the audio it is for
        assert not w.in_rut(heard) and not w.deaf(heard), f"replaced at {second} s"


def test_a_session_that_stopped_hearing_is_stuck() -> None:
    w = RutWatchdog(RutPolicy(window_s=15, speech_s=6, chars_per_speech_s=1, max_lag_s=30))
    speak(w, 0, 5)
    assert not w.deaf(heard=4 * SAMPLE_RATE)
    speak(w, 5, 29.5)
    assert not w.deaf(heard=4 * SAMPLE_RATE), "29.5 s of speech since it last moved"
    speak(w, 34.5, 1.0)
    assert w.deaf(heard=4 * SAMPLE_RATE), "30 s of speech fed and it heard none of it"
    assert not w.deaf(heard=5 * SAMPLE_RATE), "it moved on: not deaf"
    assert not w.deaf(heard=None), "a session that does not say is judged on text only"


def test_silence_never_makes_a_session_deaf() -> None:
    w = RutWatchdog(RutPolicy(max_lag_s=30))
    w.deaf(heard=0)
    for i in range(120 * SAMPLE_RATE // FRAME):  # two minutes of silence: no speech frames
        assert not w.deaf(heard=0), i


def test_ring_replays_in_large_chunks_that_fit_a_session_queue() -> None:
    ring = AudioRing(70.0)
    step = SAMPLE_RATE // 10
    for i in range(660):
        ring.add(AudioChunk("s", i * step, b"\x01\x00" * step, float(i), (True, False, True),
                            i * step + step - 64))
    replay = ring.replay(5 * step + 7, chunk_s=1.0)
    assert len(replay) < 80
    assert replay[0].pos == 5 * step + 7
    for a, b in itertools.pairwise(replay):
        assert b.pos == a.pos + a.samples, "contiguous"
    assert sum(c.samples for c in replay) == 660 * step - 5 * step - 7
    assert replay[-1].speech_end == 660 * step - 64
    # Every flag is kept (the first chunk was cut: its flags are unknown, none).
    assert sum(len(c.speech or ()) for c in replay) == 3 * (660 - 6)


def test_dither_is_faint_and_never_digital_silence() -> None:
    noise = DitherNoise(lsb=2, seed=1)
    for n in (1, 7, 1600):
        samples = np.frombuffer(noise.pcm(n), dtype="<i2")
        assert samples.size == n
        assert samples.any(), "exact zeros make realtime models hallucinate"
        assert np.abs(samples).max() <= 2


def test_ring_returns_recent_audio_cut_at_the_requested_position() -> None:
    ring = AudioRing(keep_s=1.0)
    chunk = SAMPLE_RATE // 10
    for i in range(30):  # 3 s of 100 ms chunks; the ring keeps ~1 s
        ring.add(AudioChunk("s", i * chunk, bytes([i]) * chunk * 2, float(i)))
    assert ring.start_pos is not None and ring.start_pos >= 19 * chunk
    got = ring.since(25 * chunk + 100)
    assert got[0].pos == 25 * chunk + 100
    assert got[0].samples == chunk - 100
    assert [c.pos for c in got[1:]] == [i * chunk for i in range(26, 30)]
    assert sum(c.samples for c in got) == 5 * chunk - 100


class _UnreadSession(RecognizeSession):
    """TEST DOUBLE: a session that never takes its input (its engine is saturated), so
    its bounded input queue fills."""

    async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
        await asyncio.Event().wait()


class _SaturatedEngine(IdleEngine):
    def open_session(self, options: SessionOptions) -> RecognizeSession:
        session = _UnreadSession(options)
        session.start()
        return session


async def test_a_backlog_past_the_input_queue_drops_the_oldest_and_counts_it() -> None:
    """The default keeps every word up to the session's input queue (~60 s); past it the
    oldest audio goes, and the manager counts and says so (never silently)."""
    manager = SessionManager(_SaturatedEngine(), SessionOptions("s", "en"))
    manager.start()
    step = SAMPLE_RATE // 10
    tone = (np.random.default_rng(3).normal(0, 100, step)).astype("<i2").tobytes()
    try:
        for i in range(700):  # 70 s, as fast as the manager takes it
            await manager.push(AudioChunk("s", i * step, tone, float(i)))
        for _ in range(200):
            if manager.counters["skipped_s_queue_full"] >= 9.9:
                break
            await asyncio.sleep(0.05)
    finally:
        await manager.aclose()
    assert manager.counters["skipped_s_queue_full"] == pytest.approx(
        (700 - INPUT_QUEUE_MAX) / 10, abs=0.2)
