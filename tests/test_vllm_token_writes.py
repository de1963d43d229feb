"""Incremental token-history writes (workers/engines/vllm/reanchor/token_writes.py).

vLLM is not installed here, and its `StagedWriteTensor` needs CUDA (its index buffers are
pinned host memory mapped into the GPU), so `StandInStagedWriteTensor` below follows
vLLM 0.26's `stage_write` and `apply_write` (v1/worker/gpu/buffer_utils.py) as read, on
CPU tensors. On the GPU the switch runs the same check with vLLM's own class
(tests/gpu/test_vllm_engine.py decodes with it on and off).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from workers.engines.vllm.reanchor import token_writes

pytestmark = pytest.mark.unit


class StandInStagedWriteTensor:
    """vLLM 0.26's StagedWriteTensor's staging, on the CPU."""

    def __init__(self, size: Any, dtype: torch.dtype, device: torch.device,
                 max_concurrency: int | None = None, uva_instead_of_gpu: bool = False) -> None:
        self.gpu = torch.zeros(size, dtype=dtype, device=device)
        self._indices: list[int] = []
        self._starts: list[int] = []
        self._contents: list[int] = []
        self._cu_lens: list[int] = []
        self.applied_tokens = 0

    def stage_write(self, index: int, start: int, x: Any) -> None:
        assert index >= 0 and start >= 0
        if not x:
            return
        self._indices.append(index)
        self._starts.append(start)
        self._contents.extend(x)
        self._cu_lens.append(len(self._contents))

    def apply_write(self) -> None:
        if not self._indices:
            return
        contents = torch.tensor(self._contents, dtype=self.gpu.dtype)
        begin = 0
        for index, start, end in zip(self._indices, self._starts, self._cu_lens, strict=True):
            self.gpu[index, start : start + end - begin] = contents[begin:end]
            begin = end
        self.applied_tokens += len(self._contents)
        self._indices, self._starts, self._contents, self._cu_lens = [], [], [], []


def runner(rows: int = 4, width: int = 4096) -> Any:
    tensor = StandInStagedWriteTensor((rows, width), torch.int32, torch.device("cpu"))
    return SimpleNamespace(req_states=SimpleNamespace(all_token_ids=tensor))


def sample(ours: Any, plain: Any, row: int, at: int, token: int) -> None:
    """The runner's sampler appends a token after the prefill, on both."""
    ours.gpu[row, at] = token
    plain.gpu[row, at] = token


def test_a_streaming_session_stages_its_history_once_and_its_row_is_vllms() -> None:
    """A session resumed for every chunk (vLLM 0.26's V2 runner hands it its whole
    history each time) stages only the new tokens, and its row holds what vLLM's whole
    writes leave there, chunk after chunk, with the sampler's discarded token in between."""
    r, plain = runner(), runner().req_states.all_token_ids
    assert token_writes.switch(r, True) == {"on": True, "why_not": None}
    ours = r.req_states.all_token_ids
    history = list(range(100, 140))  # the first prompt
    for chunk in range(300):
        for t in (ours, plain):
            t.stage_write(2, 0, history)  # as RequestState.add_request does
            t.apply_write()
        assert torch.equal(ours.gpu, plain.gpu), chunk
        sample(ours, plain, 2, len(history), 7 + chunk)  # sampled, then not kept
        history.append(32 + chunk % 5)  # the chunk's fed-back token
    counts = token_writes.counts(r)
    assert counts["asked"] == plain.applied_tokens
    assert counts["staged"] == ours.applied_tokens == 40 + 299
    assert counts["asked"] > 100 * counts["staged"]


def test_random_writes_leave_every_row_as_vllms() -> None:
    """Growing, shrinking (a re-anchor), rows taken over by other requests, empty
    histories, writes not from the start, the sampler's appends: after every apply the
    rows equal vLLM's."""
    rng = random.Random(16)
    r, plain = runner(rows=3, width=256), runner(rows=3, width=256).req_states.all_token_ids
    assert token_writes.switch(r, True)["on"]
    ours = r.req_states.all_token_ids
    held: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in range(2000):
        row = rng.randrange(3)
        move = rng.random()
        tokens = held[row]
        if move < 0.6:
            tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        elif move < 0.7:
            tokens = tokens[: rng.randrange(len(tokens) + 1)]
        elif move < 0.8:
            tokens = [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        elif move < 0.85 and tokens:
            tokens = [*tokens[:-1], (tokens[-1] + 1) % 50]  # its last token differs
        elif move < 0.9:
            start = rng.randrange(0, 20)
            part = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
            for t in (ours, plain):
                t.stage_write(row, start, part)
                t.apply_write()
            assert torch.equal(ours.gpu, plain.gpu), step
            continue
        else:
            at = min(len(tokens), 255)
            sample(ours, plain, row, at, rng.randrange(50))
            continue
        tokens = tokens[:200]
        held[row] = tokens
        for t in (ours, plain):
            t.stage_write(row, 0, tokens)
            if rng.random() < 0.7:
                t.apply_write()
        if rng.random() < 0.7:
            ours.apply_write()
            plain.apply_write()
        ours.apply_write()
        plain.apply_write()
        assert torch.equal(ours.gpu, plain.gpu), step
    assert ours.applied_tokens < plain.applied_tokens


def test_switching_off_restores_vllms_method_and_on_twice_is_once() -> None:
    r = runner()
    tensor = r.req_states.all_token_ids
    assert token_writes.switch(r, True)["on"]
    first = tensor.__dict__["stage_write"]
    assert token_writes.switch(r, True) == {"on": True, "why_not": None}
    assert tensor.__dict__["stage_write"] is first
    assert token_writes.switch(r, False) == {"on": False, "why_not": None}
    assert "stage_write" not in tensor.__dict__
    assert tensor.stage_write.__func__ is StandInStagedWriteTensor.stage_write
    assert token_writes.counts(r) == {}


def test_a_runner_without_its_token_rows_or_with_other_semantics_is_refused() -> None:
    """vLLM's V1 runner has no req_states; a StagedWriteTensor whose stage_write ignored
    its start (another vLLM) fails the check and keeps its own method."""
    answer = token_writes.switch(SimpleNamespace(), True)
    assert answer["on"] is False and "V2 model runner" in answer["why_not"]

    class IgnoresStart(StandInStagedWriteTensor):
        def stage_write(self, index: int, start: int, x: Any) -> None:
            super().stage_write(index, 0, x)

    tensor = IgnoresStart((4, 64), torch.int32, torch.device("cpu"))
    odd = SimpleNamespace(req_states=SimpleNamespace(all_token_ids=tensor))
    answer = token_writes.switch(odd, True)
    assert answer["on"] is False and "differ" in answer["why_not"]
    assert "stage_write" not in tensor.__dict__
