"""The session manager over the `vllm` engine's real session code (its backend is the
FAKE vLLM backend, tests/fake_vllm.py, since vLLM cannot run here), on real speech with
Silero voice activity: jittered budgets, a cold replacement when no slot is free for a
warm successor, the VAD in a helper process, and the words' times across rollovers."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.fake_vllm import FakeVllmBackend
from tests.speech import AUDIO, decode_pcm16
from workers.engines.base import SessionOptions
from workers.engines.vad import InlineVad, VadService
from workers.engines.vllm.engine import DEFAULT_GEOMETRY, VllmEngineOptions, VllmVoxtralEngine
from workers.events import SAMPLE_RATE, AudioChunk, Word
from workers.sessions.manager import SessionManager, SessionPolicy
from workers.sessions.watchdog import RutPolicy

pytestmark = pytest.mark.integration

CHUNK = SAMPLE_RATE // 10
NO_RUT = RutPolicy(chars_per_speech_s=0.0)  # the fake's text is not speech-shaped


def speech(seconds: float) -> bytes:
    pcm = decode_pcm16(AUDIO / "room-a.flac")
    reps = int(seconds * SAMPLE_RATE * 2 / len(pcm)) + 1
    return (pcm * reps)[: int(seconds * SAMPLE_RATE) * 2]


def engine(max_streams: int = 4, headroom: int | None = None) -> VllmVoxtralEngine:
    return VllmVoxtralEngine(
        VllmEngineOptions(model="/fake", max_streams=max_streams, rollover_headroom=headroom,
                          reanchor="off"),
        backend=FakeVllmBackend(text_every=3), geometry=DEFAULT_GEOMETRY)


async def play(manager: SessionManager, pcm: bytes, speed: float = 8.0) -> list[Word]:
    """Push the audio at `speed` × real time; collect the committed words."""
    manager.start()
    words: list[Word] = []

    async def consume() -> None:
        async for delta in manager:
            words.extend(delta.committed)

    task = asyncio.create_task(consume())
    t0 = time.monotonic()
    for i in range(0, len(pcm), CHUNK * 2):
        await asyncio.sleep(max(0.0, t0 + i / 2 / SAMPLE_RATE / speed - time.monotonic()))
        await manager.push(AudioChunk(manager.options.stream_id, i // 2, pcm[i : i + CHUNK * 2],
                                      time.time()))
    await manager.end_input()
    await asyncio.wait_for(task, 60)
    return words


def test_budgets_are_jittered_per_stream_and_session() -> None:
    eng = engine()
    policy = SessionPolicy(budget_s=100.0, margin_s=10.0, overlap_s=3.0, budget_jitter=0.2)
    managers = [SessionManager(eng, SessionOptions(f"room-{i}"), policy) for i in range(8)]
    budgets = [m._jittered_budget(1) for m in managers]
    assert all(b is not None and 80.0 <= b <= 100.0 for b in budgets), budgets
    assert len({round(b or 0, 3) for b in budgets}) == 8, "streams started together roll together"
    assert max(b or 0 for b in budgets) - min(b or 0 for b in budgets) > 5.0
    # Reproducible for a stream and session, different for its next session.
    again = SessionManager(eng, SessionOptions("room-0"), policy)
    assert again._jittered_budget(1) == budgets[0] != again._jittered_budget(2)


def test_a_budget_past_the_engines_limit_is_clamped() -> None:
    eng = VllmVoxtralEngine(VllmEngineOptions(model="/fake", max_model_len=600, reanchor="off"),
                            backend=FakeVllmBackend(), geometry=DEFAULT_GEOMETRY)
    m = SessionManager(eng, SessionOptions("a"), SessionPolicy(budget_s=3600.0))
    assert m.budget_s == pytest.approx((600 - 32 - 17 - 16) * 0.08)


async def test_without_a_free_slot_the_session_is_replaced_cold_at_its_budget() -> None:
    """One stream and no headroom: the warm successor cannot open, so at the budget the
    session is replaced cold — the engine's limit is never passed and captions go on."""
    eng = engine(max_streams=1, headroom=0)
    policy = SessionPolicy(budget_s=8.0, margin_s=3.0, overlap_s=2.0, budget_jitter=0.0,
                           rut=NO_RUT, restart_backoff_s=0.2)
    m = SessionManager(eng, SessionOptions("solo"), policy)
    words = await play(m, speech(30.0))
    assert m.counters["cold_rollovers"] >= 2
    assert m.counters["session_open_failures"] >= 1
    assert eng.slot_refusals >= 1 and eng.sessions_open == 0
    late = [w for w in words if w.end_s > 20.0]
    assert late, "captions stopped after the cold replacements"
    ends = [w.end_s for w in words]
    assert ends == sorted(ends)


async def test_warm_rollovers_keep_word_times_on_the_stream_clock() -> None:
    """The successor re-reads the overlap at once; its words keep their audio times, so
    the seam filter keeps each word once and the times never go back."""
    eng = engine(max_streams=2)
    policy = SessionPolicy(budget_s=8.0, margin_s=3.0, overlap_s=2.0, budget_jitter=0.0,
                           rut=NO_RUT)
    m = SessionManager(eng, SessionOptions("warm"), policy)
    words = await play(m, speech(40.0))
    assert m.counters["rollovers_budget"] >= 3
    assert m.counters.get("cold_rollovers", 0) == 0
    ends = [w.end_s for w in words]
    assert ends == sorted(ends) and ends[-1] <= 40.0 + 1e-6
    # Text every 3rd output at 80 ms each: about one word per 0.24 s of audio, none
    # doubled at the seams (a doubled window would add ~2 s worth of words per seam).
    assert 40.0 / 0.24 * 0.8 <= len(words) <= 40.0 / 0.24 * 1.1, len(words)


async def test_voice_activity_in_a_helper_process_matches_inline_and_frees_the_loop() -> None:
    pcm = speech(12.0)
    service = VadService()
    warm, remote, inline = service.stream("warm"), service.stream("a"), InlineVad()
    try:
        await warm.flags(pcm[: CHUNK * 2])  # the helper process starts
        got_remote: list[bool] = []
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        for i in range(0, len(pcm), CHUNK * 2):
            got_remote += await remote.flags(pcm[i : i + CHUNK * 2])
        stop = True
        await t
        got_inline: list[bool] = []
        for i in range(0, len(pcm), CHUNK * 2):
            got_inline += await inline.flags(pcm[i : i + CHUNK * 2])
        assert got_remote == got_inline and sum(got_inline) > 10
        # Silero ran in the other process: the loop kept ticking while it worked.
        assert sorted(gaps)[len(gaps) // 2] < 0.02
    finally:
        for v in (warm, remote):
            v.close()
        service.shutdown()


async def test_voice_activity_spreads_streams_over_helper_processes_and_survives_a_kill(
) -> None:
    """A GPU actor with many streams gives Silero several processes: streams are spread
    over them, each stream's flags equal the inline ones, and a killed process costs only
    its own streams' state (the next call starts a new process)."""
    import os
    import signal

    pcm = speech(6.0)
    service = VadService(processes=2)
    a, b = service.stream("a"), service.stream("b")
    try:
        await asyncio.gather(a.flags(pcm[: CHUNK * 2]), b.flags(pcm[: CHUNK * 2]))
        pids = [await service.call(shard, os.getpid) for shard in (0, 1)]
        assert len(set(pids)) == 2 and os.getpid() not in pids

        async def flags(v: object, audio: bytes) -> list[bool]:
            out: list[bool] = []
            for i in range(0, len(audio), CHUNK * 2):
                out += await v.flags(audio[i : i + CHUNK * 2])  # type: ignore[attr-defined]
            return out

        for v in (a, b):
            v.reset()
        got_a, got_b = await asyncio.gather(flags(a, pcm), flags(b, pcm))
        want = await flags(InlineVad(), pcm)
        assert got_a == want and got_b == want and sum(want) > 5

        os.kill(pids[1], signal.SIGKILL)  # b's process
        await asyncio.sleep(0.5)
        assert await flags(b, pcm[: CHUNK * 20])  # a new process answers
        assert service.restarts == 1
        assert await service.call(0, os.getpid) == pids[0]  # a's process untouched
    finally:
        for v in (a, b):
            v.close()
        service.shutdown()
