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

Two ways to trim (`switch`'s mode):
- `"blocks"`: the block table and lengths above. The window's first block is still
  partly out of the window, so FA3 runs its *local* (sliding-window) kernel, which costs
  ~45 % more than the same 8,192 keys read as a plain causal call (bench.fa_kernels,
  fp8, 14 sessions: 145 µs at 8,193 positions against 100 at 8,192).
- `"keys"`: FA3's own `leftpad_k` (its paged-KV loader adds it to each key's position
  before the page lookup: vllm-project/flash-attention hopper/paged_kv.h) starts each
  request's keys at the first one its first query token sees, and `max_seqlen_k` becomes
  the query plus the window. A one-token query (every decode step of an aged session)
  then sees exactly its window, FA3 drops the window (`window_size_left >= seqlen_k - 1`
  in its mha_fwd) and runs the plain causal kernel on exactly the keys vLLM's call
  attends. Longer queries keep their window, now aligned to the first key they need.
  vLLM's Python wrapper has no `leftpad_k`, so the module's `flash_attn_varlen_func` is
  wrapped to call FA3's op with it, for calls whose `seqused_k` carries a pad (the
  builder's view of `seq_lens`); every other call is vLLM's own. Pinned to the wrapper's
  and the op's signatures of vLLM 0.26 (`VARLEN_PARAMS`, `FA3_LEFTPAD_AT`).
`switch(True)` takes `"keys"` where its check passes, else `"blocks"`, else neither.
Measured (H200, fp8, 14 sessions, bench.fa_kernels --trim): an aged decoder layer 98.6-100.7
µs with "keys" against 144-147 with "blocks" and 146-178 vLLM's; GPU tier: 914 of 914
outputs as vLLM's call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

BUILD_PARAMS = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")
VARLEN_PARAMS = (
    "q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k",
    "seqused_k", "q_v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
    "alibi_slopes", "deterministic", "return_attn_probs", "block_table",
    "return_softmax_lse", "out", "scheduler_metadata", "q_descale", "k_descale",
    "v_descale", "num_splits", "output_scale", "fa_version", "s_aux", "cp_world_size",
    "cp_rank", "cp_tot_seqused_k", "mask_mod", "aux_tensors", "dynamic_causal")
"""vllm.vllm_flash_attn.flash_attn_varlen_func's parameters in vLLM 0.26: the `"keys"`
mode calls FA3's op in its place, so it runs only where they are these."""
FA3_LEFTPAD_AT = 16
"""`leftpad_k`'s place among torch.ops._vllm_fa3_C.fwd's arguments (vLLM 0.26)."""
PAD_ATTR = "_babelcast_leftpad"
"""Set on the `seq_lens` view a `"keys"` build hands vLLM's builder: each request's first
key its first query token sees (int32, on the device)."""
MODES = ("blocks", "keys")
CALLS = {"keys": 0, "vllm": 0}
"""FlashAttention calls through the `"keys"` wrapper since it was switched on: with a pad
(keys) and without (vLLM's own call), for health and the GPU tier."""
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


def leftpad(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, left: int) -> torch.Tensor:
    """Per request: the first key any of its query tokens can see (FA3's `leftpad_k`)."""
    n = seq_lens.shape[0]
    q = query_start_loc[1:n + 1] - query_start_loc[:n]
    return torch.clamp(seq_lens - q - left, min=0).to(torch.int32)


def keys_bound(max_seq_len: int, max_query_len: int, left: int) -> int:
    """`max_seqlen_k` of a padded call: a request sees at most its query and the window.
    With one-token queries this is the window itself, so FA3 drops the window."""
    return min(max_seq_len, max_query_len + left)


def fa3_leftpad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor,
                max_seqlen_k: int, softmax_scale: float | None, causal: bool,
                window_size: Any, block_table: torch.Tensor, pad: torch.Tensor,
                softcap: float = 0.0, q_descale: torch.Tensor | None = None,
                k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                num_splits: int = 0, s_aux: torch.Tensor | None = None,
                return_softmax_lse: bool = False) -> Any:
    """FA3's paged varlen forward as vLLM 0.26's `flash_attn_varlen_func` makes it, with
    `leftpad_k` (keys before `pad` are not the request's) and `max_seqlen_k` cut to
    what a request can see. Its scheduler metadata is FA3's own (vLLM's ahead-of-time
    one counts the keys without the pad)."""
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if left >= 0:
        max_seqlen_k = keys_bound(max_seqlen_k, max_seqlen_q, left)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse, _, _ = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, out, cu_seqlens_q, None, None, None, seqused_k,
        max_seqlen_q, max_seqlen_k, block_table, None, pad, None, None, None,
        q_descale, k_descale, v_descale, softmax_scale, causal, left, right, softcap, True,
        None, num_splits, None, 0, s_aux, 1, 0, None)
    return (out, lse) if return_softmax_lse else out


_UNPADDED = {"cu_seqlens_k": None, "q_v": None, "dropout_p": 0.0, "alibi_slopes": None,
             "output_scale": None, "cp_world_size": 1, "cp_tot_seqused_k": None,
             "mask_mod": None, "aux_tensors": None, "dynamic_causal": None,
             "return_attn_probs": False}
"""A padded call must leave these as they are: FA3's op gets none of them from here."""


def _same(value: Any, plain: Any) -> bool:
    if plain is None:
        return value is None
    return not isinstance(value, torch.Tensor) and value == plain


def _padding_varlen(original: Callable[..., Any]) -> Callable[..., Any]:
    def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> Any:
        seqused = kwargs.get("seqused_k")
        pad = getattr(seqused, PAD_ATTR, None) if seqused is not None and not args else None
        if pad is None or seqused is None:
            CALLS["vllm"] += 1
            return original(*args, **kwargs)
        odd = [name for name, plain in _UNPADDED.items()
               if name in kwargs and not _same(kwargs[name], plain)]
        if kwargs.get("fa_version") != 3 or odd:
            raise RuntimeError(f"window_trim keys: a padded call with fa_version "
                               f"{kwargs.get('fa_version')} and {odd} set")
        CALLS["keys"] += 1
        return fa3_leftpad(
            kwargs["q"], kwargs["k"], kwargs["v"], kwargs.get("out"), kwargs["cu_seqlens_q"],
            kwargs["max_seqlen_q"], seqused, kwargs["max_seqlen_k"],
            kwargs.get("softmax_scale"), bool(kwargs.get("causal", False)),
            kwargs.get("window_size"), kwargs["block_table"], pad,
            float(kwargs.get("softcap", 0.0) or 0.0), kwargs.get("q_descale"),
            kwargs.get("k_descale"), kwargs.get("v_descale"), int(kwargs.get("num_splits", 0)),
            kwargs.get("s_aux"), bool(kwargs.get("return_softmax_lse", False)))

    return flash_attn_varlen_func


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
              block_table: torch.Tensor, left: int, scale: float,
              pad: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """Paged causal sliding-window attention in float32, one request at a time, as FA3
    defines it (window aligned to the end of the keys). Caches are [blocks, block_size,
    kv_heads, head_dim] of any float type (only the blocks a request uses are converted);
    q is [tokens, heads, head_dim]; GQA by repeating KV heads. With `pad` (FA3's
    `leftpad_k`) a request's keys start there; and as FA3 does, a window that reaches
    `max_seqlen_k - 1` keys back is no window."""
    block = k_cache.shape[1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    pads = pad.tolist() if pad is not None else [0] * seq_lens.shape[0]
    if max_seqlen_k is not None and left >= max_seqlen_k - 1:
        left = -1
    for r, s in enumerate(seq_lens.tolist()):
        a, b, p = starts[r], starts[r + 1], pads[r]
        n_blocks = -(-s // block)
        ids = block_table[r, :n_blocks].long()
        k = _take(k_cache, ids).reshape(-1, kv_heads, k_cache.shape[-1])[p:s].float()
        v = _take(v_cache, ids).reshape(-1, kv_heads, v_cache.shape[-1])[p:s].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        qq = q[a:b].float()
        n = s - p
        pos_q = torch.arange(n - (b - a), n, device=q.device).unsqueeze(1)
        pos_k = torch.arange(n, device=q.device).unsqueeze(0)
        visible = pos_k <= pos_q
        if left >= 0:
            visible &= pos_k >= pos_q - left
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


def _window_build(original: Callable[..., Any],
                  rewrite: Callable[[Any, int, int], tuple[Any, torch.Tensor | None]]
                  ) -> Callable[..., Any]:
    """vLLM's build, with sliding-window groups' common metadata rewritten first
    (`rewrite(cm, left, block)` → the new common metadata and, for the block trim, each
    request's dropped blocks, kept on the metadata as TRIM_ATTR); other builds as vLLM's."""
    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        where = _window_of(self, cm, common_prefix_len)
        if where is None:
            return original(self, common_prefix_len, cm, fast_build)
        rewritten, first = rewrite(cm, *where)
        metadata = original(self, common_prefix_len, rewritten, fast_build)
        if first is not None:
            setattr(metadata, TRIM_ATTR, first)
        return metadata

    return build


def _trimmed(cm: Any, left: int, block: int) -> tuple[Any, torch.Tensor]:
    seq_lens, table, first = trim(cm.seq_lens, cm.query_start_loc, cm.block_table_tensor,
                                  left, block)
    return dataclasses.replace(
        cm, seq_lens=seq_lens, block_table_tensor=table,
        max_seq_len=max_len_bound(cm.max_seq_len, cm.max_query_len, left, block)), first


def _padded(cm: Any, left: int, block: int) -> tuple[Any, None]:
    # a tensor object of this build's own (other groups share cm.seq_lens) carries the pad
    # to the forward's FlashAttention call, which reads `seqused_k`; metadata vLLM copies
    # keeps it, and a call that lost it is vLLM's own
    seq_lens = cm.seq_lens.view(-1)
    setattr(seq_lens, PAD_ATTR, leftpad(cm.seq_lens, cm.query_start_loc, left))
    return dataclasses.replace(cm, seq_lens=seq_lens), None


def _trimming_build(original: Callable[..., Any]) -> Callable[..., Any]:
    return _window_build(original, _trimmed)


def _padding_build(original: Callable[..., Any]) -> Callable[..., Any]:
    return _window_build(original, _padded)


def _trimming_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_block_table(self: Any, metadata: Any, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> Any:
        new = original(self, metadata, blk_table, slot_mapping)
        first = getattr(metadata, TRIM_ATTR, None)
        if first is not None:
            new.block_table = shift_table(blk_table, first)
        return new

    return update_block_table


def check(device: torch.device | str, kv_dtype: torch.dtype, mode: str = "blocks") -> str | None:
    """None when FA3's trimmed call (`mode` "blocks" or "keys") is as accurate as its full
    call on this device (against `reference`), for both of Voxtral's shapes with their
    windows slid; else why not."""
    from vllm import vllm_flash_attn as fa

    g = torch.Generator(device="cpu").manual_seed(11)
    # (heads_q, heads_kv, head_dim, window, block, lengths, query length); the decoder's
    # lengths put its window's start inside a block, on a block's edge and before it
    shapes = ((32, 8, 128, 300, 128, (1000, 301, 299, 700, 428), 1),  # decoder-like, GQA
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
        if mode == "keys":
            out = torch.empty(qk.shape, dtype=torch.bfloat16, device=qk.device)
            fa3_leftpad(qk, kk, vk, out, cu, q_len, seq, max(lens), scale, True,
                        [window - 1, 0], table, leftpad(seq, cu, window - 1), **kwargs)
            cut = out.float()
        else:
            cut = call(t_seq, t_table, max_len_bound(max(lens), q_len, window - 1, block))
        err_full = (full - ref).abs().max().item()
        err_cut = (cut - ref).abs().max().item()
        if not err_cut <= 2 * err_full + 1e-3:
            return (f"{mode}-trimmed FA3 is less accurate than vLLM's call (heads {hq}/{hk}, "
                    f"d {d}: {err_cut:.2e} against {err_full:.2e})")
    return None


def _varlen_module() -> Any:
    import vllm.v1.attention.backends.flash_attn as module

    return module


def _keys_why_not() -> str | None:
    """Why the `"keys"` mode cannot run against this vLLM, else None."""
    fn = getattr(_varlen_module(), "flash_attn_varlen_func", None)
    if fn is None:
        return "vLLM's FlashAttention backend has no flash_attn_varlen_func"
    params = tuple(inspect.signature(fn).parameters)
    if params != VARLEN_PARAMS:
        return f"flash_attn_varlen_func{params}"
    try:
        schema = torch.ops._vllm_fa3_C.fwd.default._schema
        name = schema.arguments[FA3_LEFTPAD_AT].name
    except Exception as exc:
        return f"FA3's op: {type(exc).__name__}: {exc}"
    if name != "leftpad_k":
        return f"FA3's op has {name} where vLLM 0.26's has leftpad_k"
    return None


def _restore() -> None:
    cls = _builder_class()
    for name, method in _ORIGINAL.items():
        if name == "varlen":
            _varlen_module().flash_attn_varlen_func = method
        else:
            setattr(cls, name, method)
    _ORIGINAL.clear()
    _MODE.clear()


_MODE: list[str] = []
_CHECKED: dict[tuple[str, str, str], str | None] = {}
"""`check`'s answer per (device, KV type, mode) in this process."""


def switch(on: bool | str, device: torch.device | str = "cuda",
           kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Trim (or stop trimming) every sliding-window group's FlashAttention call in this
    process. `on`: False; "blocks" or "keys" (the module's docstring); True: "keys" where
    it may run, else "blocks". A mode is switched on only where vLLM has the signatures
    it wraps and `check` passes; the answer says which mode runs and why another not."""
    if not on:
        _restore()
        return {"on": False, "mode": None, "why_not": None}
    wanted = list(MODES[::-1]) if on is True else [str(on)]
    if wanted[0] not in MODES:
        return {"on": False, "mode": None, "why_not": f"no trim mode {on!r}: {MODES}"}
    if _MODE and _MODE[0] == wanted[0]:
        return {"on": True, "mode": _MODE[0], "why_not": None}
    _restore()
    cls = _builder_class()
    build, update = cls.__dict__.get("build"), cls.__dict__.get("update_block_table")
    if build is None or update is None:
        return {"on": False, "mode": None, "why_not": "FlashAttentionMetadataBuilder has no "
                                                     "build or update_block_table of its own"}
    params = tuple(inspect.signature(build).parameters)
    if params != BUILD_PARAMS:
        return {"on": False, "mode": None,
                "why_not": f"FlashAttentionMetadataBuilder.build{params}"}
    refused: dict[str, str] = {}
    for mode in wanted:
        why = _keys_why_not() if mode == "keys" else None
        key = (str(device), str(kv_dtype), mode)
        if why is None and key not in _CHECKED:  # once per process: a bench switches often
            try:
                _CHECKED[key] = check(device, kv_dtype, mode)
            except Exception as exc:  # e.g. no FA3 here: the other mode may still run
                _CHECKED[key] = f"its check failed: {type(exc).__name__}: {exc}"[:300]
        why = why or _CHECKED[key]
        if why is not None:
            refused[mode] = why
            continue
        _ORIGINAL["build"] = build
        if mode == "keys":
            module = _varlen_module()
            _ORIGINAL["varlen"] = module.flash_attn_varlen_func
            module.flash_attn_varlen_func = _padding_varlen(module.flash_attn_varlen_func)
            cls.build = _padding_build(build)
            CALLS.update(keys=0, vllm=0)
        else:
            _ORIGINAL["update_block_table"] = update
            cls.build = _trimming_build(build)
            cls.update_block_table = _trimming_update(update)
        _MODE.append(mode)
        return {"on": True, "mode": mode, "why_not": None,
                **({"refused": refused} if refused else {})}
    return {"on": False, "mode": None,
            "why_not": "; ".join(f"{m}: {w}" for m, w in refused.items())}
