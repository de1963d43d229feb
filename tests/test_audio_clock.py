"""The audio clock: positions follow samples, and wall time across holes."""

from __future__ import annotations

import pytest

from workers.events import SAMPLE_RATE
from workers.ingest import AudioClock

pytestmark = pytest.mark.unit

CHUNK_S = 0.125  # exact in binary floating point, so wall arithmetic is exact
CHUNK = b"\x01\x00" * int(CHUNK_S * SAMPLE_RATE)  # 2000 samples
START = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_first_chunk_starts_at_the_given_position_without_gap() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 48_000, clock=clock)
    gap, chunk = audio.stamp(CHUNK)
    assert gap is None
    assert (chunk.stream, chunk.pos, chunk.pcm, chunk.wall) == ("hall-a", 48_000, CHUNK, START)
    assert audio.pos == 48_000 + 2000


def test_contiguous_chunks_at_real_time_pace_have_no_gap() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    for i in range(40):
        gap, chunk = audio.stamp(CHUNK)
        assert gap is None
        assert chunk.pos == i * 2000
        assert chunk.wall == clock.now
        clock.now += CHUNK_S
    assert audio.pos == 40 * 2000


def test_small_jitter_is_not_a_gap() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    clock.now += CHUNK_S + 0.2  # late, but within the gap threshold
    gap, chunk = audio.stamp(CHUNK)
    assert gap is None
    assert chunk.pos == 2000


def test_a_pause_the_transport_makes_again_and_again_becomes_a_burst_not_a_gap() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    gaps = []
    for i in range(40):
        # HLS-like: 1.2 s of nothing every 10 chunks, then the audio comes all at once.
        clock.now += 1.2 if i % 10 == 9 else 0.0
        gap, _ = audio.stamp(CHUNK)
        gaps.append(gap)
    # The first such pause is taken for a hole (it is longer than the 0.75 s floor);
    # from then on it is the way this transport delivers.
    assert [i for i, g in enumerate(gaps) if g is not None] == [9]


def test_chunks_arriving_in_a_burst_are_not_a_gap() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    for i in range(5):  # a buffered source delivers several chunks at once
        gap, chunk = audio.stamp(CHUNK)
        assert gap is None
        assert chunk.pos == i * 2000


def test_pause_yields_a_gap_and_the_audio_clock_follows_wall_time() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    clock.now += CHUNK_S
    audio.stamp(CHUNK)
    before = audio.pos
    clock.now += 3.0
    gap, chunk = audio.stamp(CHUNK)
    assert gap is not None
    lost = 3.0 - CHUNK_S
    assert gap.duration_s == pytest.approx(lost)
    assert gap.pos == before + int(lost * SAMPLE_RATE) == before + 46_000
    assert (gap.stream, gap.reason, gap.wall) == ("hall-a", "late", clock.now)
    assert chunk.pos == gap.pos
    assert audio.pos == gap.pos + 2000


def test_audio_time_tracks_wall_time_across_several_pauses() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    chunk_s = 0.1  # not exact in binary: positions may round by a sample
    pcm = b"\x00\x00" * 1600
    gaps = 0
    for i in range(60):
        # 4 s: an outage, longer than any delivery gap the clock would learn (2.75 s).
        clock.now += 4.0 if i % 15 == 14 else chunk_s
        gap, chunk = audio.stamp(pcm)
        gaps += gap is not None
        # The chunk's end, in audio time, sits where its wall time says: the first
        # chunk ended at START + chunk_s, which is audio time chunk_s.
        assert chunk.end_s == pytest.approx(clock.now - START, abs=0.001)
    assert gaps == 4


def test_pending_reason_forces_a_gap_record_even_for_a_short_pause() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    audio.pending_reason = "source-error"
    clock.now += CHUNK_S  # a reconnect so fast that no audio time was lost
    gap, chunk = audio.stamp(CHUNK)
    assert gap is not None
    assert gap.reason == "source-error"
    assert gap.duration_s == pytest.approx(0.0)
    assert gap.pos == chunk.pos == 2000


def test_pending_reason_is_used_once() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    audio.pending_reason = "source-crash"
    clock.now += CHUNK_S
    gap, _ = audio.stamp(CHUNK)
    assert gap is not None
    assert audio.pending_reason is None
    clock.now += CHUNK_S
    gap, _ = audio.stamp(CHUNK)
    assert gap is None


def test_pending_reason_names_a_long_pause_too() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    audio.pending_reason = "source-error"
    clock.now += 5.0
    gap, chunk = audio.stamp(CHUNK)
    assert gap is not None
    assert gap.reason == "source-error"
    assert gap.duration_s == pytest.approx(5.0 - CHUNK_S)
    assert chunk.pos == 2000 + int((5.0 - CHUNK_S) * SAMPLE_RATE)


def test_pending_reason_never_moves_the_clock_backwards() -> None:
    clock = FakeClock()
    audio = AudioClock("hall-a", 0, clock=clock)
    audio.stamp(CHUNK)
    audio.pending_reason = "source-error"
    gap, chunk = audio.stamp(CHUNK)  # same wall instant: "lost" time is negative
    assert gap is not None and gap.duration_s == 0.0
    assert chunk.pos == 2000
