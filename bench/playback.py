"""Real-time playback for the comparison benchmarks: the reference talk, a sender that
keeps wall-clock pace and logs when each chunk left, and what a system sent back."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tests.speech import AUDIO, REFERENCE_FILES, decode_pcm16
from workers.events import SAMPLE_RATE

LEAD_IN_S = 1.0
TAIL_S = 3.0
QUIET_S = 3.0  # after the settle window: stop once no final has come for this long
MAX_DRAIN_S = 30.0


def reference_talk(repeat: int) -> tuple[bytes, str]:
    """PCM16 of the reference utterances `repeat` times (between silences), and its text."""
    one = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    text = " ".join(" ".join((AUDIO / f"{n}.txt").read_text().split()) for n in REFERENCE_FILES)
    lead = bytes(2 * int(LEAD_IN_S * SAMPLE_RATE))
    tail = bytes(2 * int(TAIL_S * SAMPLE_RATE))
    return lead + one * repeat + tail, " ".join([text] * repeat)


class SendLog:
    """When each chunk of the played audio was sent, to map an audio time to a wall time."""

    def __init__(self) -> None:
        self.ends: list[int] = []  # sample position after each chunk
        self.walls: list[float] = []

    def add(self, end: int, wall: float) -> None:
        self.ends.append(end)
        self.walls.append(wall)

    def wall_of(self, t_s: float) -> float:
        """Send time of the chunk that holds the sample at `t_s`. Past the audio logged,
        the stream went on at wall pace (`keep_live`'s silence, or a session's stall
        filler), so the time is the last chunk's plus the audio seconds past it: mapped to
        the last chunk, a caption of the silence after the talk counted every second of
        that silence as latency (a vllm product run with random weights, which write text
        over silence, read a partial p95 of 19.9 s that way, 2026-12-05)."""
        sample = round(t_s * SAMPLE_RATE)
        i = bisect.bisect_left(self.ends, sample)
        if i < len(self.ends):
            return self.walls[i]
        return self.walls[-1] + max(0, sample - self.ends[-1]) / SAMPLE_RATE

    def past_end(self, t_s: float) -> bool:
        """Whether the sample at `t_s` lies past the audio logged."""
        return bool(self.ends) and round(t_s * SAMPLE_RATE) > self.ends[-1]


async def play(send: Callable[[bytes], Awaitable[None]], pcm: bytes, chunk: int,
               log: SendLog, encode: Callable[[bytes], bytes]) -> None:
    """Send `pcm` in chunks at wall-clock pace: a chunk leaves once its last sample would
    have been captured by a live source."""
    n = len(pcm) // 2
    t0 = time.time()
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        await asyncio.sleep(max(0.0, t0 + end / SAMPLE_RATE - time.time()))
        log.add(end, time.time())
        await send(encode(pcm[2 * start : 2 * end]))


async def keep_live(send: Callable[[bytes], Awaitable[None]], chunk: int,
                    encode: Callable[[bytes], bytes], stop: asyncio.Event) -> None:
    """After the played audio, go on sending silence at wall-clock pace until `stop`, as
    a live source does: a room's encoder does not stop when the speaker does. Without it
    the end of the test reads as a source stall (the session manager fills the silence
    it waits for: 1 "stall" and 1.5 s of filler per stream in bench.e2e, all of it after
    the last chunk). Not logged in the leg's SendLog: it is not audio to measure."""
    silence = encode(bytes(2 * chunk))
    t0 = time.time()
    sent = 0
    while not stop.is_set():
        sent += chunk
        await asyncio.sleep(max(0.0, t0 + sent / SAMPLE_RATE - time.time()))
        if stop.is_set():
            break
        await send(silence)


@dataclass
class Leg:
    """What one system produced: finals as (arrival wall, audio end s, text)."""

    name: str
    finals: list[tuple[float, float, str]] = field(default_factory=list)
    sent: SendLog = field(default_factory=SendLog)
    cpu_s: float = 0.0
    open_text: str = ""  # the latest text not yet final
    last_message: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


async def drain(leg: Leg, done: asyncio.Event) -> None:
    """Wait until nothing is left open and nothing has arrived for QUIET_S, at most
    MAX_DRAIN_S (WhisperLive's own client waits for 15 s without a new response)."""
    deadline = time.monotonic() + MAX_DRAIN_S
    while time.monotonic() < deadline:
        quiet = time.time() - max(leg.last_message, leg.sent.walls[-1]) >= QUIET_S
        if quiet and not leg.open_text:
            break
        await asyncio.sleep(0.2)
    done.set()
