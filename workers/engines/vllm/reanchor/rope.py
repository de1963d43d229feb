"""Re-rotating cached keys when a session's positions shift down by D.

RoPE rotates each pair of a key's dimensions by the angle `p·θ_i` at position p, and
attention scores depend only on differences of positions. A cached key written at
position p and rotated once more by `R(−D·θ_i)` is the key the model would have
written at position p − D, so after every live key is re-rotated and every position
is lowered by D, attending gives what attending at the old positions gave — exact up
to floating-point rounding (one rounding per key and re-anchor in the cache's dtype).

The shift angles `D·θ_i` are taken modulo 2π in float64: D·θ_0 reaches 10^5 radians,
where float32 alone would lose ~10^-2 rad.

Two pair layouts exist (vLLM's `is_neox_style`): NeoX pairs dimension i with
i + d/2 (Mistral's decoder), GPT-J pairs 2i with 2i+1 (Voxtral's audio encoder). Only
the first `rotary_dim` dimensions rotate; the rest pass through.

An fp8 KV cache (`kv_cache_dtype: fp8`) is stored by vLLM 0.26 as `torch.uint8`
(`utils/torch_utils.py` maps "fp8" to uint8; `attention/backends/flash_attn.py` views the
bytes as fp8 only inside its forward). Its keys are rotated as what they are: the bytes
viewed as fp8, widened to float32, rotated, saturated to the fp8 range (a rotation keeps
each pair's length, so one element can grow by up to √2) and written back as fp8 bytes.
The per-layer scale vLLM divides by when it writes (`_k_scale`) is a scalar and a rotation
is linear, so the stored values rotate as the keys do. Rotating the raw bytes as numbers
(what this module did before) turned 93 of 16,384 keys into NaN. Any other byte-stored
cache (int4, per-token scales, NVFP4) has no rotation here: `key_storage` says so and the
engine falls back to rollovers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeStyle:
    """How one attention layer's keys are rotated (read off vLLM's RotaryEmbedding)."""

    rotary_dim: int
    base: float
    neox: bool
    position_scale: int = 1
    """Rope positions per session position: 1 for the decoder; `block_pool_size` (4)
    for Voxtral's encoder, whose positions are 4·p + j for the 4 frames of token p."""


FP8_STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM 0.26 `cache_dtype` "fp8" is e4m3 (STR_DTYPE_TO_TORCH_DTYPE)
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""What the bytes of a uint8-stored KV cache hold, by vLLM's `cache_dtype` (on CUDA; ROCm's
fnuz variants are not rotated here)."""


def key_storage(tensor_dtype: torch.dtype, cache_dtype: str) -> tuple[torch.dtype | None,
                                                                        str | None]:
    """(the element type to rotate the cache's keys as, None if the tensor's own; why not,
    None if they can be rotated) for a cache tensor of `tensor_dtype` that vLLM made for
    `cache_dtype` ("auto", "bfloat16", "fp8", …)."""
    if tensor_dtype in (torch.bfloat16, torch.float16, torch.float32):
        return None, None
    if tensor_dtype == torch.uint8:
        element = FP8_STORAGE.get(cache_dtype)
        if element is not None:
            return element, None
        return None, (f"KV cache dtype {cache_dtype!r} is stored as bytes this plugin "
                      f"cannot rotate (it rotates {sorted(FP8_STORAGE)})")
    if tensor_dtype in FP8_STORAGE.values():
        return tensor_dtype, None
    return None, f"KV cache tensor dtype {tensor_dtype} cannot be rotated"


def inv_freq(rotary_dim: int, base: float) -> list[float]:
    """θ_i = base^(−2i/d), as vLLM computes them (but in float64)."""
    return [base ** (-(2.0 * i) / rotary_dim) for i in range(rotary_dim // 2)]


def shift_cos_sin(style: RopeStyle, shift: int, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles `shift·position_scale·θ_i`, reduced mod 2π in float64."""
    steps = shift * style.position_scale
    angles = [math.fmod(steps * f, 2.0 * math.pi) for f in inv_freq(style.rotary_dim, style.base)]
    a = torch.tensor(angles, dtype=torch.float64)
    return a.cos().to(device=device, dtype=torch.float32), a.sin().to(device=device,
                                                                     dtype=torch.float32)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
            rotary_dim: int) -> torch.Tensor:
    """Rotate the last dimension's pairs by +angle (cos, sin over d/2 pairs), in float32;
    the result in x's dtype (an fp8 result saturated to its finite range)."""
    rot = x[..., :rotary_dim].float()
    if neox:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if x.dtype in FP8_STORAGE.values():
        limit = torch.finfo(x.dtype).max
        out = out.clamp_(-limit, limit)
    if rotary_dim == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """Reference RoPE: rotate x[..., t, :] (positions along dim −3 or any leading dim
    aligned with `positions`) by `positions·position_scale·θ_i`, angles in float64."""
    freqs = torch.tensor(inv_freq(style.rotary_dim, style.base), dtype=torch.float64)
    steps = positions.to(torch.float64) * style.position_scale
    angles = torch.remainder(steps[:, None] * freqs[None, :], 2.0 * math.pi)
    cos = angles.cos().float()
    sin = angles.sin().float()
    # Broadcast over heads: x is [tokens, heads, dim].
    return _rotate(x, cos[:, None, :], sin[:, None, :], style.neox, style.rotary_dim)


def _check_storage(cache: torch.Tensor, stored_as: torch.dtype | None) -> None:
    if cache.dtype == torch.uint8 and stored_as is None:
        raise TypeError("a byte-stored KV cache needs `stored_as` (its fp8 type): its "
                        "bytes are not numbers to rotate")
    if stored_as is not None and stored_as.itemsize != cache.element_size():
        raise TypeError(f"cache elements of {cache.element_size()} bytes cannot hold "
                        f"{stored_as}")


def unrotate_keys_(keys: torch.Tensor, style: RopeStyle, shift: int,
                   stored_as: torch.dtype | None = None) -> None:
    """In place: rotate every key in `keys` (…, head_dim) by R(−shift), i.e. move each
    one from position p to p − shift. Works on any view (a cache's key half); a byte
    view of an fp8 cache with `stored_as` (its fp8 type, see `key_storage`)."""
    _check_storage(keys, stored_as)
    if shift == 0 or keys.numel() == 0:
        return
    cos, sin = shift_cos_sin(style, shift, keys.device)
    if stored_as is None or keys.dtype == stored_as:
        keys.copy_(_rotate(keys, cos, -sin, style.neox, style.rotary_dim))
        return
    rotated = _rotate(keys.view(stored_as), cos, -sin, style.neox, style.rotary_dim)
    keys.copy_(rotated.view(keys.dtype))


def unrotate_blocks_(key_cache: torch.Tensor, block_ids: list[int], style: RopeStyle,
                     shift: int, chunk: int = 256,
                     stored_as: torch.dtype | None = None) -> None:
    """In place on a paged key cache shaped [num_blocks, block_size, heads, head_dim]
    (a view is fine): re-rotate the listed blocks by R(−shift), `chunk` blocks at a
    time so the float32 working copy stays small. A cache of bytes (vLLM's fp8) needs
    `stored_as`, the fp8 type its bytes hold: the blocks are gathered and scattered as
    bytes (CUDA indexes no fp8 tensor) and rotated as that type."""
    _check_storage(key_cache, stored_as)
    if shift == 0 or not block_ids:
        return
    cos, sin = shift_cos_sin(style, shift, key_cache.device)
    as_bytes = stored_as is not None and key_cache.element_size() == 1
    store = key_cache.view(torch.uint8) if as_bytes else key_cache
    for i in range(0, len(block_ids), chunk):
        idx = torch.tensor(block_ids[i : i + chunk], dtype=torch.long, device=key_cache.device)
        blocks = store.index_select(0, idx)
        if as_bytes:
            assert stored_as is not None
            rotated = _rotate(blocks.view(stored_as), cos, -sin, style.neox,
                              style.rotary_dim).view(torch.uint8)
        else:
            rotated = _rotate(blocks, cos, -sin, style.neox, style.rotary_dim)
        store.index_copy_(0, idx, rotated)
