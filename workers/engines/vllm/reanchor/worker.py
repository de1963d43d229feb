"""vLLM GPU worker that re-rotates cached keys (loaded by vLLM as `worker_cls`).

Before each step's forward pass it applies the re-anchors that the scheduler attached to
the step (`scheduler.REANCHORS_ATTR`): for every attention layer of every KV cache
group, the keys of the request's live blocks are rotated by R(−D·s), where s is the
layer's rope positions per session position (1 for the decoder, `block_pool_size` for
Voxtral's pooled encoder). Runner-agnostic: the caches are found through the layers'
forward context, not through the model runner's own bookkeeping.

Supported where every KV cache group is a sliding window, every layer uses FlashAttention
with vLLM 0.26's cache layout ([blocks, heads, block_size, 2·head_dim], keys first), a
plain `RotaryEmbedding` and a cache dtype whose keys `rope.key_storage` can rotate (bf16,
or fp8 stored as bytes, rotated as fp8), and where this worker runs in the scheduler's
process (so a failed rotation can end its request). `babelcast_reanchor_probe()` (through
`collective_rpc`) says whether that holds; the client only asks for re-anchoring when it
does, and otherwise rolls sessions over and says why.

Fail closed: a rotation that raises leaves a request with some layers' keys moved and
others not. Its re-anchor is never retried (that would move the moved ones twice): the
request is reported to the scheduler, which ends it with an error before it decodes on
(scheduler.py), and counted (`rotation_failed`); the session manager replaces the session.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.worker.gpu_worker import Worker

from workers.engines.vllm.reanchor import melspec, scaled_weights, token_writes, window_trim
from workers.engines.vllm.reanchor.gather import ARRIVALS, GATHER
from workers.engines.vllm.reanchor.plan import Geometry, Reanchor
from workers.engines.vllm.reanchor.rope import RopeStyle, key_storage, unrotate_blocks_
from workers.engines.vllm.reanchor.scheduler import (
    FAILURES_ATTR,
    REANCHORS_ATTR,
    ROTATION_FAILURES,
)

log = logging.getLogger(__name__)
scaled_weights.register()  # the engine core loads the model after importing this module

ROPE_CLASSES = ("RotaryEmbedding",)  # plain RoPE; scaled variants change the angles
GAP_BIN_MS, GAP_MAX_MS = 5, 200
"""`step_gaps_ms`' bins: 5 ms wide, everything from 200 ms on in the last (idle time)."""


@dataclass(frozen=True, slots=True)
class _Layer:
    name: str
    group: int
    keys: torch.Tensor  # [blocks, block_size, heads, head_dim] view of the key half
    style: RopeStyle
    stored_as: torch.dtype | None = None  # the fp8 type a byte cache's keys hold


def _lever(switch: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """An engine-core lever's switch: never kill the engine core over an optimisation."""
    try:
        return switch()
    except Exception as exc:
        return {"on": False, "why_not": f"{type(exc).__name__}: {exc}"}


class ReanchorWorker(Worker):  # type: ignore[misc]
    _bc_layers_cache: list[_Layer] | None = None
    _bc_why_not: str | None = None
    _bc_issue_ms = 0.0  # CPU time spent issuing rotations (the GPU runs them async)

    # ---- setup ---------------------------------------------------------------
    def _bc_model(self) -> torch.nn.Module:
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        unwrap = getattr(model, "unwrap", None)
        return unwrap() if callable(unwrap) else model  # type: ignore[no-any-return]

    def _bc_geometry(self) -> Geometry:
        groups = self.model_runner.kv_cache_config.kv_cache_groups
        return Geometry(tuple(int(g.kv_cache_spec.block_size) for g in groups),
                        tuple(getattr(g.kv_cache_spec, "sliding_window", None) for g in groups))

    def _bc_layers(self) -> list[_Layer]:
        if self._bc_layers_cache is not None:
            return self._bc_layers_cache
        layers: list[_Layer] = []
        why: str | None = None
        try:
            why = self._bc_geometry().why_not()
            # Attention layer → the rotary embedding of the module that holds it. By
            # object, not by name: a layer's registered name (its constructor prefix)
            # is not always its module path (Voxtral's encoder layers differ).
            ropes: dict[int, Any] = {}
            for module in self._bc_model().modules():
                rope, attn = getattr(module, "rotary_emb", None), getattr(module, "attn", None)
                if rope is not None and attn is not None:
                    ropes[id(attn)] = rope
            context = self.vllm_config.compilation_config.static_forward_context
            groups = self.model_runner.kv_cache_config.kv_cache_groups
            for gi, group in enumerate(groups):
                for name in group.layer_names:
                    layer, problem = self._bc_layer(gi, name, context, ropes)
                    if problem:
                        why = why or problem
                    elif layer is not None:
                        layers.append(layer)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is None and ROTATION_FAILURES.scheduler_pid != os.getpid():
            why = ("the worker does not run in the scheduler's process (a failed rotation "
                   "could not end its request): re-anchoring needs vLLM's single-process "
                   "executor")
        self._bc_why_not = why
        self._bc_layers_cache = [] if why else layers
        return self._bc_layers_cache

    @staticmethod
    def _bc_layer(group: int, name: str, context: dict[str, Any],
                  ropes: dict[int, Any]) -> tuple[_Layer | None, str | None]:
        attn = context.get(name)
        if attn is None:
            return None, f"{name}: not in the forward context"
        backend = attn.attn_backend.get_name() if hasattr(attn, "attn_backend") else "?"
        if backend != "FLASH_ATTN":
            return None, f"{name}: attention backend {backend} (FLASH_ATTN needed)"
        head = int(attn.head_size)
        kv = attn.kv_cache
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[-1] != 2 * head:
            return None, f"{name}: unexpected KV cache layout {getattr(kv, 'shape', None)}"
        rope = ropes.get(id(attn))
        if rope is None or type(rope).__name__ not in ROPE_CLASSES:
            return None, f"{name}: rope {type(rope).__name__} is not plain RoPE"
        stored_as, why = key_storage(kv.dtype, str(getattr(attn, "kv_cache_dtype", "auto")))
        if why:
            return None, f"{name}: {why}"
        style = RopeStyle(rotary_dim=int(rope.rotary_dim), base=float(rope.base),
                          neox=bool(rope.is_neox_style),
                          position_scale=int(getattr(attn, "block_pool_size", 1)))
        keys = kv.transpose(1, 2)[..., :head]  # the flash-attn kernel's own key split
        return _Layer(name, group, keys, style, stored_as), None

    # ---- client calls (collective_rpc) ---------------------------------------
    def babelcast_reanchor_probe(self) -> dict[str, Any]:
        layers = self._bc_layers()
        ok = bool(layers) and self._bc_why_not is None
        out: dict[str, Any] = {"supported": ok, "why_not": self._bc_why_not,
                               "layers": len(layers), "pid": os.getpid(),
                               "kv_cache_dtype": str(self.vllm_config.cache_config.cache_dtype),
                               "key_storage": sorted({str(ly.stored_as or ly.keys.dtype)
                                                      for ly in layers})}
        try:
            g = self._bc_geometry()
            out.update(block_sizes=list(g.block_sizes), windows=list(g.windows),
                       unit=g.unit if ok else None, keep=g.keep if ok else None,
                       max_model_len=int(self.vllm_config.model_config.max_model_len),
                       styles=sorted({(ly.style.rotary_dim, ly.style.neox,
                                       ly.style.position_scale) for ly in layers}))
        except Exception as exc:
            out["geometry_error"] = f"{type(exc).__name__}: {exc}"
        try:  # the engine warns when its sessions, aged, would not fit (vllm/engine.py)
            out["kv_blocks"] = int(self.model_runner.kv_cache_config.num_blocks)
        except Exception as exc:
            out["kv_blocks_error"] = f"{type(exc).__name__}: {exc}"
        return out

    def babelcast_melspec(self, on: bool) -> dict[str, Any]:
        """The encoder's spectrogram without a GPU wait per audio item (melspec.py)."""
        return _lever(lambda: melspec.switch(self._bc_model(), bool(on)))

    def babelcast_token_writes(self, on: bool) -> dict[str, Any]:
        """A streaming session's token history staged once, not at every chunk
        (token_writes.py)."""
        return _lever(lambda: token_writes.switch(self.model_runner, bool(on)))

    def babelcast_window_trim(self, on: bool | str) -> dict[str, Any]:
        """FlashAttention handed only the keys ("keys") or blocks ("blocks") each session's
        window sees; True: the best that passes its check (window_trim.py)."""
        mode = on if isinstance(on, str) else bool(on)
        return _lever(lambda: window_trim.switch(mode, self.device, self._bc_kv_dtype()))

    def babelcast_tick_gather(self, window_ms: float) -> dict[str, Any]:
        """An idle engine's first step of a tick held up to `window_ms` for the tick's
        other chunks (gather.py; the scheduler, in this process, reads it); 0: off."""
        return _lever(lambda: GATHER.switch(float(window_ms)))

    def babelcast_window_trim_calls(self) -> dict[str, int]:
        """FlashAttention calls with a pad and without, since "keys" was switched on."""
        return dict(window_trim.CALLS)

    def _bc_kv_dtype(self) -> torch.dtype:
        cache = str(self.vllm_config.cache_config.cache_dtype)
        if cache.startswith("fp8"):
            from vllm.platforms import current_platform

            return current_platform.fp8_dtype()  # type: ignore[no-any-return]
        return torch.bfloat16

    def babelcast_reanchor_stats(self) -> dict[str, Any]:
        """`deferred`: re-anchors the scheduler put off (a step in flight, a feature in the
        way…), tried again at the request's next chunk; `rotation_failed`: rotations that
        raised, each request ended (fail closed; `requests_ended`), as is each re-anchored
        request vLLM preempted (`preempted_ended`); `live_blocks`: the KV blocks each
        request's last re-anchor re-rotated, per cache group (constant once it is older
        than every window); `steps`, `step_requests`: engine steps that scheduled any
        request, and the requests they scheduled (their ratio: how well steps batch);
        `step_sizes`: those steps counted by how many requests each scheduled (a mean of
        12.5 may be every step at 12 or 13, or steps of 20 and 5); `step_gaps_ms`: the time
        from one such step's start to the next's, in 5 ms bins (two steps per 80 ms cycle
        at 40 and 40, or at 10 and 70); `tick_gather`: the gather's window and counts;
        `tick_arrivals`: when the scheduler saw each chunk after its tick's first
        (gather.py)."""
        return {"reanchors": self._bc_counts()["reanchors"],
                "issue_ms": round(self._bc_issue_ms, 3),
                "deferred": dict(self._bc_failures()),
                "rotation_failed": self._bc_counts()["rotation_failed"],
                "steps": self._bc_counts()["steps"],
                "step_requests": self._bc_counts()["step_requests"],
                "step_sizes": {str(k): v for k, v in sorted(self._bc_sizes().items())},
                "step_gaps_ms": {str(k): v for k, v in sorted(self._bc_gaps().items())},
                "requests_ended": ROTATION_FAILURES.ended,
                "preempted_ended": ROTATION_FAILURES.preempted_ended,
                "shift_by_request": dict(self._bc_shifts()),
                "live_blocks": {rid: list(v) for rid, v in self._bc_live().items()},
                "token_writes": token_writes.counts(self.model_runner),
                "tick_gather": GATHER.counts(),
                "tick_arrivals": ARRIVALS.counts()}

    def babelcast_fail_next_rotation(self, times: int = 1) -> dict[str, Any]:
        """FAULT INJECTION, GPU tier only: the next `times` rotations raise, as a rotation
        that runs out of GPU memory would (the fail-closed path end to end)."""
        self._bc_fail_next = int(times)
        return {"armed": self._bc_fail_next}

    # ---- per step --------------------------------------------------------------
    def _bc_counts(self) -> Counter[str]:
        if not hasattr(self, "_bc_counter"):
            self._bc_counter: Counter[str] = Counter()
        return self._bc_counter

    def _bc_sizes(self) -> Counter[int]:
        if not hasattr(self, "_bc_size_counter"):
            self._bc_size_counter: Counter[int] = Counter()
        return self._bc_size_counter

    def _bc_gaps(self) -> Counter[int]:
        if not hasattr(self, "_bc_gap_counter"):
            self._bc_gap_counter: Counter[int] = Counter()
        return self._bc_gap_counter

    _bc_last_step = 0.0

    def _bc_failures(self) -> Counter[str]:
        if not hasattr(self, "_bc_failure_counter"):
            self._bc_failure_counter: Counter[str] = Counter()
        return self._bc_failure_counter

    def _bc_shifts(self) -> dict[str, int]:
        if not hasattr(self, "_bc_shift_map"):
            self._bc_shift_map: dict[str, int] = {}
            self._bc_done: set[int] = set()
        return self._bc_shift_map

    def _bc_live(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "_bc_live_map"):
            self._bc_live_map: dict[str, tuple[int, ...]] = {}
        return self._bc_live_map

    _bc_fail_next = 0

    def _bc_rotate(self, layers: list[_Layer], r: Reanchor) -> None:
        """Every layer's live keys of one request by R(−shift) (or, for a negative
        control, wrongly as `r.fault` says)."""
        if self._bc_fail_next > 0:
            self._bc_fail_next -= 1
            raise RuntimeError("injected rotation failure (babelcast_fail_next_rotation)")
        for layer in layers:
            blocks = list(r.block_ids[layer.group])
            style, shift = layer.style, r.shift
            if r.fault == "garbage":
                _garbage_(layer, blocks)
                continue
            if r.fault == "sign":
                shift = -shift
            elif r.fault == "block":
                shift -= self._bc_geometry().unit  # one KV block unit short
            elif r.fault == "encoder_x1" and style.position_scale != 1:
                style = RopeStyle(style.rotary_dim, style.base, style.neox, 1)
            unrotate_blocks_(layer.keys, blocks, style, shift, stored_as=layer.stored_as)

    def _bc_apply(self, scheduler_output: Any) -> None:
        shifts = self._bc_shifts()
        for rid in scheduler_output.finished_req_ids:
            shifts.pop(rid, None)
            self._bc_live().pop(rid, None)
        for reason in (getattr(scheduler_output, FAILURES_ATTR, None) or {}).values():
            self._bc_failures()[reason.split(":")[0][:80]] += 1
        todo: tuple[Reanchor, ...] = getattr(scheduler_output, REANCHORS_ATTR, ())
        if not todo:
            return
        layers = self._bc_layers()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for r in todo:
                if r.seq in self._bc_done:
                    continue  # carried again by a later step; applied once
                self._bc_done.add(r.seq)  # never retried: part of it may have been applied
                try:
                    if not layers:
                        raise RuntimeError(f"no layers to rotate ({self._bc_why_not})")
                    self._bc_rotate(layers, r)
                except Exception:
                    log.exception("babelcast: rotating the keys of %s failed; the request "
                                  "is ended", r.request_id)
                    self._bc_counts()["rotation_failed"] += 1
                    ROTATION_FAILURES.report(r.request_id)
                    continue
                shifts[r.request_id] = shifts.get(r.request_id, 0) + r.shift
                self._bc_live()[r.request_id] = tuple(len(b) for b in r.block_ids)
                self._bc_counts()["reanchors"] += 1
        if len(self._bc_done) > 4096:  # sequence numbers only grow
            newest = max(self._bc_done)
            self._bc_done = {s for s in self._bc_done if s > newest - 1024}
        self._bc_issue_ms += (time.perf_counter() - t0) * 1000

    def execute_model(self, scheduler_output: Any) -> Any:
        scheduled = len(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        if scheduled:  # steps and the requests they carried: how well steps batch
            counts = self._bc_counts()
            counts["steps"] += 1
            counts["step_requests"] += scheduled
            self._bc_sizes()[scheduled] += 1
            now = time.monotonic()
            if self._bc_last_step:
                self._bc_gaps()[min(GAP_MAX_MS, int((now - self._bc_last_step) * 1000)
                                    // GAP_BIN_MS * GAP_BIN_MS)] += 1
            self._bc_last_step = now
        try:
            self._bc_apply(scheduler_output)
        except Exception:  # never kill the engine core over bookkeeping
            log.exception("babelcast: applying the step's re-anchors failed")
            self._bc_counts()["rotation_failed"] += 1
            for r in getattr(scheduler_output, REANCHORS_ATTR, ()):
                ROTATION_FAILURES.report(r.request_id)  # fail closed: end them all
        return super().execute_model(scheduler_output)


def _garbage_(layer: _Layer, blocks: list[int]) -> None:
    """NEGATIVE CONTROL: the listed blocks' keys replaced by noise of the keys' own scale
    (what any key corruption that keeps keys finite looks like to attention)."""
    if not blocks:
        return
    idx = torch.tensor(blocks, dtype=torch.long, device=layer.keys.device)
    store = layer.keys.view(torch.uint8) if layer.stored_as is not None else layer.keys
    held = store.index_select(0, idx)
    as_float = (held.view(layer.stored_as) if layer.stored_as is not None else held).float()
    noise = torch.randn_like(as_float) * as_float.std().clamp(min=1e-3)
    if layer.stored_as is not None:
        limit = torch.finfo(layer.stored_as).max
        new = noise.clamp(-limit, limit).to(layer.stored_as).view(torch.uint8)
    else:
        new = noise.to(held.dtype)
    store.index_copy_(0, idx, new)
