"""vLLM scheduler with re-anchoring (loaded by vLLM as `scheduler_cls`, engine-core side).

Tested against vLLM 0.26.0 (the H200). Which requests re-anchor is the client's choice:
`SamplingParams.extra_args["babelcast_reanchor_every"]` (positions between re-anchors);
other requests are scheduled exactly as stock vLLM schedules them.

When a flagged streaming request receives its next chunk (`_update_request_as_session`)
and enough positions are out of every window, it is marked due. At the start of the
next `schedule()` — the request is waiting with its chunk queued and nothing in
flight — `plan` lowers its positions; the worker's instructions ride on that step's
`SchedulerOutput` (attribute `babelcast_reanchors`), which the worker applies before
the step's forward pass. Instructions stay attached until a step with tokens carries
them (a step without tokens may not reach the worker); the worker applies each one
once (by sequence number).

A request that cannot move now stays as it is and is tried again at its next chunk;
the reason goes to the worker (`babelcast_reanchor_failures`), which counts it as
deferred. Exceptions never leave this class: a failing re-anchor must not kill the engine
core.

Fail closed: a request whose keys the worker could not rotate (the rotation raised, part
of its layers moved and part not) must not decode on. Nor may a re-anchored request that
vLLM preempts: vLLM recomputes a preempted request from position 0, and after a re-anchor
that is its kept history only, without the dropped positions that gave the kept ones'
deeper layers their context; on the H200 (scaled test weights, bf16) such a recompute
left the logits further from a never-moved reference than garbage keys did (top-1 25 %,
|Δlogit| p50 0.69; bench/results/reanchor_exact_h200/). Both are ended with vLLM's
`FINISHED_ERROR` at the next `update_from_output` (the way vLLM ends a request whose
grammar failed to compile; a failed rotation's token of that step is dropped first: the
worker reports it through `ROTATION_FAILURES`), so the client sees
`finish_reason == "error"` and the session manager opens a fresh session, which starts as
the model was trained to. That needs the worker in this process: vLLM 0.26's single-GPU executor
(`UniProcExecutor`) runs it inside the engine core; the worker's probe refuses
re-anchoring where it does not share the scheduler's process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from workers.engines.vllm.options import KV_TRACE_ENV as TRACE_ENV
from workers.engines.vllm.reanchor.gather import ARRIVALS, GATHER
from workers.engines.vllm.reanchor.plan import (
    CannotReanchor,
    Geometry,
    Reanchor,
    apply,
    check,
    due,
    geometry_of,
)

log = logging.getLogger(__name__)

try:  # the tick gather's hold (gather.py); a vLLM without it keeps the gather off
    from vllm.v1.core.sched.interface import PauseState
except ImportError:  # pragma: no cover - vLLM 0.26 has it
    PauseState = None

EXTRA_ARG = "babelcast_reanchor_every"
FAULT_ARG = "babelcast_reanchor_fault"
"""NEGATIVE CONTROLS ONLY: a request's re-anchors rotate wrongly on purpose (plan.Reanchor
.fault says how); the GPU tier shows its exactness check fails on each."""
PREEMPT_ARG = "babelcast_test_preempt"
"""GPU TIER ONLY: preempt the request (vLLM's own `_preempt_request`, as KV pressure would)
at its next chunk once it has re-anchored and its rotation has been applied, at most this
many times. A re-anchored request that is preempted is ended (fail closed), so once."""
REANCHORS_ATTR = "babelcast_reanchors"
FAILURES_ATTR = "babelcast_reanchor_failures"


class RotationFailures:
    """The worker's word to the scheduler that a request's keys could not be rotated.
    Both run in the engine-core process; the worker may run a step in another thread of
    it (async scheduling), hence the lock. `scheduler_pid` says which process made a
    scheduler that reads it (the worker's probe compares it with its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self.scheduler_pid: int | None = None
        self.ended = 0  # requests ended for it, in this process
        self.preempted_ended = 0  # re-anchored requests ended when vLLM preempted them

    def report(self, request_id: str) -> None:
        with self._lock:
            self._ids.add(request_id)

    def take(self) -> set[str]:
        with self._lock:
            ids, self._ids = self._ids, set()
        return ids


ROTATION_FAILURES = RotationFailures()


def _extra(request: Any) -> dict[str, Any]:
    params = request.sampling_params
    extra = getattr(params, "extra_args", None) if params is not None else None
    return extra or {}


def reanchor_every(request: Any) -> int | None:
    every = _extra(request).get(EXTRA_ARG)
    return int(every) if every else None


class _ReanchorMixin:
    """Shared by the async and the synchronous scheduler below."""

    _bc_geometry: Geometry | None
    _bc_due: set[str]
    _bc_pending: list[Reanchor]
    _bc_failures: dict[str, str]
    _bc_seq: int
    _bc_trace: str | None
    _bc_trace_next: float
    _bc_steps: int  # trace only: steps with tokens since the last trace line
    _bc_batched: int  # trace only: requests those steps scheduled
    _bc_preempted: dict[str, int]  # test preemptions so far, by request
    _bc_preempt_due: set[str]  # asked for a test preemption at this chunk
    _bc_ended: dict[str, None]  # ended by a failed rotation, oldest first
    _bc_shifted: set[str]  # requests re-anchored at least once, not finished

    def _bc_init(self) -> None:
        folder = os.environ.get(TRACE_ENV)
        self._bc_trace = os.path.join(folder, f"kv-{os.getpid()}.jsonl") if folder else None
        self._bc_trace_next = 0.0
        self._bc_steps = self._bc_batched = 0
        self._bc_due = set()
        self._bc_pending = []
        self._bc_failures = {}
        self._bc_seq = 0
        self._bc_preempted = {}
        self._bc_preempt_due = set()
        self._bc_ended = {}
        self._bc_shifted = set()
        ROTATION_FAILURES.scheduler_pid = os.getpid()
        if not isinstance(getattr(self, "grammar_compile_error_reqs", None), set):
            # how a failed rotation ends its request (update_from_output); without it,
            # re-anchoring could not fail closed, so it stays off
            self._bc_geometry = None
            log.warning("babelcast re-anchoring is off in this engine: this vLLM's "
                        "scheduler has no grammar_compile_error_reqs to end a request with")
            return
        try:
            geometry = geometry_of(self._bc_managers())
            why = geometry.why_not()
        except Exception as exc:  # an unknown vLLM layout: re-anchoring stays off
            geometry, why = None, f"{type(exc).__name__}: {exc}"
        self._bc_geometry = geometry if why is None else None
        if why is not None:
            log.warning("babelcast re-anchoring is off in this engine: %s", why)

    def _bc_managers(self) -> tuple[Any, ...]:
        return tuple(self.kv_cache_manager.coordinator.single_type_managers)  # type: ignore[attr-defined]

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        super()._update_request_as_session(session, update)  # type: ignore[misc]
        geometry = self._bc_geometry
        if geometry is None:
            return
        every = reanchor_every(session)
        if every is not None and due(session.num_computed_tokens, geometry, every):
            self._bc_due.add(session.request_id)
        elif every is not None and PREEMPT_ARG in _extra(session):
            self._bc_preempt_due.add(session.request_id)

    def _bc_test_preempt(self) -> None:
        """GPU TIER ONLY (PREEMPT_ARG): preempt each re-anchored request that asked for it,
        at a chunk boundary with no rotation of it still pending, through vLLM's own
        preemption. Run where `_bc_reanchor_due` runs, at the start of `schedule()`, when
        such a request waits in the waiting queue; `_preempt_request` expects a running
        request, so it is marked running for that call only."""
        requests: dict[str, Any] = self.requests  # type: ignore[attr-defined]
        for rid in sorted(self._bc_preempt_due):
            self._bc_preempt_due.discard(rid)
            request = requests.get(rid)
            if request is None or request.status != RequestStatus.WAITING:
                continue
            limit = int(_extra(request).get(PREEMPT_ARG) or 0)
            if (rid not in self._bc_shifted or self._bc_preempted.get(rid, 0) >= limit
                    or any(r.request_id == rid for r in self._bc_pending)):
                continue
            self.waiting.remove_requests([request])  # type: ignore[attr-defined]
            self.skipped_waiting.remove_requests([request])  # type: ignore[attr-defined]
            request.status = RequestStatus.RUNNING
            self._preempt_request(request, time.monotonic())  # type: ignore[attr-defined]
            # vLLM schedules nothing from the waiting queue in a step that preempted (its
            # running loop's preemptions); this one comes before that loop, so it is kept
            # out of this step's waiting queue as vLLM would keep it
            self.waiting.remove_requests([request])  # type: ignore[attr-defined]
            self._bc_preempted[rid] = self._bc_preempted.get(rid, 0) + 1
            log.info("babelcast: test preemption of %s (%d)", rid, self._bc_preempted[rid])

    def _bc_end_preempted(self, rids: set[str]) -> None:
        """Re-anchored requests vLLM just preempted: ended with FINISHED_ERROR at the next
        model output instead of recomputed without their dropped context (module
        docstring)."""
        for rid in sorted(rids - self._bc_ended.keys()):
            self.grammar_compile_error_reqs.add(rid)  # type: ignore[attr-defined]
            self._bc_remember_ended(rid)
            self._bc_shifted.discard(rid)
            ROTATION_FAILURES.preempted_ended += 1
            log.warning("babelcast: ended %s: vLLM preempted it after re-anchors, and its "
                        "recompute would lack the dropped positions' context", rid)

    def _bc_remember_ended(self, rid: str) -> None:
        self._bc_ended[rid] = None
        while len(self._bc_ended) > 1024:  # the oldest have long been aborted
            del self._bc_ended[next(iter(self._bc_ended))]

    def add_request(self, request: Any) -> None:
        """A chunk that arrives for a request ended by a failed rotation (the client has
        not aborted it yet) would start a new request under its id, mid-stream: dropped."""
        rid = request.request_id
        if rid in self._bc_ended and rid not in self.requests:  # type: ignore[attr-defined]
            return
        ARRIVALS.arrived(time.monotonic())  # when the scheduler saw it (gather.py)
        super().add_request(request)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        failed = ROTATION_FAILURES.take()
        if failed:
            self._bc_end_failed(failed, model_runner_output)
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)

    def _bc_end_failed(self, failed: set[str], model_runner_output: Any) -> None:
        """Requests whose keys could not be rotated: this step's token (decoded with
        half-moved keys) is dropped, and vLLM ends them with FINISHED_ERROR, telling the
        client (it does so for a request whose grammar failed to compile)."""
        requests: dict[str, Any] = self.requests  # type: ignore[attr-defined]
        index = getattr(model_runner_output, "req_id_to_index", None) or {}
        sampled = getattr(model_runner_output, "sampled_token_ids", None)
        for rid in failed:
            request = requests.get(rid)
            if request is None or request.is_finished():
                continue
            i = index.get(rid)
            if i is not None and isinstance(sampled, list) and i < len(sampled):
                sampled[i] = []
            self.grammar_compile_error_reqs.add(rid)  # type: ignore[attr-defined]
            self._bc_remember_ended(rid)
            ROTATION_FAILURES.ended += 1
            self._bc_due.discard(rid)
            log.error("babelcast: ended %s: its cached keys could not be rotated", rid)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._bc_due:
            self._bc_reanchor_due()
        if self._bc_preempt_due:
            self._bc_test_preempt()
        held = GATHER.window_s > 0 and self._bc_hold()
        if held:  # vLLM's own pause of new work, for this call only (gather.py)
            paused = self._pause_state  # type: ignore[has-type]
            self._pause_state = PauseState.PAUSED_NEW
            try:
                out = super().schedule(*args, **kwargs)  # type: ignore[misc]
            finally:
                self._pause_state = paused
        else:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if GATHER.window_s > 0:
            GATHER.scheduled(len(out.num_scheduled_tokens))
        if self._bc_shifted:
            self._bc_shifted.difference_update(getattr(out, "finished_req_ids", ()) or ())
            preempted = (getattr(out, "preempted_req_ids", None) or set()) & self._bc_shifted
            if preempted:
                self._bc_end_preempted(preempted)
        if self._bc_trace is not None:
            if out.total_num_scheduled_tokens > 0:
                self._bc_steps += 1
                self._bc_batched += len(out.num_scheduled_tokens)
            if time.monotonic() >= self._bc_trace_next:
                self._bc_trace_next = time.monotonic() + 1.0
                self._bc_write_trace()
        if self._bc_pending:
            setattr(out, REANCHORS_ATTR, tuple(self._bc_pending))
            if out.total_num_scheduled_tokens > 0:
                self._bc_pending = []
        if self._bc_failures:
            setattr(out, FAILURES_ATTR, dict(self._bc_failures))
            if out.total_num_scheduled_tokens > 0:
                self._bc_failures = {}
        return out

    def _bc_hold(self) -> bool:
        """The tick gather's question (gather.py), from vLLM's own counts: requests
        waiting to be scheduled, streaming sessions parked without their next chunk,
        and whether any request is running. Never raises: an error turns it off."""
        try:
            if PauseState is None:
                raise RuntimeError("this vLLM's scheduler has no PauseState")
            if getattr(self, "_pause_state", None) != PauseState.UNPAUSED:
                return False  # paused by vLLM itself: not ours to touch
            parked = int(self.num_waiting_for_streaming_input)  # type: ignore[attr-defined]
            ready = (len(self.waiting) + len(self.skipped_waiting)  # type: ignore[attr-defined]
                     - parked)
            return GATHER.hold(time.monotonic(), ready, parked,
                               bool(self.running))  # type: ignore[attr-defined]
        except Exception as exc:
            log.warning("babelcast tick gather is off: %s", exc)
            GATHER.switch(0)
            return False

    def _bc_write_trace(self) -> None:
        """Benchmarks only (TRACE_ENV): where the KV cache is, and the steps with tokens
        since the last line with the requests they scheduled (how large steps are: each
        reads all the weights). Never raises. Streaming sessions waiting for their next
        chunk hold blocks without being running or waiting, so each group also counts the
        requests holding any."""
        try:
            pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
            groups = []
            for m in self._bc_managers():
                spec = m.kv_cache_spec
                per_request = [sum(1 for b in blocks if not b.is_null)
                               for blocks in m.req_to_blocks.values()]
                groups.append({"spec": type(spec).__name__, "block_size": spec.block_size,
                               "window": getattr(spec, "sliding_window", None),
                               "held": sum(per_request),
                               "requests": sum(1 for n in per_request if n)})
            line = {"t": time.time(), "blocks": pool.num_gpu_blocks,
                    "free": pool.get_num_free_blocks(),
                    "running": len(self.running),  # type: ignore[attr-defined]
                    "waiting": len(self.waiting),  # type: ignore[attr-defined]
                    "steps": self._bc_steps, "batched": self._bc_batched,
                    "groups": groups}
            self._bc_steps = self._bc_batched = 0
            assert self._bc_trace is not None
            with open(self._bc_trace, "a") as f:
                f.write(json.dumps(line) + "\n")
        except Exception as exc:
            log.warning("babelcast KV trace failed: %s", exc)
            self._bc_trace = None

    def _bc_reanchor_due(self) -> None:
        geometry = self._bc_geometry
        assert geometry is not None
        requests: dict[str, Any] = self.requests  # type: ignore[attr-defined]
        for rid in sorted(self._bc_due):
            request = requests.get(rid)
            if request is None or request.status != RequestStatus.WAITING:
                # Finished, or (unusually) scheduled already: try at its next chunk.
                self._bc_due.discard(rid)
                continue
            self._bc_due.discard(rid)
            try:
                managers = self._bc_managers()
                shift = check(request, managers, geometry)
                self._bc_seq += 1
                fault = _extra(request).get(FAULT_ARG)
                self._bc_pending.append(apply(
                    request, managers, self.encoder_cache_manager,  # type: ignore[attr-defined]
                    shift, self._bc_seq, str(fault) if fault else None))
                self._bc_shifted.add(rid)
            except CannotReanchor as exc:
                self._bc_failures[rid] = str(exc)
            except Exception as exc:
                log.exception("babelcast re-anchor of %s failed", rid)
                self._bc_failures[rid] = f"{type(exc).__name__}: {exc}"


class ReanchorAsyncScheduler(_ReanchorMixin, AsyncScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bc_init()


class ReanchorScheduler(_ReanchorMixin, Scheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bc_init()
