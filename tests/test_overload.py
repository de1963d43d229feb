"""Overload, for real: more rooms than this host carries (real Whisper tiny.en in a real
Ray actor, real Redis), fed at real time, then the load drops.

How many rooms overload a host depends on the host: eight rooms ran 10-18 s behind on one
2-core machine and only 7 s behind on CI's faster one, where the test then proved nothing.
So the test first measures this host (`workers.engines.calibrate.measure`: one stream of
the same engine options in lock step, the decode thread's busy seconds per audio second)
and feeds `OVERLOAD` times the rooms that thread could decode at 100 % busy. Lock step
decodes every interim, and a loaded engine skips interims, so the thread carries more
rooms than that figure says: 2.5 times it reached a 10.5 s lag in 75 s and shed nothing;
5 times shed in every room, and once, on a host busy with other work as well, starved a
room of every final (each of its sessions shed before its first). Four times it is.

Even so, how far behind four times gets in a fixed time is not the same on every host: CI's
ran 16 rooms only 13.9 s behind in 75 s, short of a 20 s policy, and shed nothing. So the
actor sheds at 14 s (`SessionPolicy.shed_after_s`; production's default is 20; above the
10 s at which a stream counts as behind, `LAG_BEHIND_S`, so the count is seen before the
shed), and the load is held for at least `LOAD_S` and then until a room has shed, up to
`LOAD_MAX_S`: a host that is still not that far behind by then fails the test as "not
overloaded". How fast the lag grows depends on what else the host runs: a fresh clone's
suite on a busy host fed 15 rooms and reached only 12.4 s in 135 s (~0.09 s a second: the
thread was over its load by a few per cent, not four times), so `LOAD_MAX_S` is 240 s;
where the lag grows as the calibration says, a room sheds by ~75-100 s and the rest of
that time is never spent. What must hold:
- no final with empty text or with audio times outside the stream (`start < end`);
- every stretch of each room's audio is either captioned (a final covers it) or reported
  as a `gap` event with its seconds; nothing is dropped without one (`queue_full` 0);
- the lag is visible while it lasts: a room's status says it is behind, and the actor's
  status counts it (`streams_behind`), whatever its RTF says;
- the policy shed: some room reports gap seconds;
- after all but two rooms stop, the two left catch up: their lag comes back under 5 s.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
import ray

from bench.rollover import talk
from orchestrator.ray_actors import AsrActor
from tests.waiting import kill_actors
from workers.asr import AsrHostOptions
from workers.asr.host import LAG_BEHIND_S
from workers.bus import RedisBus, caption_from_json, captions_key
from workers.engines.calibrate import measure
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.events import SAMPLE_RATE, AudioChunk, CaptionSegment, StreamOptions
from workers.sessions.manager import SessionPolicy

pytestmark = pytest.mark.integration

OVERLOAD = 4.0
"""Rooms fed, as a multiple of those the decode thread could carry at 100 % busy."""
MIN_ROOMS, MAX_ROOMS = 6, 64
LOAD_S = 75.0
LOAD_MAX_S = 240.0
AFTER_S = 40.0
SHED_S = 14.0
CHUNK = SAMPLE_RATE // 10


async def all_captions(bus: RedisBus, stream: str) -> list[CaptionSegment]:
    entries = await bus.redis.xrange(captions_key(stream, "en"))
    return [caption_from_json(fields[b"d"]) for _, fields in entries]


def holes(segs: list[CaptionSegment], upto_s: float) -> list[tuple[float, float]]:
    """Stretches of audio up to `upto_s` that no final and no gap event covers."""
    spans = sorted((s.audio_start_s, s.audio_end_s) for s in segs if s.is_final or s.gap_s)
    out: list[tuple[float, float]] = []
    reach = 0.0
    for a, b in spans:
        if a >= upto_s:
            break
        if a > reach:
            out.append((reach, a))
        reach = max(reach, b)
    if reach < upto_s:
        out.append((reach, upto_s))
    return out


def rooms_for(busy_per_stream: float) -> int:
    """Rooms that load this host's decode thread `OVERLOAD` times over."""
    rooms = math.ceil(OVERLOAD / max(busy_per_stream, 1e-3))
    assert rooms <= MAX_ROOMS, (
        f"one stream takes {busy_per_stream:.3f} of the decode thread: overloading this host "
        f"needs {rooms} rooms, more than this test feeds ({MAX_ROOMS})")
    return max(MIN_ROOMS, rooms)


def test_rooms_for_scales_with_the_host() -> None:
    assert rooms_for(0.2) == 20  # a slow host: 5 streams fill the thread
    assert rooms_for(0.25) == 16
    assert rooms_for(1.0) == MIN_ROOMS
    with pytest.raises(AssertionError, match="more than this test feeds"):
        rooms_for(0.05)


async def test_an_overloaded_actor_falls_behind_says_so_sheds_with_gaps_and_catches_up(
    local_ray: None, bus: RedisBus, redis_url: str
) -> None:
    # One decode thread of one core: the overload is this actor's, and the suite's other
    # worker keeps the other core (with two, its timed tests ran beside a saturated host).
    options = EmbeddedEngineOptions(model="tiny.en", cpu_threads=1)
    engine = EmbeddedWhisperEngine(options)
    await engine.start()
    try:
        # The lower of two: a measurement slowed by something else on the host (Ray
        # starting its workers) would feed fewer rooms than overload it.
        busy = min([(await measure(engine)).busy_per_stream for _ in range(2)])
    finally:
        await engine.aclose()
    rooms = [f"room-{i}" for i in range(rooms_for(busy))]
    stay = rooms[:2]  # fed on after the load drops
    print(f"overload: one stream busies the decode thread {busy:.3f}; "
          f"feeding {len(rooms)} rooms")
    pcm, _ = talk((LOAD_MAX_S + AFTER_S) / 60 + 0.5)  # talk() rounds to whole repeats
    actor = ray.remote(num_cpus=0)(AsrActor).remote(
        AsrHostOptions(actor_id="asr-0", redis_url=redis_url, max_streams=len(rooms),
                       read_block_ms=100, session_policy=SessionPolicy(shed_after_s=SHED_S)),
        options)
    samples: list[dict[str, Any]] = []
    fed_s: dict[str, float] = {}
    shed_seen = asyncio.Event()  # a room's status counts seconds shed
    dropped = asyncio.Event()  # the load dropped: all rooms but `stay` stop
    dropped_at = math.inf

    async def feed(room: str) -> None:
        t0 = time.monotonic()
        for i in range(0, len(pcm) - CHUNK * 2, CHUNK * 2):
            if dropped.is_set() and (room not in stay
                                     or time.monotonic() >= dropped_at + AFTER_S):
                return
            await asyncio.sleep(max(0.0, t0 + (i // 2 + CHUNK) / SAMPLE_RATE
                                    - time.monotonic()))
            await bus.add_audio(AudioChunk(room, i // 2, pcm[i:i + CHUNK * 2], time.time()))
            fed_s[room] = (i // 2 + CHUNK) / SAMPLE_RATE
        raise AssertionError(f"{room}: the talk ran out before the feed ended")

    async def drop_load() -> None:
        nonlocal dropped_at
        await asyncio.sleep(LOAD_S)
        try:
            await asyncio.wait_for(shed_seen.wait(), LOAD_MAX_S - LOAD_S)
        except TimeoutError:
            pass  # not overloaded enough to shed: asserted below, with the lag seen
        dropped_at = time.monotonic()
        dropped.set()

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            st = {r: await bus.get_status(r) for r in rooms}
            actor_st = await bus.redis.hgetall("actor:asr-0")
            samples.append({"t": time.monotonic(), "rooms": st, "actor": actor_st})
            if any(float(s.get("skipped_s_shed", 0)) > 0 for s in st.values()):
                shed_seen.set()
            await asyncio.sleep(1.0)

    try:
        for room in rooms:
            await asyncio.wait_for(actor.add_stream.remote(StreamOptions(
                stream_id=room, name=room, source="push", language="en")), 120)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        started = time.monotonic()
        await asyncio.gather(drop_load(), *(feed(r) for r in rooms))
        print(f"overload: the load dropped after {dropped_at - started:.0f} s")

        def lag(room: str, sample: dict[str, Any]) -> float:
            return float(sample["rooms"][room].get("caption_lag_s", "nan"))

        # Caught up: the rooms left are under 5 s behind at the end of their feed.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = {r: await bus.get_status(r) for r in stay}
            if all(float(s.get("caption_lag_s", 99)) < 5.0 for s in st.values()):
                break
            await asyncio.sleep(1.0)
        stop.set()
        await watcher
        await asyncio.wait_for(actor.stop.remote(), 30)
        captions = {r: await all_captions(bus, r) for r in rooms}
        statuses = {r: await bus.get_status(r) for r in rooms}
    finally:
        await kill_actors([actor])

    loaded = [s for s in samples if s["t"] < dropped_at]
    worst = max(lag(r, s) for s in loaded for r in rooms if lag(r, s) == lag(r, s))
    behind_counts = [int(float(s["actor"].get(b"streams_behind", b"0"))) for s in loaded]
    end_lags = {r: float(statuses[r].get("caption_lag_s", "nan")) for r in stay}
    gaps = {r: sum(c.gap_s for c in captions[r]) for r in rooms}
    n_finals = {r: sum(1 for c in captions[r] if c.is_final) for r in rooms}
    print(f"overload: worst lag {worst:.1f} s, streams_behind up to {max(behind_counts)}, "
          f"seconds shed per room {gaps}, finals per room {n_finals}, "
          f"lag of the rooms left at the end {end_lags}")

    for room, segs in captions.items():
        finals = [c for c in segs if c.is_final]
        assert finals, f"{room}: no final"
        bad = [c.seq for c in finals
               if not c.text or not 0.0 <= c.audio_start_s < c.audio_end_s]
        assert not bad, f"{room}: empty or untimed finals {bad}"
        # Every stretch captioned or reported as a gap (the talk's own pauses and the
        # end of an utterance that was still being decoded at the stop aside).
        upto = fed_s[room] - 10.0
        long_holes = [(round(a, 1), round(b, 1)) for a, b in holes(segs, upto) if b - a > 6.0]
        assert not long_holes, f"{room}: audio neither captioned nor reported: {long_holes}"
        assert float(statuses[room].get("skipped_s_queue_full", 0)) == 0.0, room
    # Overloaded past the policy, and it was seen: the policy shed (with gap events), and
    # rooms were behind in their status and in the actor's.
    assert sum(gaps.values()) > 0, (
        f"nothing shed in {LOAD_MAX_S:.0f} s (worst lag {worst:.1f} s, policy {SHED_S} s): "
        f"not overloaded, the test proves nothing")
    assert worst > LAG_BEHIND_S, f"shed, but no room's status showed it behind ({worst:.1f} s)"
    assert max(behind_counts) >= 1
    # The load dropped: the rooms left caught up.
    assert all(v < 5.0 for v in end_lags.values()), end_lags
