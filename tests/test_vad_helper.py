"""The VAD helper processes' transport (`workers.engines.vad.VadService`): what a caller
gets when the helper's function fails, when its answer cannot travel, when the helper is
killed with calls in flight, when the service shuts down, and when the caller itself dies.
Real helper processes (spawned), real Silero where flags are asked for."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.speech import AUDIO, decode_pcm16
from tests.waiting import alive
from workers.engines.vad import HelperGone, InlineVad, VadService

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]  # a lost EOF hangs: fail fast

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 2560  # 80 ms of PCM16


def fails(why: str) -> None:
    raise ValueError(why)


def unpicklable() -> object:
    return threading.Lock()


class NeedsTwo(Exception):
    def __init__(self, a: str, b: str) -> None:  # pickles, but cannot be rebuilt
        super().__init__(f"{a} {b}")


def fails_oddly() -> None:
    raise NeedsTwo("x", "y")


async def test_a_failing_call_raises_in_the_caller_and_the_helper_serves_on() -> None:
    service = VadService()
    try:
        pid = await service.call(0, os.getpid)
        with pytest.raises(ValueError, match="on purpose"):
            await service.call(0, fails, "on purpose")
        with pytest.raises(RuntimeError, match="could not be sent back"):
            await service.call(0, unpicklable)
        with pytest.raises(RuntimeError, match="could not be read here"):
            await service.call(0, fails_oddly)
        assert await service.call(0, os.getpid) == pid  # the same process, still serving
        assert service.restarts == 0
    finally:
        service.shutdown()


async def test_a_helper_killed_with_calls_in_flight_answers_them_from_one_new_process(
) -> None:
    """Every stream of the shard was waiting on the helper when it died: each call is
    answered by the process that replaces it, and only one replaces it."""
    pcm = decode_pcm16(AUDIO / "room-b.flac")[: CHUNK * 25]
    service = VadService()
    streams = [service.stream(f"s{i}") for i in range(8)]
    try:
        pid = await service.call(0, os.getpid)
        # Each call sleeps in the helper, so all eight are in flight when it is killed.
        calls = [asyncio.ensure_future(service.call(0, time.sleep, 0.3)) for _ in range(8)]
        await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        await asyncio.gather(*calls)
        assert service.restarts == 1
        new = await service.call(0, os.getpid)
        assert new != pid and not alive(pid)
        inline = InlineVad()
        for i in range(0, len(pcm), CHUNK):  # and the new helper keeps state per stream
            got = await asyncio.gather(*(s.flags(pcm[i : i + CHUNK]) for s in streams))
            want = await inline.flags(pcm[i : i + CHUNK])
            assert all(g == want for g in got), i
    finally:
        service.shutdown()


async def test_shutdown_ends_the_helpers_and_fails_what_still_waits() -> None:
    service = VadService(processes=2)
    pids = [await service.call(shard, os.getpid) for shard in (0, 1)]
    waiting = asyncio.ensure_future(service.call(0, time.sleep, 5))
    await asyncio.sleep(0.1)
    service.shutdown()
    with pytest.raises(HelperGone):
        await waiting
    with pytest.raises(HelperGone):  # and no new helper is started for a later call
        await service.call(1, os.getpid)
    assert not any(alive(p) for p in pids)  # shutdown waits for them (terminate, join)


CALLER = """
import asyncio, os, sys
from workers.engines.vad import VadService
async def main():
    service = VadService()
    print(await service.call(0, os.getpid), flush=True)
    os._exit(0)  # no shutdown, no atexit: as a killed actor ends
asyncio.run(main())
"""


def test_a_helper_whose_caller_died_ends_on_its_own() -> None:
    # The helper inherits the caller's stdout: read one line, not to the end (that would
    # wait for the helper too).
    caller = subprocess.Popen([sys.executable, "-c", CALLER], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        pid = int(caller.stdout.readline())
        assert caller.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the VAD helper outlived its caller"
    finally:
        caller.kill()
        if caller.stdout is not None:
            caller.stdout.close()
