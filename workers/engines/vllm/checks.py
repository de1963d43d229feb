"""What the `vllm` engine checks once its AsyncLLM is up, before it takes a session.

Fail closed (issue #33): every lever the engine's budget counts on is checked at start,
on the engine that will serve, not only in a benchmark. A lever whose check fails is off
and health says why (`describe()`); a setting the engine cannot honour refuses the start,
with a non-retryable `EngineError` that says which setting to change:
- **Re-anchoring**: the plugin worker's probe, and room for it below max_model_len;
  otherwise sessions roll over, and `engine_mode_why` says why.
- **Session slots**: the KV cache must hold every stream once sessions have aged. On the
  H200 an engine whose cache filled gave its sessions no steps at all, so fewer aged
  sessions than streams refuse the start; fewer than streams + rollover headroom shrink
  the headroom.
- **CUDA MPS**: on only when a server of the daemon has this engine's engine core among
  its clients (an engine that created its CUDA context before the daemon ran, or under
  another pipe directory, runs without MPS however the daemon answers).
- **Direct chunk input**: the builder's inputs compared with vLLM's renderer's, byte for
  byte, on a second of faint noise; any difference keeps the renderer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from workers.aio import wait_for
from workers.engines.base import EngineError
from workers.engines.vllm.mps import mps_advice, mps_refused, mps_unserved
from workers.engines.vllm.options import (
    REANCHOR_TESTED,
    SLACK_POSITIONS,
    StreamGeometry,
    VllmEngineOptions,
    headroom,
    wants_direct,
)
from workers.engines.vllm.reanchor.plan import Geometry

log = logging.getLogger(__name__)

WHY_CHARS = 200
"""A reason that health and `babelcast status` show is cut to this many characters: a
mismatch or an exception can be long (a repr of token ids), a status line cannot."""
DIRECT_CHECK_S = 60.0
"""The direct-input check builds ~30 prompts both ways (~1 ms each on the H200); a check
that has not answered in a minute is a renderer that hangs, and the engine renders."""
ENGINE_CORE_TITLE = "EngineCore"
"""vLLM titles its engine-core process so ("VLLM::EngineCore…", setproctitle)."""


def bounded(why: str, limit: int = WHY_CHARS) -> str:
    return why if len(why) <= limit else why[: limit - 1] + "…"


class CheckedBackend(Protocol):
    """What the start checks ask of a started backend (`_AsyncLLMBackend`, or a fake)."""

    version: str
    reanchor_requested: bool

    async def probe(self) -> dict[str, Any]: ...

    async def check_direct(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class StartReport:
    """What the checks decided; the engine takes it over whole."""

    probe: dict[str, Any]
    reanchoring: bool
    mode_why: str | None  # why sessions roll over although re-anchoring was asked for
    kv_sessions: int | None
    session_slots: int
    mps_served: bool
    mps_why: str | None  # why not, where a daemon answered
    direct_input: bool
    direct_why: str | None  # why not, where it was wanted


def kv_sessions(probe: dict[str, Any]) -> int | None:
    """Sessions older than every attention window that the engine's KV cache holds, from
    its worker's probe (`kv_blocks`, `block_sizes`, `windows`); None where unknown."""
    try:
        geometry = Geometry(tuple(int(b) for b in probe["block_sizes"]),
                            tuple(None if w is None else int(w) for w in probe["windows"]))
        return geometry.sessions_by_kv(int(probe["kv_blocks"]))
    except (KeyError, TypeError, ValueError):
        return None


MORE_CACHE = ("give each engine more cache (engine.vllm.kv_cache_dtype fp8, a higher "
              "engine.vllm.gpu_memory_utilization, fewer engine.vllm.engines_per_gpu)")


def kv_shortfall(slots: int, streams: int, held: int | None) -> str | None:
    """What to tell the operator when the session slots outnumber the aged sessions the KV
    cache holds (None: it holds them all). Young sessions hold less, so it shows only once
    sessions have aged (about 11 minutes for the decoder's 8,192-position window): then a
    session that needs a block waits for one. On the H200 an engine whose cache filled gave
    its sessions no steps."""
    if held is None or slots <= held:
        return None
    cache = (f"its KV cache holds ~{held} sessions once they are older than the attention "
             f"windows")
    if held < streams:
        return (f"{cache}, fewer than its {streams} streams, so the engine does not start: "
                f"lower engine.streams_per_actor to {held} or less, or {MORE_CACHE}")
    return (f"{cache}, fewer than its {slots} session slots ({streams} streams + headroom): "
            f"its slots are capped at {held}, so warm rollovers and restarts beyond "
            f"{held - streams} at once wait for a slot; to keep the headroom, lower "
            f"engine.streams_per_actor, or {MORE_CACHE}")


def session_slots(slots: int, streams: int, held: int | None, bound: bool = True) -> int:
    """The sessions the engine may open at once: its `slots`, capped at the aged sessions
    its KV cache holds (`held`); refused when that is fewer than its streams. With
    `bound` False (benchmarks that measure past the product's bound) it only warns."""
    said = kv_shortfall(slots, streams, held)
    if said is None or held is None:
        return slots
    if not bound:
        log.warning("vllm engine (slots not bound by the KV cache, a benchmark): %s", said)
        return slots
    if held < streams:
        raise EngineError(f"vllm engine: {said}", retryable=False)
    log.warning("vllm engine: %s", said)
    return held


def no_room(probe: dict[str, Any], o: VllmEngineOptions, g: StreamGeometry) -> str | None:
    """Re-anchoring keeps a session under max_model_len only if the window, one interval
    and the padding fit below it (None: they do)."""
    keep, unit = int(probe.get("keep") or 0), int(probe.get("unit") or 0)
    need = keep + max(o.reanchor_every, unit) + unit + g.right_pad
    if need + SLACK_POSITIONS >= o.max_model_len:
        return (f"max_model_len {o.max_model_len} leaves no room to re-anchor "
                f"(window {keep} + interval + padding = {need})")
    return None


def engine_core_pids(probe: dict[str, Any]) -> list[int]:
    """This engine's engine-core process: the plugin worker's pid (its probe), else this
    process's children that vLLM titled "EngineCore" (psutil, a vLLM dependency)."""
    pid = probe.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return [pid]
    try:
        import psutil
    except ImportError:
        return []
    found: list[int] = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (ENGINE_CORE_TITLE in child.name()
                    or any(ENGINE_CORE_TITLE in arg for arg in child.cmdline())):
                found.append(child.pid)
        except psutil.Error:  # gone, or not ours to read: not our engine core
            continue
    return found


async def check_mps(o: VllmEngineOptions, pids: Collection[int], daemon: bool
                    ) -> tuple[bool, str | None]:
    """Whether CUDA MPS serves this engine; refused where the operator said it would
    (`cuda_mps`) and it does not. `daemon`: a control daemon answered before the start."""
    why = await asyncio.to_thread(mps_unserved, pids)
    if why is None:
        return True, None
    if o.cuda_mps:
        raise EngineError(mps_refused(why), retryable=False)
    advice = mps_advice(o.engines_per_gpu, on=False)
    if advice:
        log.warning("vllm engine: %s (%s)", advice, why)
    return False, bounded(why) if daemon else None


async def check_direct(backend: CheckedBackend, o: VllmEngineOptions
                       ) -> tuple[bool, str | None]:
    """Direct chunk input where it is wanted and its inputs equal the renderer's now."""
    if not wants_direct(o, backend.version):
        return False, None
    try:
        report = await wait_for(backend.check_direct(), DIRECT_CHECK_S)
    except Exception as exc:
        why = f"its check failed: {type(exc).__name__}: {exc}"
    else:
        if report.get("equal"):
            return True, None
        mismatches = report.get("mismatches") or []
        why = (str(mismatches[0]) if mismatches
               else f"its check built {report.get('prompts', 0)} prompts")
    why = bounded(why)
    log.warning("vllm engine: direct chunk input is off, chunks go through vLLM's renderer: "
                "the two differ on this engine (%s)", why)
    return False, why


async def check_start(backend: CheckedBackend, o: VllmEngineOptions, g: StreamGeometry,
                      *, daemon: bool) -> StartReport:
    """Every check, in the order that refuses soonest; raises EngineError to refuse."""
    probe: dict[str, Any] = {}
    reanchoring = False
    if backend.reanchor_requested:
        try:
            probe = dict(await backend.probe())
        except Exception as exc:  # the plugin worker did not load: roll over instead
            probe = {"supported": False, "why_not": f"{type(exc).__name__}: {exc}"}
        reanchoring = bool(probe.get("supported"))
        crowded = no_room(probe, o, g) if reanchoring else None
        if crowded:
            probe["why_not"], reanchoring = crowded, False
    if reanchoring or o.reanchor == "off":
        mode_why = None
    elif backend.reanchor_requested:
        mode_why = bounded(str(probe.get("why_not") or "its probe said no"))
    elif o.reanchor == "auto" and backend.version not in REANCHOR_TESTED:
        mode_why = (f"vLLM {backend.version} is not a version the plugin was run on "
                    f"({', '.join(REANCHOR_TESTED)})")
    else:
        mode_why = f"vLLM {backend.version} has no scheduler_cls/worker_cls"
    held = kv_sessions(probe)
    log.info("vllm %s engine: %s (%s), KV cache for %s aged sessions", backend.version,
             "reanchor" if reanchoring else "rollover", mode_why or "ok",
             held if held is not None else "unknown")
    slots = session_slots(o.max_streams + headroom(o), o.max_streams, held, o.kv_bound_slots)
    served, mps_why = await check_mps(o, engine_core_pids(probe), daemon)
    direct, direct_why = await check_direct(backend, o)
    return StartReport(probe=probe, reanchoring=reanchoring, mode_why=mode_why,
                       kv_sessions=held, session_slots=slots, mps_served=served,
                       mps_why=mps_why, direct_input=direct, direct_why=direct_why)
