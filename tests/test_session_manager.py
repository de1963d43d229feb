"""The session manager on real speech through the real embedded engine (tiny.en).

All scenarios play at wall-clock pace, at the same time, on one engine (its
decode thread is shared, as in an ASR actor), so the module takes as long as its
longest scenario, the talk (~1.7 minutes):
- a ~1.6-minute talk twice: with a 14 s session budget (warm rollovers) and without;
- the talk through an engine that goes mute after 30 s of a session's audio;
- 24 s of the talk through an engine slowed to a third of real time (its captions end
  ~48 s behind the audio, 72 s of wall time): slow, not stuck;
- 40 s of it, as slow, with the shedding policy at 8 s: it skips to the live edge;
- 60 s of room tone (no speech) through an engine that is mute from the start;
- the talk through an engine whose first session raises after 8 s;
- a source that stalls for a second in the middle of speech.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import jiwer
import numpy as np
import pytest

from bench.rollover import seam_doubles, talk
from tests.speech import normalize
from workers.captions.segmenter import Segmenter
from workers.engines.base import (
    RecognizeSession,
    SessionInput,
    SessionOptions,
    SpeechEngine,
    WrappedEngine,
)
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.engines.faults import MuteAfterEngine, RaisingEngine, SlowEngine
from workers.events import SAMPLE_RATE, AudioChunk, Word
from workers.sessions.manager import SessionManager, SessionPolicy

pytestmark = pytest.mark.integration

CHUNK = SAMPLE_RATE // 10
ROLLOVER = SessionPolicy(budget_s=14.0, margin_s=5.0, overlap_s=3.0)
SLOW_S = 24


@dataclass
class Played:
    manager: SessionManager
    words: list[tuple[float, Word]] = field(default_factory=list)
    finals: list[str] = field(default_factory=list)
    text_walls: list[float] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # gap events (start, end)
    t0: float = 0.0
    # (wall time, stream seconds the current engine session has heard, ruts detected),
    # sampled before each chunk goes in: the engine decodes behind the audio it is fed.
    heard: list[tuple[float, float | None, float]] = field(default_factory=list)


class RecordingEngine(WrappedEngine):
    """Test tool: the real engine, plus a copy of every chunk its sessions get."""

    def __init__(self, inner: SpeechEngine) -> None:
        super().__init__(inner)
        self.chunks: list[AudioChunk] = []

    def open_session(self, options: SessionOptions) -> RecognizeSession:
        recorder = self

        class _Recording(RecognizeSession):
            inner: RecognizeSession | None = None

            @property
            def heard_until(self) -> int | None:
                return None if self.inner is None else self.inner.heard_until

            async def _run(self, inputs: asyncio.Queue[SessionInput]) -> None:
                inner = self.inner = recorder.inner.open_session(options)

                async def forward() -> None:
                    async for delta in inner:
                        await self._emit(delta)

                task = asyncio.create_task(forward())
                try:
                    while True:
                        item = await inputs.get()
                        if isinstance(item, AudioChunk):
                            recorder.chunks.append(item)
                            await inner.push(item)
                        else:
                            await inner.end_input()
                            await task
                            return
                finally:
                    task.cancel()
                    await inner.aclose()

        session = _Recording(options)
        session.start()
        return session


async def play(engine: SpeechEngine, policy: SessionPolicy, pcm: bytes, *,
               stall_at_s: float | None = None, stall_s: float = 0.0,
               slowdown: float = 1.0) -> Played:
    manager = SessionManager(engine, SessionOptions("t", "en"), policy)
    manager.start()
    run = Played(manager, t0=time.time() + 0.2)

    async def feed() -> None:
        for i in range(0, len(pcm), CHUNK * 2):
            t = i // 2 / SAMPLE_RATE
            if stall_at_s is not None and stall_at_s <= t < stall_at_s + stall_s:
                continue  # the source stalls: this audio never arrives
            target = run.t0 + (i // 2 + CHUNK) / SAMPLE_RATE
            await asyncio.sleep(max(0.0, target - time.time()))
            cur = manager._cur  # test tool: which session the watchdog is judging
            heard = None if cur is None else cur.session.heard_until
            run.heard.append((time.time(), None if heard is None else heard / SAMPLE_RATE,
                              manager.counters["ruts_detected"]))
            await manager.push(AudioChunk("t", i // 2, pcm[i : i + CHUNK * 2], time.time()))
        await manager.end_input()

    async def consume() -> None:
        seg = Segmenter("t", "en")
        async for delta in manager:
            now = time.time()
            run.words.extend((now, w) for w in delta.committed)
            if delta.committed or delta.tentative:
                run.text_walls.append(now)
            published = seg.feed(delta)
            run.finals.extend(c.text for c in published if c.is_final)
            run.gaps.extend((c.audio_start_s, c.audio_end_s) for c in published if c.gap_s)

    await asyncio.wait_for(asyncio.gather(feed(), consume()),
                           slowdown * len(pcm) / 2 / SAMPLE_RATE + 60)
    return run


def room_tone(seconds: float) -> bytes:
    """Quiet room noise (about -50 dBFS), not digital silence."""
    rng = np.random.default_rng(7)
    return (rng.normal(0, 100, int(seconds * SAMPLE_RATE))).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    async def run_all() -> dict[str, Any]:
        # Finals read Whisper's 10 s input here, not the default 30 s: with 30 s finals
        # these six streams kept a 2-core host's engine 98 % busy, decoding 10-18 s
        # behind the audio, and this module times the session manager, not the engine.
        engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model="tiny.en", cpu_threads=2,
                                                             final_encode_s=10.0))
        await engine.start()
        pcm, text = talk(1.6)  # ≥ 6 switches at a 14 s budget
        mute = MuteAfterEngine(engine, after_s=30.0, sessions=1)
        silent = MuteAfterEngine(engine, after_s=0.0)
        raising = RaisingEngine(engine, after_s=8.0, sessions=1)
        recording = RecordingEngine(engine)
        # Each chunk is held back twice its length before the real session gets it: the
        # session decodes at half real time, its backlog grows, its captions keep coming.
        slow = SlowEngine(engine, slowdown=2.0)
        # A third of real time: 24 s of audio end ~48 s behind in 72 s of wall time (at half
        # real time, 80 s took 160 s, the module's longest scenario by a minute).
        slower = SlowEngine(engine, slowdown=3.0)
        out = await asyncio.gather(
            play(engine, ROLLOVER, pcm),
            play(engine, SessionPolicy(), pcm),
            play(mute, SessionPolicy(), pcm[: 70 * SAMPLE_RATE * 2]),
            play(silent, SessionPolicy(), room_tone(60)),
            play(raising, SessionPolicy(), pcm[: 40 * SAMPLE_RATE * 2]),
            play(recording, SessionPolicy(), pcm[: 20 * SAMPLE_RATE * 2],
                 stall_at_s=8.0, stall_s=1.0),
            play(slower, SessionPolicy(), pcm[: SLOW_S * SAMPLE_RATE * 2], slowdown=3.0),
            play(slow, SessionPolicy(shed_after_s=8.0), pcm[: 40 * SAMPLE_RATE * 2],
                 slowdown=2.0),
        )
        await engine.aclose()
        keys = ("with", "without", "mute", "silence", "raising", "stall", "slow", "shed")
        return {"text": text, "raising_engine": raising, "recording": recording,
                **dict(zip(keys, out, strict=True))}

    return asyncio.run(run_all())


def wer(ref: str, played: Played) -> float:
    return float(jiwer.wer(normalize(ref), normalize(" ".join(played.finals))))


def test_captions_continue_across_every_rollover(results: dict[str, Any]) -> None:
    played: Played = results["with"]
    log = played.manager.rollover_log
    assert len(log) >= 5, log
    assert all(reason == "budget" for reason, _ in log)
    ends = sorted(w.end_s for _, w in played.words)
    for _, t in log:
        if t > ends[-1] - 6:
            continue  # the talk ends right after this switch
        # Words keep coming within a few seconds after every switch point.
        assert any(t < e <= t + 6 for e in ends), f"no words after the switch at {t:.1f} s"


def test_rollover_seams_lose_or_double_at_most_a_word_each(results: dict[str, Any]) -> None:
    """Word by word, as bench.rollover counts: deletions and insertions within 3 s of each
    switch, minus the run without rollovers in the same windows. (The whole-talk WER of the
    two runs is a bench figure: under a loaded machine both runs lose words away from any
    seam, and their difference measured the load more than the seams.)"""
    from bench.alignment import seam_errors
    from bench.rollover import Run, timed_tokens

    with_r: Played = results["with"]
    without: Played = results["without"]
    switches = [t for _, t in with_r.manager.rollover_log]
    seams = seam_errors(normalize(results["text"]).split(),
                        timed_tokens(Run(with_r.manager, with_r.words)),
                        timed_tokens(Run(without.manager, without.words)), switches)
    print("rollover seams:", len(switches), "switches", seams, "WER with",
          round(wer(results["text"], with_r), 3), "without",
          round(wer(results["text"], without), 3))
    assert seams["lost_words"] + seams["doubled_words"] <= len(switches), seams


def test_no_word_appears_twice_at_a_rollover_seam(results: dict[str, Any]) -> None:
    from bench.rollover import Run

    played: Played = results["with"]
    assert seam_doubles(Run(played.manager, played.words)) == 0


def test_mute_engine_is_replaced_soon_after_it_hears_speech(results: dict[str, Any]) -> None:
    """Within about ten seconds of the audio the engine heard while mute. The session decodes
    behind the audio (on a 2-core host, six streams on one engine: 10-18 s behind), and the
    watchdog can only judge what the session has heard: on a host that keeps up, heard
    and wall time agree (bench.rollover: recovery 7.1 s after the mute)."""
    played: Played = results["mute"]
    counters = played.manager.counters
    assert counters["rollovers_rut"] == 1
    assert counters["rut_recoveries"] >= 1
    # The talk is continuous speech around 30 s, so the mute starts during speech: from
    # then on, text for whatever the session decodes is dropped.
    onset = played.t0 + 30.0
    muted_from = next(h for wall, h, _ in played.heard if wall >= onset)
    assert muted_from is not None
    # The last sample before the replacement: what the mute session had heard by then.
    caught_at = next(h for (_, h, _), (_, _, ruts) in itertools.pairwise(played.heard)
                     if ruts >= 1)
    assert caught_at is not None
    recovered = next(w for w in played.text_walls if w > onset + 0.5)
    print(f"mute: heard {muted_from:.1f} s at onset, caught after {caught_at - muted_from:.1f}"
          f" s of heard audio, text again {recovered - onset:.1f} s after the onset")
    assert caught_at > muted_from, "replaced before the engine went mute"
    # The watchdog judges only what the session has heard, and heard moves in decode steps
    # whose size is the engine's (2-3 s on an idle 2-core host, 3.5 s or more on a busy
    # one: 13.6 s from the mute to the catch in one CI-like run). So the bound is on the
    # step before the catch: by then the session had heard less than the policy's 6 s of
    # speech plus the talk's pauses among it (1.6 s each), and the very next step caught
    # it. Measured: 7.9 s before the catch at 10.3 s (idle 2-core host).
    before = [h for _, h, ruts in played.heard
              if h is not None and ruts < 1 and muted_from <= h < caught_at]
    last_step_before = max(before, default=muted_from)
    print(f"mute: the step before the catch had heard {last_step_before - muted_from:.1f} s")
    assert last_step_before - muted_from < 10.0
    later = [w for wall, w in played.words if wall > recovered]
    assert len(later) >= 40, "captions did not go on after the recovery"


def test_a_minute_of_silence_causes_no_rollover(results: dict[str, Any]) -> None:
    played: Played = results["silence"]
    assert played.manager.rollover_log == []
    assert played.manager.counters["ruts_detected"] == 0
    assert played.manager.gauges["voiced_without_text_s"] < 1.0


def test_engine_that_raises_is_replaced_and_the_stream_continues(
    results: dict[str, Any],
) -> None:
    played: Played = results["raising"]
    assert [r for r, _ in played.manager.rollover_log] == ["engine_error"]
    assert results["raising_engine"].sessions_opened == 2
    switch = played.manager.rollover_log[0][1]
    later = [w for _, w in played.words if w.start_s > switch + 2]
    assert len(later) >= 20, "the replacement session did not caption the rest"


def test_stalled_source_is_filled_with_faint_noise_and_marked(results: dict[str, Any]) -> None:
    played: Played = results["stall"]
    counters = played.manager.counters
    assert counters["stalls"] >= 1
    assert 0.8 <= counters["gap_fill_s"] <= 1.2
    chunks: list[AudioChunk] = results["recording"].chunks
    # One contiguous clock for the engine: no holes, no overlaps.
    for a, b in itertools.pairwise(chunks):
        assert b.pos == a.pos + a.samples
    filled = [c for c in chunks if 8.0 <= c.start_s < 8.9]
    samples = np.concatenate([np.frombuffer(c.pcm, dtype="<i2") for c in filled])
    assert np.abs(samples).max() <= 2, "the hole is not faint noise"
    assert samples.any(), "the hole was filled with exact zeros"


def longest_silence(played: Played, upto_s: float) -> float:
    """The longest stretch of audio (to `upto_s`) between two captioned words."""
    starts = sorted(w.start_s for _, w in played.words if w.end_s <= upto_s)
    ends = sorted(w.end_s for _, w in played.words if w.end_s <= upto_s)
    return max((b - a for a, b in zip(ends, starts[1:], strict=False)), default=upto_s)


def test_a_slow_session_is_not_replaced_and_loses_no_audio(results: dict[str, Any]) -> None:
    played: Played = results["slow"]
    lags = [wall - played.t0 - w.end_s for wall, w in played.words]
    print(f"slow: captions up to {max(lags):.1f} s behind the audio, "
          f"{len(played.words)} words, rollovers {played.manager.rollover_log}")
    assert max(lags) > 30.0, "not slow enough to tell: the old bound judged past 30 s"
    assert played.manager.counters["ruts_detected"] == 0
    assert played.manager.rollover_log == []
    # Every stretch of the talk is captioned: no hole longer than the talk's own pauses
    # (the run without faults over the same audio) and a little slack.
    upto = SLOW_S - 2.0
    reference = longest_silence(results["without"], upto)
    assert longest_silence(played, upto) <= reference + 2.5, (
        longest_silence(played, upto), reference)
    assert max(w.end_s for _, w in played.words) > SLOW_S - 5.0, "the end of the audio is missing"


def test_a_stuck_session_resumes_from_the_last_words_end(results: dict[str, Any]) -> None:
    """The replacement re-reads the audio from the end of the muted session's last
    committed word, however far behind the live edge that is: nothing said in between is
    lost (issue 36: the replacement read only the watchdog's last 15 s of audio, and a
    session that was behind lost the rest)."""
    played: Played = results["mute"]
    [(reason, cut)] = played.manager.rollover_log
    assert reason == "rut"
    before = [w for _, w in played.words if w.end_s <= cut + 1e-6]
    assert before and abs(max(w.end_s for w in before) - cut) < 1e-6
    after = sorted(w.start_s for _, w in played.words if w.start_s >= cut)
    assert after and after[0] - cut < 3.0, f"first word after the cut at {after[0] - cut:.1f} s"
    reference = longest_silence(results["without"], 68.0)
    assert longest_silence(played, 68.0) <= reference + 2.5, (
        longest_silence(played, 68.0), reference)
    assert played.manager.counters["skipped_s_replacement"] == 0


def test_shedding_skips_to_the_live_edge_and_says_what_it_skipped(
    results: dict[str, Any],
) -> None:
    """With `shed_after_s`, a stream further behind skips ahead: every stretch of audio is
    either captioned or reported as a gap event with its seconds, the skips are counted,
    and the captions stay within reach of the live edge."""
    played: Played = results["shed"]
    counters = played.manager.counters
    print(f"shed: {len(played.gaps)} gaps, {counters['skipped_s_shed']:.1f} s skipped, "
          f"{len(played.words)} words")
    assert played.gaps and [r for r, _ in played.manager.rollover_log].count("shed") == len(
        played.gaps)
    assert counters["skipped_s_shed"] == pytest.approx(sum(b - a for a, b in played.gaps))
    # An engine at half real time for good is shedding's worst case: a session is shed
    # once it is 8 s behind (it gets 8 s of audio first), and the words it had heard but
    # not yet confirmed go with it, into the gap. Measured on 2 busy cores (2026-12-03):
    # 4 gaps, 33.7 s of 40 s skipped, 14 words; on 2026-12-04, 4 gaps, 38.3 s skipped, 2
    # words (how many a session confirms before it is shed follows the host's load). What
    # matters here is that every stretch is captioned or reported (above and below) and
    # that captions still come; shedding pays off when an actor is behind for a while, not
    # slow for ever (tests/test_overload.py).
    assert len(played.words) >= 1
    # Covered: words and gaps leave no hole longer than the talk's own pauses.
    spans = sorted([(w.start_s, w.end_s) for _, w in played.words] + played.gaps)
    reach = 0.0
    holes = []
    for a, b in spans:
        if a > 38.0:
            break
        holes.append(a - reach)
        reach = max(reach, b)
    reference = longest_silence(results["without"], 38.0)
    assert max(holes) <= reference + 2.5, (max(holes), reference)
    # Never further behind than the bound plus a decode step or two.
    lags = [wall - played.t0 - w.end_s for wall, w in played.words]
    assert max(lags) < 8.0 + 12.0, max(lags)
