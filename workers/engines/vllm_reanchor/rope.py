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
    """Rotate the last dimension's pairs by +angle (cos, sin over d/2 pairs), in float32."""
    rot = x[..., :rotary_dim].float()
    if neox:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
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


def unrotate_keys_(keys: torch.Tensor, style: RopeStyle, shift: int) -> None:
    """In place: rotate every key in `keys` (…, head_dim) by R(−shift), i.e. move each
    one from position p to p − shift. Works on any view (a cache's key half)."""
    if shift == 0 or keys.numel() == 0:
        return
    cos, sin = shift_cos_sin(style, shift, keys.device)
    keys.copy_(_rotate(keys, cos, -sin, style.neox, style.rotary_dim))


def unrotate_blocks_(key_cache: torch.Tensor, block_ids: list[int], style: RopeStyle,
                     shift: int, chunk: int = 256) -> None:
    """In place on a paged key cache shaped [num_blocks, block_size, heads, head_dim]
    (a view is fine): re-rotate the listed blocks by R(−shift), `chunk` blocks at a
    time so the float32 working copy stays small."""
    if shift == 0 or not block_ids:
        return
    cos, sin = shift_cos_sin(style, shift, key_cache.device)
    for i in range(0, len(block_ids), chunk):
        idx = torch.tensor(block_ids[i : i + chunk], dtype=torch.long, device=key_cache.device)
        blocks = key_cache.index_select(0, idx)
        key_cache.index_copy_(0, idx, _rotate(blocks, cos, -sin, style.neox, style.rotary_dim))
