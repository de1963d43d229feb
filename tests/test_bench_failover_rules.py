"""The bookkeeping bench.failover and bench.soak judge failover by, each rule beside a
case that must fail it (a gap, a repeat, a fault with no process, a lost final)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.failover_faults import Fault, signal_all
from bench.failover_rules import (
    finals_doubled,
    longest_silence,
    percentile,
    seq_contiguous,
)
from bench.soak import finals_lost, kill_verified, role_growth, seq_audit

pytestmark = pytest.mark.unit


def test_longest_silence_runs_from_the_fault_through_the_captions_to_the_end() -> None:
    times = [9.0, 11.0, 12.0, 19.0, 20.0]  # 9.0 is before the fault: not counted
    assert longest_silence(times, start=10.0, end=21.0) == pytest.approx(7.0)
    # Back quickly but then silent: the tail to the end of the speech counts.
    assert longest_silence([10.5, 11.0], start=10.0, end=30.0) == pytest.approx(19.0)
    # Never back: silent from the fault to the end.
    assert longest_silence([], start=10.0, end=30.0) == pytest.approx(20.0)
    # Behind real time: captions after the speech's end, with a 12 s gap among them; the
    # bench ends the window at the last caption then, and the gap counts.
    assert longest_silence([22.0, 34.0, 35.0], start=10.0, end=35.0) == pytest.approx(12.0)
    assert longest_silence([22.0, 34.0, 35.0], start=10.0, end=21.0) == pytest.approx(11.0)
    # The first caption after the fault is what ends the first silence.
    assert longest_silence([14.0, 15.0], start=10.0, end=15.0) == pytest.approx(4.0)


def test_seq_continuity_catches_a_gap_and_a_repeat() -> None:
    assert seq_contiguous([1, 2, 3, 4])
    assert seq_contiguous([])
    assert not seq_contiguous([1, 2, 4, 5]), "a gap"
    assert not seq_contiguous([1, 2, 2, 3]), "a repeat"
    assert not seq_contiguous([2, 3, 4]), "the first publication missing"


def test_a_final_made_twice_is_counted() -> None:
    assert finals_doubled([1, 2, 3]) == 0
    assert finals_doubled([1, 2, 2, 3, 3]) == 2


def test_percentiles_interpolate_and_say_none_when_empty() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 95) == 5.0
    assert percentile(list(map(float, range(1, 9))), 95) == pytest.approx(7.65)
    assert percentile([], 95) is None


def test_a_fault_with_no_process_found_did_not_happen() -> None:
    assert not Fault(kind="SIGKILL").check("dead")
    assert not signal_all([], signal.SIGKILL, "dead", wait_s=0.1).check("dead")


def test_a_fault_happened_only_when_the_process_is_seen_dead_or_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # A pid that is alive and was never signalled: not killed, not stopped.
        assert not Fault(kind="SIGKILL", pids=[child.pid]).check("dead")
        stopped = signal_all([child.pid], signal.SIGSTOP, "stopped")
        assert stopped.check("stopped") and stopped.states == {child.pid: "stopped"}
        os.kill(child.pid, signal.SIGCONT)
        assert not stopped.check("stopped"), "woken: no longer stopped"
        assert signal_all([child.pid], signal.SIGKILL, "dead").check("dead")
    finally:
        child.kill()
        child.wait()


def test_soak_records_a_kill_only_when_a_process_was_found_and_died() -> None:
    assert not kill_verified(None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert kill_verified(child.pid)
    finally:
        child.wait()
    assert not kill_verified(child.pid), "already gone: not this fault's doing"


def test_soak_seq_audit_counts_what_a_client_never_got_and_repeats() -> None:
    assert seq_audit([1, 2, 3]) == {"missing": 0, "repeats": 0}
    assert seq_audit([1, 2, 5, 6]) == {"missing": 2, "repeats": 0}
    # Redis came back without the counter: numbering starts over.
    assert seq_audit([1, 2, 3, 1, 2]) == {"missing": 0, "repeats": 1}


def test_soak_finals_lost_inside_a_redis_restart_show_from_the_seq_numbers() -> None:
    # seq -> (segment, kind). Segment 2's final (seq 4) and all of segment 3 (seqs 5-6)
    # were lost with Redis: neither the client nor the Stream has them.
    client = {1: (1, "partial"), 2: (1, "final"), 3: (2, "partial"), 7: (4, "partial"),
              8: (4, "final")}
    stream = dict(client)
    lost = finals_lost(client, stream)
    assert lost["finals_lost"] == 2, lost  # segment 2 never final, segment 3 never seen
    assert lost["seqs_lost_at_source"] == 3
    assert lost["finals_missed_by_client"] == 0
    # Nothing lost: the control case; a withdrawn segment and a gap event are not lost.
    whole = {1: (1, "partial"), 2: (1, "final"), 3: (2, "partial"), 4: (2, "withdraw"),
             5: (0, "gap"), 6: (3, "final"), 7: (4, "partial")}
    assert finals_lost(whole, whole)["finals_lost"] == 0
    # A final the Stream holds that the client missed.
    seen = {k: v for k, v in whole.items() if k != 6}
    assert finals_lost(seen, whole)["finals_missed_by_client"] == 1


def test_soak_rss_of_a_role_continues_across_its_replacement() -> None:
    samples = [{"asr-actor": (10, 100.0)}, {"asr-actor": (10, 110.0)},
               {}, {"asr-actor": (11, 130.0)}, {"asr-actor": (11, 150.0)}]
    g = role_growth(samples, "asr-actor", every=1)
    assert g is not None
    assert g["growth_pct"] == 50.0, "first sample of the role to its last, across pids"
    assert g["processes"] == 2
    assert g["last_process_growth_pct"] == pytest.approx(15.4)
    assert role_growth(samples, "gcs", every=1) is None
