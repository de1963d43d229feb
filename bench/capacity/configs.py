"""The capacity bench's configurations: their names (`stock`, `project…-xN`, the levers
`+melspec`, `+tokens`, `+trim`, `+keys`, `+gather`, `+pin`), what each runs on (front ends, path,
feed, levers) and which may share an in-phase A/B.
"""

from __future__ import annotations

import json
from typing import Any

_PROJECT = ("project", "project-direct",
            *(f"{c}-x{k}" for k in (2, 3, 4) for c in ("project", "project-direct")))
MELSPEC = "+melspec"
"""A configuration with this suffix runs with the engine cores' sync-free spectrogram
(engine.vllm.sync_free_melspec), switched per phase on the same engines: the A/B is
same run, same engines."""
TOKENS = "+tokens"
"""…with the engine cores' incremental token-history writes
(engine.vllm.incremental_token_writes), switched per phase the same way."""
TRIM = "+trim"
"""…with FlashAttention handed only the blocks each window sees (engine.vllm.window_trim
"blocks"), switched per phase the same way."""
KEYS = "+keys"
"""…with FlashAttention handed only the keys each window sees (engine.vllm.window_trim
"keys"), switched per phase the same way."""
GATHER = "+gather"
"""…with an idle engine's first step of a tick held for the tick's other chunks, up to
GATHER_MS (engine-core lever, workers/engines/vllm/reanchor/gather.py), switched per
phase the same way. First run on one H100 engine (bench/results/gather_h100/: one step
a tick instead of two, 1.94 x less engine-core CPU per chunk); its worth at the knee is a
strict level with it and the same level without it on one H200 host (the in-phase A/B of
bench.voxtral_capacity feeds in lock step, with no tick)."""
GATHER_MS = 5.0
"""The gather's window: at most this long after a tick's first chunk (6 % of the 80 ms
tick); `bench.capacity.strict --gather-ms` sets another. The front end sends a tick's
chunks one message each: at 25 new sessions on one H100 engine the count released 97 % of
the held ticks within it, at 48 aged sessions the window ran out in 99.7 % and the tick
still took two steps (bench/results/capacity_h100/, 2026-12-07)."""
PIN = "+pin"
"""…with each engine-core process on a physical core of its own (both of its hardware
threads) and the front ends and VAD helpers off those cores, switched per phase (or per
window of an in-phase A/B) from the front-end processes. Not an engine-core lever: the
host's scheduler is. Under MPS three engine cores each used a whole CPU at 112 aged, and
75 of 112 sessions were real time, two engines' worth of three (2026-12-03)."""
LEVERS = (MELSPEC, TOKENS, TRIM, KEYS, GATHER, PIN)
CONFIGS = ("stock", *_PROJECT,
           *(f"{c}{s}{p}" for c in _PROJECT
             for s in (MELSPEC, TOKENS, MELSPEC + TOKENS, MELSPEC + TOKENS + TRIM,
                       MELSPEC + TOKENS + KEYS, MELSPEC + TOKENS + KEYS + GATHER)
             for p in ("", PIN)))


def trim_of(config: str) -> str | bool:
    """The window_trim mode a configuration's phases run: "keys", "blocks" or off."""
    return "keys" if KEYS in config else "blocks" if TRIM in config else False


def base_of(config: str) -> str:
    """The configuration without its levers (`+melspec`, `+tokens`, `+trim`, `+keys`,
    `+gather`, `+pin`)."""
    while True:
        lever = next((x for x in LEVERS if config.endswith(x)), None)
        if lever is None:
            return config
        config = config.removesuffix(lever)


def engines_of(config: str) -> int:
    """Front ends a configuration runs on: N for `-xN`, else 1."""
    head, _, k = base_of(config).rpartition("-x")
    return int(k) if head and k.isdigit() else 1


def front_end_streams(f: int, configs: list[str], top: int, shared: bool) -> int:
    """Sessions front end `f` is sized for (its engine's `max_streams`, which vLLM turns into
    `max_num_seqs`). Front end 0, or 1 under `--share-front-end`, takes a one-engine
    configuration's every session; an -xN front end takes its share of the fewest-engine
    group's. vLLM reserves memory per sequence slot before it sizes the KV cache, so a front
    end sized for every session when no one-engine configuration runs on it would have
    fewer blocks than its peers (2026-12-02, x3 at 104 aged: front end 1 had 3,109 blocks,
    the two others 3,871, and its ageing filled it first)."""
    one = any(engines_of(c) == 1 for c in configs)
    if f == 0 or (shared and f == 1 and one):
        return top
    fewest = min((engines_of(c) for c in configs if engines_of(c) > 1), default=1)
    return -(-top // fewest)


def plan(config: str, shared: bool = False) -> list[tuple[int, str]]:
    """(front end, path) pairs that run a configuration; sessions split evenly. With
    `shared`, one-engine configurations run on front end 1 (no engine of their own)."""
    config = base_of(config)
    path = "direct" if "direct" in config else ("stock" if config == "stock" else "project")
    k = engines_of(config)
    return [(f, path) for f in range(1, k + 1)] if k > 1 else [(1 if shared else 0, path)]


def feed_of(config: str, production: bool, age_frames: int) -> str:
    """How a configuration's sessions are fed: vLLM's stock path is always fed as its
    server feeds it (new sessions: it cannot re-anchor, so it has no aged steady state).
    Aged with `--production`: through the session manager and VAD, each stream's engine
    session aged first."""
    if config == "stock":
        return "plain"
    if age_frames:
        return "aged-production" if production else "aged"
    return "production" if production else "plain"


def levers_of(config: str) -> dict[str, Any]:
    """The levers a configuration's phases run (the engine core's four, and pinning);
    `gather` is the gather's window in ms, 0 for off."""
    return {"melspec": MELSPEC in config, "tokens": TOKENS in config, "trim": trim_of(config),
            "gather": GATHER_MS if GATHER in config else 0.0, "pin": PIN in config}


def ab_refusal(configs: list[str], windows: int) -> str | None:
    """Why these configurations cannot share an in-phase A/B, else None."""
    if len(configs) < 2:
        return "needs two or more of the project's configurations"
    if len({base_of(c) for c in configs}) != 1:
        return ("the configurations must differ only in +melspec, +tokens, +trim, +keys, "
                "+gather or +pin")
    if len({json.dumps(levers_of(c), sort_keys=True) for c in configs}) != len(configs):
        return "two configurations run the same levers"
    if windows < 2 * len(configs):
        return f"{windows} windows give some configuration fewer than two"
    return None


def ab_windows(configs: list[str], windows: int) -> list[dict[str, Any]]:
    """The in-phase A/B's windows: the configurations' levers in turn (A B A B …)."""
    return [levers_of(configs[j % len(configs)]) for j in range(windows)]
