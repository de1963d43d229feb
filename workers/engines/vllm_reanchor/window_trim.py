"""FlashAttention handed only the KV blocks a session's sliding window can see.

vLLM 0.26 hands FA3, for a sliding-window KV cache group, each request's whole position
range: `seqused_k` is the session's length and its block table starts at position 0, the
blocks that have left the window replaced by the null block. FA3 bounds each thread
block's keys by the window, so the result is right, but the cost grows with the positions
before the window (bench.fa_kernels, H200, fp8, 14 sessions: 145 µs a decoder layer at
8,193 positions, 179 µs at 12,288), and Voxtral's encoder, whose 750-frame window sits at
4 × the decoder's position, took about a third of the aged steps' attention time.
Trimmed, the same calls took 145 µs at 12,288 and the encoder's 67 µs instead of 76
(`bench.fa_kernels --trim`; README has the table and the engine A/B).

`trim()` gives each request the table from the first block any of its query tokens can see
and its length less the positions dropped. FA3 aligns the window to the end of the keys
(key j is visible to query row i of a q-token query over S keys when
S - q + i - left <= j <= S - q + i + right), so dropping whole blocks from the front keeps
the same keys, in the same order, visible to every row. Only the kernel's grouping of keys
into its own tiles and splits can change, so the sums can round differently; `check()`
holds the trimmed call to the accuracy of vLLM's own call against a float32 reference.

`switch(True)` wraps `FlashAttentionMetadataBuilder.build` (and `update_block_table`, which
swaps a built table for another group's) in this process, the engine core: groups with a
sliding window get trimmed metadata; full-attention groups, cascade prefixes, decode
context parallelism, R-SWA prefixes and full CUDA graphs are left as vLLM builds them.
`switch(False)` puts vLLM's methods back. Used by the engine-core worker
(`worker.ReanchorWorker.babelcast_window_trim`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

BUILD_PARAMS = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")
TRIM_ATTR = "_babelcast_first_blocks"
"""Set on trimmed FlashAttentionMetadata: each request's dropped blocks, so a table
swapped in by `update_block_table` is trimmed the same way."""


def first_blocks(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, left: int,
                 block: int) -> torch.Tensor:
    """Per request: whole blocks before the first key any of its query tokens can see.
    `left` is the window's reach back (FA's window_size[0], the window less one)."""
    n = seq_lens.shape[0]
    q = query_start_loc[1:n + 1] - query_start_loc[:n]
    # the first query token sits at S - q and sees keys from S - q - left on
    return torch.clamp(seq_lens - q - left, min=0) // block


def trim(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor,
         left: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trimmed lengths, trimmed table, dropped blocks per request). The table keeps its
    width; the columns shifted in at the end repeat the table's last column (FA reads
    none of them: they lie past the request's new length)."""
    first = first_blocks(seq_lens, query_start_loc, left, block)
    return seq_lens - first * block, shift_table(block_table, first), first


def shift_table(block_table: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    n, cols = first.shape[0], block_table.shape[1]
    idx = torch.arange(cols, device=block_table.device, dtype=torch.int64).unsqueeze(0)
    idx = (idx + first.to(torch.int64).unsqueeze(1)).clamp_(max=cols - 1)
    return torch.gather(block_table[:n], 1, idx)


def max_len_bound(max_seq_len: int, max_query_len: int, left: int, block: int) -> int:
    """An upper bound of the trimmed lengths from host numbers alone (no GPU sync): a
    request that dropped blocks keeps its query, the window, and less than one block."""
    return min(max_seq_len, max_query_len + left + block - 1)


def _take(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cache[ids]; fp8 caches through a byte view (CUDA indexes no fp8 tensor)."""
    if cache.element_size() == 1 and cache.is_floating_point():
        return cache.view(torch.uint8)[ids].view(cache.dtype)
    return cache[ids]


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, left: int, scale: float) -> torch.Tensor:
    """Paged causal sliding-window attention in float32, one request at a time, as FA3
    defines it (window aligned to the end of the keys). Caches are [blocks, block_size,
    kv_heads, head_dim] of any float type (only the blocks a request uses are converted);
    q is [tokens, heads, head_dim]; GQA by repeating KV heads."""
    block = k_cache.shape[1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for r, s in enumerate(seq_lens.tolist()):
        a, b = starts[r], starts[r + 1]
        n_blocks = -(-s // block)
        ids = block_table[r, :n_blocks].long()
        k = _take(k_cache, ids).reshape(-1, kv_heads, k_cache.shape[-1])[:s].float()
        v = _take(v_cache, ids).reshape(-1, kv_heads, v_cache.shape[-1])[:s].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        qq = q[a:b].float()
        pos_q = torch.arange(s - (b - a), s, device=q.device).unsqueeze(1)
        pos_k = torch.arange(s, device=q.device).unsqueeze(0)
        visible = (pos_k <= pos_q) & (pos_k >= pos_q - left)
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


# ---- the switch (engine-core process) ---------------------------------------------------
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _builder_class() -> Any:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    return FlashAttentionMetadataBuilder


def _window_of(builder: Any, cm: Any, common_prefix_len: int) -> tuple[int, int] | None:
    """(left, block) where this build may be trimmed, else None."""
    spec = getattr(builder, "kv_cache_spec", None)
    window = getattr(spec, "sliding_window", None)
    if spec is None or not window or common_prefix_len:
        return None
    if getattr(builder, "dcp_world_size", 1) != 1 or getattr(builder, "rswa_window", None):
        return None
    if getattr(builder, "use_full_cuda_graph", False):  # its tensors must stay put; Voxtral
        return None  # runs PIECEWISE graphs, attention outside them
    if getattr(cm, "mm_req_doc_ranges", None) is not None:
        return None
    return int(window) - 1, int(spec.block_size)


def _trimming_build(original: Callable[..., Any]) -> Callable[..., Any]:
    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        where = _window_of(self, cm, common_prefix_len)
        if where is None:
            return original(self, common_prefix_len, cm, fast_build)
        left, block = where
        seq_lens, table, first = trim(cm.seq_lens, cm.query_start_loc, cm.block_table_tensor,
                                      left, block)
        trimmed = dataclasses.replace(
            cm, seq_lens=seq_lens, block_table_tensor=table,
            max_seq_len=max_len_bound(cm.max_seq_len, cm.max_query_len, left, block))
        metadata = original(self, common_prefix_len, trimmed, fast_build)
        setattr(metadata, TRIM_ATTR, first)
        return metadata

    return build


def _trimming_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_block_table(self: Any, metadata: Any, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> Any:
        new = original(self, metadata, blk_table, slot_mapping)
        first = getattr(metadata, TRIM_ATTR, None)
        if first is not None:
            new.block_table = shift_table(blk_table, first)
        return new

    return update_block_table


def check(device: torch.device | str, kv_dtype: torch.dtype) -> str | None:
    """None when FA3's trimmed call is as accurate as its full call on this device
    (against `reference`), for both of Voxtral's shapes with their windows slid; else why
    not."""
    from vllm import vllm_flash_attn as fa

    g = torch.Generator(device="cpu").manual_seed(11)
    # (heads_q, heads_kv, head_dim, window, block, lengths, query length)
    shapes = ((32, 8, 128, 300, 128, (1000, 301, 299, 700), 1),  # decoder-like, GQA
              (32, 32, 64, 750, 64, (3001, 752, 4000, 64), 4))  # encoder-like
    for hq, hk, d, window, block, lens, q_len in shapes:
        n_req = len(lens)
        per = -(-max(lens) // block)
        n_blocks = n_req * per + 1
        k = (torch.randn(n_blocks, block, hk, d, generator=g) * 0.5).to(device)
        v = (torch.randn(n_blocks, block, hk, d, generator=g) * 0.5).to(device)
        table = (torch.randperm(n_blocks - 1, generator=g)[: n_req * per] + 1).view(n_req, per)
        table = table.to(device=device, dtype=torch.int32)
        q = (torch.randn(n_req * q_len, hq, d, generator=g) * 0.5).to(device)
        cu = torch.arange(0, n_req * q_len + 1, q_len, dtype=torch.int32, device=device)
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        kwargs: dict[str, Any] = {}
        qk, kk, vk = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        if kv_dtype != torch.bfloat16:  # fp8 as vLLM runs it: query quantized too
            qk, kk, vk = q.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype)
            one = torch.ones(n_req, hk, device=device, dtype=torch.float32)
            kwargs = {"q_descale": one, "k_descale": one, "v_descale": one}
        ref = reference(qk.float(), kk, vk, cu, seq, table, window - 1, scale)
        t_seq, t_table, first = trim(seq, cu, table, window - 1, block)
        if int(first.max().item()) == 0:
            return "the check's windows did not slide (a bug in the check)"

        def call(lengths: torch.Tensor, blocks: torch.Tensor, max_len: int,
                 qk: torch.Tensor = qk, kk: torch.Tensor = kk, vk: torch.Tensor = vk,
                 cu: torch.Tensor = cu, q_len: int = q_len, scale: float = scale,
                 window: int = window, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            out = torch.empty(qk.shape, dtype=torch.bfloat16, device=qk.device)
            fa.flash_attn_varlen_func(
                q=qk, k=kk, v=vk, out=out, cu_seqlens_q=cu, max_seqlen_q=q_len,
                seqused_k=lengths, max_seqlen_k=max_len, softmax_scale=scale, causal=True,
                window_size=[window - 1, 0], block_table=blocks, fa_version=3, **kwargs)
            return out.float()

        full = call(seq, table, max(lens))
        cut = call(t_seq, t_table, max_len_bound(max(lens), q_len, window - 1, block))
        err_full = (full - ref).abs().max().item()
        err_cut = (cut - ref).abs().max().item()
        if not err_cut <= 2 * err_full + 1e-3:
            return (f"trimmed FA3 is less accurate than vLLM's call (heads {hq}/{hk}, d {d}: "
                    f"{err_cut:.2e} against {err_full:.2e})")
    return None


def switch(on: bool, device: torch.device | str = "cuda",
           kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Trim (or stop trimming) every sliding-window group's FlashAttention metadata in this
    process. On only where vLLM's builder has the signature this wraps and `check` passes."""
    cls = _builder_class()
    if not on:
        for name, method in _ORIGINAL.items():
            setattr(cls, name, method)
        _ORIGINAL.clear()
        return {"on": False, "why_not": None}
    if _ORIGINAL:
        return {"on": True, "why_not": None}
    build, update = cls.__dict__.get("build"), cls.__dict__.get("update_block_table")
    if build is None or update is None:
        return {"on": False, "why_not": "FlashAttentionMetadataBuilder has no build or "
                                       "update_block_table of its own"}
    params = tuple(inspect.signature(build).parameters)
    if params != BUILD_PARAMS:
        return {"on": False, "why_not": f"FlashAttentionMetadataBuilder.build{params}"}
    why = check(device, kv_dtype)
    if why is not None:
        return {"on": False, "why_not": why}
    _ORIGINAL.update(build=build, update_block_table=update)
    cls.build = _trimming_build(build)
    cls.update_block_table = _trimming_update(update)
    return {"on": True, "why_not": None}
