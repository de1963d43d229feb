"""The re-anchoring scheduler on vLLM's real scheduler objects (no GPU work): a real
`VllmConfig` for the Voxtral model folder, a real hybrid KV cache config (the decoder's
sliding window and the pooled encoder's, as vLLM groups them), the plugin's
`ReanchorAsyncScheduler`, and streaming requests fed chunk by chunk as AsyncLLM feeds
them — features with the placeholders vLLM gives them (39 positions for the first
prompt, then 2 per 80 ms chunk, overlapping by one) — with one sampled token per step.

At every step a model of the GPU runner's encoder cache (`EncoderCacheModel`) checks what
vLLM 0.26's V2 runner checks: every feature a scheduled query overlaps has been encoded
and not freed, else "Encoder cache miss" (which kills the engine core). Its negative
control puts the old shift rule back (a kept feature at offset -1) and must see the miss.

The tick gather (gather.py, `engine.vllm.tick_gather_ms`) is checked here too, on the
same objects: a tick's chunks arriving one by one go to the model in one step while
re-anchors happen, a late chunk costs its tick at most the window, an engine with a step
in flight is never held; its negative control is the same arrivals with the gather off.

Runs with the GPU tier (BABELCAST_VOXTRAL_DIR set; fails if vLLM is missing). It needs no
GPU: with vLLM installed on a CPU host it runs there too (tests/gpu/cpu_platform.py says
how).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.gpu.tier import gpu_tier

pytestmark = pytest.mark.gpu

MODEL_DIR = gpu_tier(tools=())  # no GPU work: vLLM's scheduler only

from workers.engines.vllm.reanchor import plan  # noqa: E402
from workers.engines.vllm.reanchor.scheduler import (  # noqa: E402
    FAILURES_ATTR,
    PREEMPT_ARG,
    REANCHORS_ATTR,
    ROTATION_FAILURES,
    ReanchorAsyncScheduler,
)

FIRST, CHUNK = 39, 2  # placeholder lengths vLLM 0.26 gives (mistral_common num_audio_tokens)


def scheduler(window: int, max_model_len: int, max_num_seqs: int = 4) -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = EngineArgs(model=MODEL_DIR, tokenizer_mode="mistral", config_format="mistral",
                     load_format="dummy", max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs,
                     enable_prefix_caching=False, limit_mm_per_prompt={"audio": 1},
                     enforce_eager=True, max_num_batched_tokens=2048,
                     async_scheduling=True).create_engine_config()
    specs: dict[str, Any] = {}
    for i in range(4):  # Voxtral's two kinds of layers (fewer of each: same grouping)
        specs[f"language_model.model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
            sliding_window=window)
        specs[f"whisper_encoder.whisper_encoder.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=128, head_size=64, dtype=torch.bfloat16,
            sliding_window=189)
    kvc = get_kv_cache_configs(cfg, [specs], [4 << 30])[0]
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    bs, hbs = resolve_kv_cache_block_sizes(kvc, cfg)
    return ReanchorAsyncScheduler(vllm_config=cfg, kv_cache_config=kvc,
                                  structured_output_manager=StructuredOutputManager(cfg),
                                  block_size=bs, hash_block_size=hbs,
                                  include_finished_set=False, log_stats=False)


class EncoderCacheModel:
    """What the GPU runner's encoder cache holds, from the scheduler's outputs: freed
    hashes go first (`free_states`), this step's scheduled encoder inputs are encoded,
    then every scheduled query gathers from each feature it overlaps (vLLM 0.26
    worker/gpu/mm/encoder_runner.py: a feature in the window that is not cached is an
    "Encoder cache miss")."""

    def __init__(self) -> None:
        self.cached: set[str] = set()
        self.misses: list[str] = []
        self.negative_offsets = 0

    def step(self, sched: Any, out: Any) -> None:
        for h in out.free_encoder_mm_hashes:
            self.cached.discard(h)
        for rid, inputs in out.scheduled_encoder_inputs.items():
            feats = sched.requests[rid].mm_features
            self.cached.update(feats[i].identifier for i in inputs)
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            end = req.num_computed_tokens  # advanced by n when it was scheduled
            start = end - n
            feats = req.mm_features
            if feats and feats[0].mm_position.offset < 0:  # in offset order
                self.negative_offsets += 1
            # vLLM's get_mm_features_in_window: features ending after `start` and
            # starting before `end` (offsets and ends both ascend), newest first
            for f in reversed(feats):
                if f.mm_position.offset + f.mm_position.length <= start:
                    break
                if f.mm_position.offset < end and f.identifier not in self.cached:
                    self.misses.append(f"{rid}@{start}: {f.identifier} at "
                                       f"{f.mm_position.offset}")


class Feed:
    """Streaming requests fed as AsyncLLM feeds them, one sampled blank per step."""

    def __init__(self, sched: Any, params: dict[str, Any]) -> None:
        from vllm.v1.request import Request

        self.sched, self.params, self._request = sched, params, Request
        self.ids = itertools.count()
        self.fed = dict.fromkeys(params, FIRST)
        self.encoder = EncoderCacheModel()
        self.shifts: list[int] = []
        self.errors: list[str] = []  # requests the engine ended with FINISHED_ERROR
        self.finishes: dict[str, list[Any]] = {}
        for rid in params:
            sched.add_request(self.chunk(rid, FIRST, FIRST))

    def chunk(self, rid: str, tokens: int, placeholder: int) -> Any:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        feature = MultiModalFeatureSpec(data=None, modality="audio",
                                        identifier=f"h{next(self.ids)}",
                                        mm_position=PlaceholderRange(0, placeholder))
        return self._request(request_id=rid, prompt_token_ids=[32] * tokens,
                             sampling_params=self.params[rid], pooling_params=None,
                             mm_features=[feature], resumable=True)

    def schedule(self) -> Any:
        """One schedule(), checked against the encoder cache model; its model output is
        not applied yet (`sample`), as with vLLM's async scheduling."""
        out = self.sched.schedule()
        self.shifts += [r.shift for r in getattr(out, REANCHORS_ATTR, ())]
        self.encoder.step(self.sched, out)
        return out

    def sample(self, out: Any) -> list[str]:
        """The model output of a scheduled step applied: one blank for each request it
        scheduled (none for an empty step). Returns those requests."""
        from vllm.v1.outputs import ModelRunnerOutput

        stepped = list(out.num_scheduled_tokens)
        self.engine_outputs = self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=stepped, req_id_to_index={r: i for i, r in enumerate(stepped)},
            sampled_token_ids=[[32] for _ in stepped]))
        for batch in self.engine_outputs.values():
            for o in batch.outputs:
                if o.finish_reason is not None:
                    self.finishes.setdefault(o.request_id, []).append(o.finish_reason)
                if str(o.finish_reason) == "error":
                    self.errors.append(o.request_id)
        return stepped

    def arrive(self, rid: str) -> None:
        """A session's next 80 ms chunk reaches the engine core."""
        self.sched.add_request(self.chunk(rid, 1, CHUNK))
        self.fed[rid] += 1

    def steps(self, stop_still_at: int | None = None) -> Iterator[Any]:
        """Schedule, check, sample, queue each stepped request's next chunk; yields each
        step's output before its model output is applied."""
        from vllm.v1.request import RequestStatus

        while True:
            out = self.schedule()
            yield out
            stepped = self.sample(out)
            for rid in stepped:
                req = self.sched.requests.get(rid)
                if req is None or req.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
                    continue  # ended, or a recompute that has more to do
                if stop_still_at is not None and rid == "still" and self.fed[rid] >= stop_still_at:
                    continue  # a stock session ends before the cap (the session budget)
                self.arrive(rid)


def sampling(every: int | None = None, **extra: Any) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    args = {"babelcast_reanchor_every": every, **extra} if every else None
    return SamplingParams.from_optional(temperature=0.0, max_tokens=1,
                                        output_kind=RequestOutputKind.DELTA, extra_args=args)


@pytest.mark.parametrize(("window", "max_model_len", "every"),
                         [(256, 2048, 128), (8192, 32768, 4096)])
def test_a_reanchoring_request_runs_three_times_max_model_len(
        window: int, max_model_len: int, every: int) -> None:
    sched = scheduler(window, max_model_len)
    feed = Feed(sched, {"moved": sampling(every), "still": sampling()})
    longest = dict.fromkeys(feed.params, 0)
    target = 3 * max_model_len if window < 1000 else 22_000
    for out in feed.steps(stop_still_at=max_model_len - 80):
        if feed.fed["moved"] >= target:
            break
        assert not getattr(out, FAILURES_ATTR, None)
        for new in out.scheduled_new_reqs:
            longest[new.req_id] = max(longest[new.req_id], len(new.prompt_token_ids))
            # Every position the next query can see is in a live block of every group.
            for g, block_ids in enumerate(new.block_ids):
                m = sched.kv_cache_manager.coordinator.single_type_managers[g]
                n = new.num_computed_tokens
                first = max(0, n - m.sliding_window + 1) // m.block_size
                for b in range(first, (n - 1) // m.block_size + 1):
                    assert block_ids[b] != 0, (new.req_id, g, b)
            assert all(f.mm_position.length in (FIRST, CHUNK) for f in new.mm_features)
    assert len(feed.shifts) >= (target - window - every) // every
    assert longest["moved"] < window + every + 2 * max(128, every // 8) + 64
    assert longest["still"] >= min(target, max_model_len - 80) - 100
    assert not feed.encoder.misses and not feed.encoder.negative_offsets


def short_run(preempts: int = 0, claims_cached: bool = False, frames: int = 3000
              ) -> tuple[Feed, Any, list[int]]:
    """A re-anchoring request beside a stock one for `frames` chunks; with `preempts`, the
    re-anchored one is preempted (vLLM's own `_preempt_request`, through the plugin's test
    hook) at a chunk after a re-anchor. Returns the feed, the scheduler and the length of
    every step that scheduled "moved" from position 0 after its first prompt (a
    recompute)."""
    sched = scheduler(256, 2048)
    if claims_cached:  # negative control: the scheduler schedules no encoder input
        sched.encoder_cache_manager.check_and_update_cache = lambda request, i: True
    extra = {PREEMPT_ARG: preempts} if preempts else {}
    feed = Feed(sched, {"moved": sampling(128, **extra), "still": sampling()})
    recomputes: list[int] = []
    for out in feed.steps(stop_still_at=1900):
        if feed.fed["moved"] >= frames or (feed.fed["still"] >= 1900 and (
                sched.requests.get("moved") is None or sched.requests["moved"].is_finished())):
            break
        n = out.num_scheduled_tokens.get("moved", 0)
        if n > FIRST and sched.requests["moved"].num_computed_tokens == n:
            recomputes.append(n)  # scheduled from position 0: a recompute
    return feed, sched, recomputes


def test_a_reanchored_request_that_vllm_preempts_is_ended_with_an_error() -> None:
    """vLLM recomputes a preempted request from position 0; after re-anchors that would be
    its kept history without the context the dropped positions gave it (on the H200 the
    logits then moved further than with garbage keys). The plugin ends it instead, with
    FINISHED_ERROR at the next model output, and no recompute happens; the request beside
    it goes on, and a late chunk of the ended one starts nothing."""
    from vllm.v1.engine import FinishReason

    feed, sched, recomputes = short_run(preempts=3, frames=1200)
    assert sched._bc_preempted.get("moved") == 1  # ended at the first
    assert recomputes == []
    assert sched.requests.get("moved") is None or sched.requests["moved"].is_finished()
    assert feed.errors == ["moved"], feed.errors
    assert feed.fed["still"] >= 1900
    assert not feed.encoder.misses and not feed.encoder.negative_offsets
    sched.add_request(feed.chunk("moved", 1, CHUNK))
    assert "moved" not in sched.requests
    assert FinishReason.ERROR in feed.finishes.get("moved", [])


def _old_choose_shift(request: Any, geometry: plan.Geometry) -> int:
    """The rule before 2-position placeholders were understood (negative control): back
    off once to a straddling placeholder's start and stop checking."""
    n = int(request.num_computed_tokens)
    unit = geometry.unit
    shift = (n - geometry.keep) // unit * unit
    if shift <= 0:
        return 0
    for f in request.mm_features:
        start, end = f.mm_position.offset, f.mm_position.offset + f.mm_position.length
        if start < shift < end:
            shift = start // unit * unit
            break
    return max(shift, 0)


def test_the_checks_catch_the_old_shift_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the feature check: the old shift rule keeps a feature at
    offset -1 after re-anchors, which the check counts."""
    monkeypatch.setattr(plan, "choose_shift", _old_choose_shift)
    real_apply = plan.apply

    def old_apply(request: Any, managers: Any, cache: Any, shift: int, *rest: Any) -> Any:
        """The old feature rule: only placeholders wholly before D go."""
        straddlers = [f for f in request.mm_features
                      if f.mm_position.offset < shift < f.mm_position.offset
                      + f.mm_position.length]
        out = real_apply(request, managers, cache, shift, *rest)
        request.mm_features[:0] = [
            type(f)(data=f.data, modality=f.modality, identifier=f.identifier,
                    mm_position=type(f.mm_position)(f.mm_position.offset - shift,
                                                    f.mm_position.length),
                    mm_hash=f.mm_hash) for f in straddlers]
        return out

    import workers.engines.vllm.reanchor.scheduler as sched_module

    monkeypatch.setattr(sched_module, "apply", old_apply)
    feed, _, _ = short_run(frames=1200)
    assert feed.encoder.negative_offsets > 0


def test_the_encoder_cache_check_catches_a_missing_encoder_output() -> None:
    """Negative control for the encoder cache model: a scheduler that believes every
    encoder output is already cached schedules none, and the model sees the misses the
    runner would raise."""
    feed, _, _ = short_run(claims_cached=True, frames=600)
    assert feed.encoder.misses


def test_a_failed_rotation_ends_its_request_with_an_error_and_no_token() -> None:
    """Fail closed (the worker reports a rotation that raised): the next model output's
    token for that request is dropped and vLLM ends it with FINISHED_ERROR, telling the
    client; the request beside it goes on."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(256, 2048)
    feed = Feed(sched, {"moved": sampling(128), "still": sampling()})
    ended: list[Any] = []
    for out in feed.steps():
        if feed.fed["moved"] == 600 and "moved" in out.num_scheduled_tokens and not ended:
            ROTATION_FAILURES.report("moved")
            ended.append(out)
            continue
        if ended:
            outputs = [o for batch in feed.engine_outputs.values() for o in batch.outputs]
            if len(ended) == 1:
                mine = [o for o in outputs if o.request_id == "moved"]
                assert [o.finish_reason for o in mine] == [FinishReason.ERROR], mine
                assert all(not o.new_token_ids for o in mine)
                ended.append(out)
            if feed.fed["still"] >= 700:
                break
    assert sched.requests.get("moved") is None or sched.requests["moved"].is_finished()
    assert feed.fed["still"] >= 700 and feed.fed["moved"] == 600
    # a chunk the client sent before it saw the error does not start a new request
    sched.add_request(feed.chunk("moved", 1, CHUNK))
    assert "moved" not in sched.requests


class Clock:
    """The scheduler module's `time` for the tick gather's tests: the real module, but
    `monotonic()` reads what the test sets. The gather's window is 5 ms; on a busy 2-core
    box real time, not the test, would decide whether a hold ran out."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def gather(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    """The tick gather on (5 ms, as `engine.vllm.tick_gather_ms: 5` sets it) in this
    process's engine-core state, the scheduler on the test's clock; off again after."""
    import workers.engines.vllm.reanchor.scheduler as sched_module
    from workers.engines.vllm.reanchor.gather import GATHER

    clock = Clock()
    monkeypatch.setattr(sched_module, "time", clock)
    GATHER.switch(5)
    try:
        yield clock
    finally:
        GATHER.switch(0)


SESSIONS = [f"s{i}" for i in range(6)]


def ticks(feed: Feed, clock: Clock, n: int) -> tuple[list[int], int]:
    """`n` ticks of the shared 80 ms feed: each session's chunk reaches the engine core
    0.5 ms after the one before (the front end sends them one message each), a
    different session first each tick, and the engine core schedules after every
    arrival, as its busy loop polls. Returns the requests of each step that had any
    and how many steps were empty (held)."""
    from vllm.v1.core.sched.interface import PauseState

    sizes, empty = [], 0
    for tick in range(n):
        clock.now += 0.080
        order = SESSIONS[tick % len(SESSIONS):] + SESSIONS[:tick % len(SESSIONS)]
        for rid in order:
            feed.arrive(rid)
            clock.now += 0.0005
            out = feed.schedule()
            assert feed.sched._pause_state == PauseState.UNPAUSED  # the hold is one call's
            stepped = feed.sample(out)
            if stepped:
                sizes.append(len(stepped))
            else:
                empty += 1
    return sizes, empty


def parked_all(sched: Any) -> bool:
    """Every session is back to waiting for its next chunk: none left waiting to run."""
    from vllm.v1.request import RequestStatus

    return (len(sched.waiting) + len(sched.skipped_waiting)
            == sched.num_waiting_for_streaming_input == len(SESSIONS)
            and all(sched.requests[r].status == RequestStatus.WAITING_FOR_STREAMING_REQ
                    for r in SESSIONS))


def test_the_tick_gather_takes_each_ticks_chunks_in_one_step(gather: Clock) -> None:
    """On vLLM's own scheduler (PAUSED_NEW for the held call only): with the gather on,
    each tick's six chunks, arriving one by one, go to the model in one step of six, and
    re-anchors happen among the held steps with nothing lost: every chunk computed, no
    encoder cache miss, every session parked for its next chunk at the end."""
    from workers.engines.vllm.reanchor.gather import ARRIVALS, GATHER

    sched = scheduler(256, 2048, max_num_seqs=8)
    feed = Feed(sched, {rid: sampling(128) for rid in SESSIONS})
    assert sorted(feed.sample(feed.schedule())) == SESSIONS  # first tick: count unknown
    before, seen = GATHER.counts(), ARRIVALS.counts()
    sizes, empty = ticks(feed, gather, 600)
    counts, arrivals = GATHER.counts(), ARRIVALS.counts()
    # the arrivals instrument saw each tick's six chunks 0-2.5 ms after its first
    assert arrivals["chunks"] - seen["chunks"] == 600 * len(SESSIONS)
    assert {k: v - seen["offset_ms"].get(k, 0) for k, v in arrivals["offset_ms"].items()
            if v != seen["offset_ms"].get(k, 0)} == {"0": 1200, "1": 1200, "2": 1200}
    assert sizes == [len(SESSIONS)] * 600, sizes[:20]
    assert empty == 600 * (len(SESSIONS) - 1)
    assert counts["held_ticks"] - before["held_ticks"] == 600
    assert counts["timed_out"] == before["timed_out"]
    assert len(feed.shifts) >= 2 * len(SESSIONS)  # 1,239 positions, re-anchors every 128
    assert not getattr(sched, "_bc_failures", None)
    assert not feed.encoder.misses and not feed.encoder.negative_offsets
    assert parked_all(sched)
    assert all(feed.fed[r] == FIRST + 600 for r in SESSIONS)


def test_without_the_gather_each_chunk_takes_its_own_step(gather: Clock) -> None:
    """Negative control for the one-step check: the same arrivals with the gather off
    give a step per chunk (what the H200 runs saw as two steps a tick)."""
    from workers.engines.vllm.reanchor.gather import GATHER

    GATHER.switch(0)
    sched = scheduler(256, 2048, max_num_seqs=8)
    feed = Feed(sched, {rid: sampling(128) for rid in SESSIONS})
    feed.sample(feed.schedule())
    sizes, empty = ticks(feed, gather, 20)
    assert sizes == [1] * (20 * len(SESSIONS)) and empty == 0
    assert parked_all(sched)


def test_a_late_chunk_costs_its_tick_at_most_the_window(gather: Clock) -> None:
    """A session whose chunk does not come: the tick's other five wait 4.5 ms, not
    past the 5 ms window, then go in one step; the late chunk is not held behind a
    step in flight (an engine with a request running is never held), and nothing
    is lost."""
    from workers.engines.vllm.reanchor.gather import GATHER

    sched = scheduler(256, 2048, max_num_seqs=8)
    feed = Feed(sched, {rid: sampling(128) for rid in SESSIONS})
    feed.sample(feed.schedule())
    ticks(feed, gather, 2)  # the gather knows a tick's count: six
    before = GATHER.counts()
    gather.now += 0.080
    for rid in SESSIONS[:-1]:
        feed.arrive(rid)
        assert not feed.sample(feed.schedule())  # held
    gather.now += 0.0045
    assert not feed.sample(feed.schedule())  # 4.5 ms: still held
    gather.now += 0.001
    five = feed.schedule()  # 5.5 ms: the window is over
    assert sorted(five.num_scheduled_tokens) == SESSIONS[:-1]
    feed.arrive(SESSIONS[-1])  # comes while the five are on the GPU
    late = feed.schedule()
    assert list(late.num_scheduled_tokens) == [SESSIONS[-1]]
    feed.sample(five)
    feed.sample(late)
    counts = GATHER.counts()
    assert counts["timed_out"] - before["timed_out"] == 1
    assert counts["holds"] - before["holds"] == len(SESSIONS)
    assert parked_all(sched)
    sizes, _ = ticks(feed, gather, 3)  # and the ticks after it are whole again
    assert sizes[-1] == len(SESSIONS)
    assert not feed.encoder.misses and parked_all(sched)
