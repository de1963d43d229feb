"""A streaming session's token history written to the GPU once, not again at every chunk.

vLLM 0.26's V2 model runner (v1/worker/gpu) takes every chunk of a streaming session as a
new request: the scheduler resumes the session as WAITING and hands the runner its whole
token history (`NewRequestData.prefill_token_ids`), and `RequestState.add_request` stages
all of it into the request's row of `all_token_ids` (`StagedWriteTensor.stage_write(row,
0, tokens)`). `apply_write` then makes the staged Python list a tensor with
`torch.tensor(list)` (vllm/utils/torch_utils.py `async_tensor_h2d`), ~40 ns a token, and
a kernel writes it into the rows, which vLLM keeps in host memory mapped into the GPU. A
session aged 30 minutes holds 12-16k tokens (re-anchoring keeps it under max_model_len),
so every 80 ms chunk costs its engine core ~0.5 ms for tokens the row already holds. On
the H200 (2026-12-01: two engines, 48 sessions aged 30 min, production feed, sync-free
spectrogram) 28-30 % of the engine-core processes' samples sat under that one write.

`switch(runner, True)` wraps the `stage_write` of the runner's `req_states.all_token_ids`:
a whole-row write (start 0) stages only the tokens past what the row holds from its last
whole-row write, when the new tokens begin with all of that; otherwise the whole row, as
vLLM does. The row then holds what vLLM's write would leave in it: its first positions were
written by that earlier write, and nothing else writes there (the runner's sampler appends
at the row's total length, past the prefill that write staged). It is switched on only
where a check on the runner's device, with vLLM's own tensor class, leaves every row equal
to vLLM's write; `switch(runner, False)` restores vLLM's method.
Used by the engine-core worker (`worker.ReanchorWorker.babelcast_token_writes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

ATTR = "stage_write"


class IncrementalRows:
    """`stage_write` for one StagedWriteTensor: whole-row writes stage what is new."""

    def __init__(self, tensor: Any) -> None:
        self.stage: Callable[[int, int, Any], None] = getattr(type(tensor), ATTR).__get__(tensor)
        self.rows: dict[int, list[int]] = {}  # row → tokens its last whole-row write put there
        self.asked = 0  # tokens vLLM's writes would have staged
        self.staged = 0  # tokens staged

    def __call__(self, index: int, start: int, x: Iterable[int]) -> None:
        tokens = x if isinstance(x, list) else list(x)
        if start != 0:  # a write this does not follow: the row is no longer known
            self.rows.pop(index, None)
            self.stage(index, start, tokens)
            return
        known = self.rows.get(index)
        n = len(tokens)
        keep = len(known) if (known is not None and len(known) <= n
                              and tokens[:len(known)] == known) else 0
        self.rows.pop(index, None)
        if keep < n:
            self.stage(index, keep, tokens[keep:])
        self.rows[index] = tokens.copy()  # the scheduler's own list changes later
        self.asked += n
        self.staged += n - keep


def _target(runner: Any) -> Any:
    states = getattr(runner, "req_states", None)
    tensor = getattr(states, "all_token_ids", None)
    if tensor is None or not callable(getattr(type(tensor), ATTR, None)) \
            or not callable(getattr(tensor, "apply_write", None)) \
            or not isinstance(getattr(tensor, "gpu", None), torch.Tensor):
        return None
    return tensor


def check(cls: Any, device: torch.device, dtype: torch.dtype, uva: bool = False) -> str | None:
    """Rows written through `IncrementalRows` and through vLLM's `stage_write`, on two
    `cls` tensors on `device` (in mapped host memory with `uva`, as vLLM 0.26 keeps the
    token rows): a growing history, a row that shrinks, a row another request takes over,
    positions the sampler appends. None if every step left the two equal, else what
    differed."""
    plain, ours = (cls((3, 64), dtype, device, uva_instead_of_gpu=uva) for _ in range(2))
    rows = IncrementalRows(ours)
    ours.__dict__[ATTR] = rows
    Write = tuple[int, list[int]]  # a whole-row write: row, tokens
    Append = tuple[int, int, int]  # the sampler's token: row, position, token
    steps: list[tuple[list[Write], list[Append]]] = [
        ([(0, list(range(1, 11))), (1, [5, 6])], []),
        ([(0, list(range(1, 13))), (2, [7] * 5)], []),
        ([], [(0, 12, 99)]),  # the sampler's token after the prefill
        ([(0, [*range(1, 13), 42, 43])], []),  # resumed: the sampled token was not kept
        ([(0, [2, 3]), (1, [5, 6, 9])], []),  # shrinks (a re-anchor); grows
        ([(1, [5, 6, 9, 9, 9]), (2, [8, 8])], []),  # another request's row
        ([(2, [1] * 9)], []),  # another request's, longer, not beginning with what is there
    ]
    for k, (writes, appends) in enumerate(steps):
        for row, pos, token in appends:
            plain.gpu[row, pos] = token
            ours.gpu[row, pos] = token
        for row, tokens in writes:
            plain.stage_write(row, 0, tokens)
            ours.stage_write(row, 0, tokens)
        plain.apply_write()
        ours.apply_write()
        if not torch.equal(plain.gpu, ours.gpu):
            return f"the rows differ from vLLM's after step {k}"
    if rows.staged >= rows.asked:
        return "nothing was left unstaged"
    return None


def switch(runner: Any, on: bool) -> dict[str, Any]:
    """Put the incremental whole-row writes on (or vLLM's back on) for the runner's token
    history. Says whether it is on, and why not where it is not."""
    tensor = _target(runner)
    if tensor is None:
        return {"on": False, "why_not": "no req_states.all_token_ids (not vLLM 0.26's V2 "
                                        "model runner)"}
    if not on:
        tensor.__dict__.pop(ATTR, None)
        return {"on": False, "why_not": None}
    current = tensor.__dict__.get(ATTR)
    if isinstance(current, IncrementalRows):
        return {"on": True, "why_not": None}
    why_not = check(type(tensor), tensor.gpu.device, tensor.gpu.dtype,
                    uva=hasattr(tensor, "_uva_buf"))
    if why_not is not None:
        return {"on": False, "why_not": why_not}
    tensor.__dict__[ATTR] = IncrementalRows(tensor)
    return {"on": True, "why_not": None}


def counts(runner: Any) -> dict[str, int]:
    """Tokens vLLM's writes would have staged, and tokens staged, since switched on."""
    tensor = _target(runner)
    rows = tensor.__dict__.get(ATTR) if tensor is not None else None
    if not isinstance(rows, IncrementalRows):
        return {}
    return {"asked": rows.asked, "staged": rows.staged}
