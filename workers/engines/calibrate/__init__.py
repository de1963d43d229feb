"""How many streams an embedded engine keeps in real time on the host it runs on.

A constant per core (`orchestrator/capacity.py`: 1.5 whisper-base streams per core) holds
on the machine it was measured on and not on a slower one (issue 37: a second 2-core host
gave final p50 3.2-3.8 s and stalls at the default). So the figure is measured here:
`measure()` plays `CALIBRATION_S` of real speech (the reference set's second room)
through a session of the started engine, in lock step (each chunk once the one before it
is decoded, so the figure is the work of one stream, not how long it waited), and reads
the decode thread's busy seconds per audio second: `busy_per_stream`, the share of the
one decode thread that one speaking stream takes with these options (its interims, its
final passes with their beam, prompt and context). Every stream of an actor shares that
thread, so

    streams = floor(TARGET_BUSY / busy_per_stream)

`TARGET_BUSY` keeps headroom: a final waits for the decode before it (finals go first,
but one interim may be running), and the rest of the actor (Silero, the event loop, Ray,
the gateway) takes the same cores. Speech with pauses costs less than the calibration's
continuous reading, which leaves more room still.

A measurement costs a few seconds (the speech is ~12 s, decoded ~3-6x faster than real
time on 2 cores: 4.5 s with the model load on the development host), so it is cached
(`cache_path()`, JSON; `$BABELCAST_CALIBRATION_CACHE` names another file) under a key of
everything that changes it: the CPU model and count, the CTranslate2 version, the model
and the engine options that set the work per stream. `calibration(...)` returns the
cached figure while it is younger than `MAX_AGE_S`, else measures and caches. A figure
measured while the host was busy with other work is low; delete the file (or pass
`refresh`) to measure again.

The engine (`workers.engines.embedded`) calibrates itself at start when its options ask
for it, so this module knows it only as a `CalibratedEngine`. `python -m
workers.engines.calibrate` (`__main__.py`) starts an engine and prints its figure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from workers.engines.base import RecognizeSession, SessionOptions
from workers.engines.embedded_options import EmbeddedEngineOptions
from workers.engines.embedded_session import EmbeddedWhisperSession
from workers.events import SAMPLE_RATE, AudioChunk

TARGET_BUSY = 0.7
"""Share of the decode thread the calibrated streams may take together."""
CALIBRATION_S = 12.0
SPEECH = Path(__file__).resolve().parents[3] / "examples" / "audio" / "room-b.flac"
"""The reference set's second room (LibriVox, public domain): a reader with pauses, as a
talk has."""
MAX_AGE_S = 30 * 86400.0
CHUNK = SAMPLE_RATE // 10
COST_FIELDS = ("model", "cpu_threads", "beam_size", "final_beam_size", "step_s", "pause_s",
               "max_window_s", "final_pass", "final_encode_s", "final_prompt_words",
               "final_context_s", "unfinished_pause_s", "final_beam_max_busy",
               "final_early_s", "part_on_time", "part_edge_s")
"""The engine options that change the decode work of one stream."""


class CalibratedEngine(Protocol):
    """What calibration needs of the engine (`EmbeddedWhisperEngine`, started): its
    options, an `EmbeddedWhisperSession` to play speech through, and its decode thread's
    busy seconds (`stats()["decode_busy_s"]`)."""

    @property
    def options(self) -> EmbeddedEngineOptions: ...

    def open_session(self, options: SessionOptions) -> RecognizeSession: ...

    def stats(self) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class Calibration:
    busy_per_stream: float
    """Decode-thread seconds per second of one stream's speech."""
    streams: int
    """Streams the engine keeps in real time (floor(TARGET_BUSY / busy_per_stream), ≥ 1)."""
    key: str
    measured_at: float
    """Unix time of the measurement."""
    cached: bool = False
    """Read from the cache, not measured by this process."""

    def status(self) -> dict[str, str]:
        """For the actor's status hash (`describe()`)."""
        return {"calibrated_streams": str(self.streams),
                "calibration_busy_per_stream": f"{self.busy_per_stream:.3f}",
                "calibration_measured_at": f"{self.measured_at:.0f}",
                "calibration_source": "cache" if self.cached else "measured"}


def streams_for(busy_per_stream: float, target: float = TARGET_BUSY) -> int:
    return max(1, math.floor(target / max(busy_per_stream, 1e-6) + 1e-9))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key(options: EmbeddedEngineOptions) -> str:
    """What the figure depends on: the host's CPU, the runtime and the cost options."""
    import ctranslate2

    cost = {f: getattr(options, f) for f in COST_FIELDS}
    return json.dumps({"cpu": _cpu_model(), "cores": os.cpu_count(),
                       "ctranslate2": ctranslate2.__version__, **cost}, sort_keys=True)


CACHE_ENV = "BABELCAST_CALIBRATION_CACHE"
"""A file path that replaces the host's cache (the test suite's own, so a figure measured
while the suite loads the host never lands in the user's cache)."""


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "babelcast" / "calibration.json"


def calibration_speech(path: Path = SPEECH) -> bytes:
    """The first `CALIBRATION_S` of `path` as PCM16, 16 kHz, mono (PyAV)."""
    import av

    out = bytearray()
    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
        for frame in container.decode(audio=0):
            for res in resampler.resample(frame):
                out += res.to_ndarray().tobytes()
    return bytes(out[: int(CALIBRATION_S * SAMPLE_RATE) * 2])


async def measure(engine: CalibratedEngine, pcm: bytes | None = None) -> Calibration:
    """Play speech through a session of the started `engine` in lock step and read how
    busy one stream keeps its decode thread."""
    pcm = calibration_speech() if pcm is None else pcm
    session = engine.open_session(SessionOptions("calibration", "en"))
    assert isinstance(session, EmbeddedWhisperSession)

    async def drain() -> None:
        async for _ in session:
            pass

    reader = asyncio.create_task(drain())
    before = engine.stats()["decode_busy_s"]
    try:
        for i in range(0, len(pcm), CHUNK * 2):
            await session.push(AudioChunk("calibration", i // 2, pcm[i : i + CHUNK * 2],
                                          time.time()))
            await session.decoded()
        await session.end_input()
        await reader
    finally:
        reader.cancel()
        await session.aclose()
    busy = (engine.stats()["decode_busy_s"] - before) / (len(pcm) / 2 / SAMPLE_RATE)
    return Calibration(round(busy, 4), streams_for(busy), host_key(engine.options),
                       time.time())


def cached(options: EmbeddedEngineOptions, path: Path | None = None,
           max_age_s: float = MAX_AGE_S, now: float | None = None) -> Calibration | None:
    """The cached figure for these options on this host, if young enough (no model load:
    cheap enough for a configuration default)."""
    path = path or cache_path()
    try:
        entries = json.loads(path.read_text())
        entry = entries[host_key(options)]
        cal = Calibration(float(entry["busy_per_stream"]), int(entry["streams"]),
                          host_key(options), float(entry["measured_at"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (now if now is not None else time.time()) - cal.measured_at > max_age_s:
        return None
    return cal


def store(cal: Calibration, path: Path | None = None) -> None:
    path = path or cache_path()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entry = {k: v for k, v in dataclasses.asdict(cal).items() if k not in ("key", "cached")}
    entries[cal.key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: actors starting together never read half a file


async def calibration(engine: CalibratedEngine, path: Path | None = None, *,
                      refresh: bool = False) -> Calibration:
    """The cached figure for `engine`'s options on this host, or a fresh measurement on
    the started `engine` (then cached)."""
    if not refresh:
        hit = cached(engine.options, path)
        if hit is not None:
            return hit
    cal = await measure(engine)
    store(cal, path)
    return cal
