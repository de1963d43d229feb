"""bench.product end to end, short: `babelcast run` with the embedded engine (tiny.en, the
suite's fast model), two push streams of real speech for 20 s, one French target (Apertium,
the demo's CPU backend), through the gateway, Redis, ASR and translation actors."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.playback import MAX_DRAIN_S, SendLog
from bench.product import (
    COMPONENTS,
    STOP_MARGIN_S,
    _latencies,
    loop_talk,
    play_seconds,
    stream_audio,
)
from workers.events import SAMPLE_RATE

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_staggered_streams_keep_only_whole_utterances_and_their_text() -> None:
    loop, pieces = loop_talk()
    period = len(loop) // 2
    samples = 20 * SAMPLE_RATE
    texts = []
    for i in range(2):
        pcm, text, speech_s = stream_audio(loop, pieces, i * period // 2, samples)
        assert len(pcm) == 2 * samples
        # The text is that of whole utterances, as many seconds of them as were played.
        kept, rest = [], text
        while rest:
            piece = next(p for p in pieces if rest.startswith(p.text))
            kept.append(piece)
            rest = rest[len(piece.text):].lstrip()
        assert kept
        assert speech_s == pytest.approx(sum(p.end - p.start for p in kept) / SAMPLE_RATE)
        texts.append(text)
    assert texts[0] != texts[1]  # started at different places in the talk


def sent_at_wall_pace(seconds: int, t0: float = 1000.0) -> SendLog:
    """A SendLog of `seconds` of audio sent in 80 ms chunks at wall pace from `t0`."""
    log = SendLog()
    chunk = SAMPLE_RATE * 8 // 100
    for end in range(chunk, seconds * SAMPLE_RATE + 1, chunk):
        log.add(end, t0 + end / SAMPLE_RATE)
    return log


@pytest.mark.unit
def test_a_caption_of_the_silence_after_the_talk_is_timed_from_when_that_silence_went() -> None:
    # 10 s of talk, then the sender goes on with silence at wall pace (keep_live): a
    # caption whose audio ends 12 s into the stream, received 0.5 s after that sample was
    # sent, is 0.5 s late, not 2.5 s (the last chunk of the talk left at 1010.0).
    log = sent_at_wall_pace(10)
    assert log.wall_of(4.0) == pytest.approx(1004.0)  # inside the talk: its chunk
    assert log.wall_of(12.0) == pytest.approx(1012.0)
    assert not log.past_end(10.0) and log.past_end(12.0)
    received = [
        (1004.3, {"type": "caption", "text": "a", "is_final": False, "audio_end_s": 4.0}),
        (1012.5, {"type": "caption", "text": "b", "is_final": False, "audio_end_s": 12.0}),
        (1013.0, {"type": "caption", "text": "c", "is_final": True, "audio_end_s": 12.2}),
        (1013.1, {"type": "caption", "text": "", "is_final": False, "audio_end_s": 13.0}),
        (1013.2, {"type": "status"}),
    ]
    partial, final, texts, after = _latencies(received, log)
    assert partial == pytest.approx([0.3, 0.5])
    assert final == pytest.approx([0.8])
    assert texts == ["c"]
    assert after == {"partials": 1, "finals": 1}  # empty captions do not count


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("apertium") is None,
                    reason="needs redis-server and apertium (scripts/setup.sh)")
def test_two_push_streams_through_the_whole_product_report_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.product", "--json", "--streams", "2", "--seconds", "20",
         "--engine", "{kind: embedded, model: tiny.en, actors: 1, streams_per_actor: 2}",
         "--translate", "fr", "--ready-timeout", "120", "--deadline-s", "400"],
        capture_output=True, text=True, cwd=ROOT, timeout=220, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # the deadline left room for the whole talk, and the run says so
    assert result["complete"] is True and result["cut_by_deadline"] is False
    assert result["seconds_per_stream"] == result["seconds_asked"] == 20
    assert 0 < result["wall_s"] < 400
    for phase in ("actors ready", "playing", "draining", "stopped"):
        assert f"] {phase}" in done.stderr, phase  # progress lines, timed from the start

    for key in ("date", "commit", "command", "argv", "host", "vllm_version", "kind", "streams",
                "engine", "translate", "seconds_per_stream", "ready_s", "speech_s_per_stream",
                "played_wall_s", "drain_s", "source", "translated", "cpu_s",
                "cpu_s_per_audio_s", "cpu_s_per_audio_s_total", "bench_client_cpu_s",
                "session_counters", "actors", "load_avg"):
        assert key in result, key
    assert result["command"].startswith("python -m bench.product --json --streams 2")
    assert result["engine"] == {"kind": "embedded", "model": "tiny.en", "actors": 1,
                                "streams_per_actor": 2}
    assert result["host"]["cores"] and result["host"]["cpu"] is not None
    assert 0 < result["ready_s"] < 120  # the ready timeout
    assert result["commit"]

    src, fr = result["source"], result["translated"]
    assert (src["lang"], fr["lang"]) == ("en", "fr")
    for row in (src, fr):
        for key in ("final_latency_p50_s", "final_latency_p95_s", "finals_per_stream",
                    "open_at_end", "partials", "finals", "partials_after_audio",
                    "finals_after_audio"):
            assert key in row, key
        # Finals arrived in both languages on both streams, in a real-time-ish delay.
        assert set(row["finals_per_stream"]) == {"room-0", "room-1"}
        assert all(n > 0 for n in row["finals_per_stream"].values()), row
        assert 0 < row["final_latency_p50_s"] <= row["final_latency_p95_s"] < 15
    assert src["partial_latency_p50_s"] is not None and src["partial_latency_p95_s"] is not None
    assert src["open_at_end"] == 0
    assert src["wer"] < 0.3, src

    assert set(result["cpu_s"]) == set(COMPONENTS)
    assert result["cpu_s"]["asr"] > 0 and result["cpu_s_per_audio_s"]["asr"] > 0
    assert result["cpu_s"]["translation"] > 0
    # `asr` split by process: the embedded engine decodes in the actor's own process and
    # has no engine core; the parts add up to the whole (each rounded to 0.01 s)
    parts = result["asr_cpu_s_parts"]
    assert set(parts) == {"asr_actor", "asr_engine_core", "asr_helpers"}
    assert parts["asr_engine_core"] == 0 and parts["asr_actor"] > 0
    assert sum(parts.values()) == pytest.approx(result["cpu_s"]["asr"], abs=0.03)
    assert result["asr_us_per_chunk_parts"]["asr_actor"] > 0
    assert set(result["session_counters"]) >= {"stalls", "gap_fill_s", "late_audio_dropped_s"}
    assert "asr-0" in result["actors"] and result["actors"]["asr-0"]["engine_ok"] == 1


@pytest.mark.unit
def test_the_deadline_cuts_the_playback_to_what_is_left_or_refuses_a_pointless_one() -> None:
    assert play_seconds(300, None, 500) == 300  # no deadline: the talk as asked
    assert play_seconds(300, 600, 100) == 300  # it fits: 100 + 300 + drain + stop < 600
    left = 600 - 200 - MAX_DRAIN_S - STOP_MARGIN_S
    assert play_seconds(300, 600, 200) == left < 300  # cut to what the deadline leaves
    with pytest.raises(RuntimeError, match="deadline"):  # too little left to measure
        play_seconds(300, 600, 590)
    assert play_seconds(10, 200, 50) == 10  # a short talk that fits is never refused


@pytest.mark.unit
def test_an_interrupted_run_still_prints_where_it_stopped_and_keeps_the_runs_log(
        tmp_path: Path) -> None:
    """What `timeout` does to a device call at its limit (SIGTERM): one JSON object comes
    back, marked incomplete, with the phase; `babelcast run` is stopped, its log kept."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.product", "--json", "--streams", "1", "--seconds", "20",
         "--engine", "{kind: embedded, model: tiny.en, actors: 1, streams_per_actor: 1}",
         "--translate", "none", "--log-out", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # until `babelcast run` is up and writing its log
        seen.append(line)
        if "] gateway and asr-0 up" in line:
            break
    assert "starting babelcast run" in seen[0] and "asr-0 up" in seen[-1], seen[-5:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["complete"] is False
    assert result["stopped_in"] in ("gateway and asr-0 up", "waiting for actors",
                                    "actors ready", "playing"), result
    assert result["error"] == "Terminated: SIGTERM", result["error"]
    assert result["commit"] and result["command"].startswith("python -m bench.product")
    assert "] failed" in err
    assert log.exists() and log.stat().st_size > 0
