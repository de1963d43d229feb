"""Re-rotating cached keys by R(−D), then attending, equals recomputing with every
position lowered by D — for both RoPE pair layouts (NeoX for the decoder, GPT-J with
4 rope positions per token for the audio encoder), in fp32 and in bf16."""

from __future__ import annotations

import pytest
import torch

from workers.engines.vllm_reanchor.rope import (
    RopeStyle,
    apply_rope,
    unrotate_blocks_,
    unrotate_keys_,
)

pytestmark = pytest.mark.unit

DECODER = RopeStyle(rotary_dim=128, base=1e6, neox=True)
ENCODER = RopeStyle(rotary_dim=64, base=1e6, neox=False, position_scale=4)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per head over all keys: q [H, d], k/v [T, H, d] → [H, d], in fp32."""
    scores = torch.einsum("hd,thd->ht", q.float(), k.float()) / q.shape[-1] ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v.float())


def case(style: RopeStyle, start: int, shift: int, dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of the next query over 64 cached keys written at positions
    start..start+63: (exact at the old positions in fp32, re-anchored in `dtype`,
    recomputed at positions − shift in `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    heads, dim, t = 4, style.rotary_dim, 64
    q_raw = torch.randn(1, heads, dim, generator=g)
    k_raw = torch.randn(t, heads, dim, generator=g)
    v = torch.randn(t, heads, dim, generator=g)
    pos = torch.arange(start, start + t)
    q_pos = torch.tensor([start + t])

    exact = attend(apply_rope(q_raw, q_pos, style)[0], apply_rope(k_raw, pos, style), v)

    cache = apply_rope(k_raw, pos, style).to(dtype)  # what the model wrote
    unrotate_keys_(cache, style, shift)  # re-anchor: now at pos − shift
    q_new = apply_rope(q_raw, q_pos - shift, style)[0].to(dtype)
    reanchored = attend(q_new, cache, v.to(dtype))

    recomputed_k = apply_rope(k_raw, pos - shift, style).to(dtype)
    recomputed = attend(q_new, recomputed_k, v.to(dtype))
    return exact, reanchored, recomputed


@pytest.mark.parametrize("style", [DECODER, ENCODER], ids=["neox-decoder", "gptj-encoder"])
@pytest.mark.parametrize(("start", "shift"), [(9000, 8192), (131000, 122880), (700, 128)])
def test_fp32_reanchor_equals_recompute(style: RopeStyle, start: int, shift: int) -> None:
    exact, reanchored, recomputed = case(style, start, shift, torch.float32)
    assert (reanchored - recomputed).abs().max().item() < 1e-5
    assert (reanchored - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize("style", [DECODER, ENCODER], ids=["neox-decoder", "gptj-encoder"])
def test_bf16_reanchor_is_within_bf16_rounding(style: RopeStyle) -> None:
    errs_re, errs_direct = [], []
    for seed in range(8):
        exact, reanchored, recomputed = case(style, 131000, 122880, torch.bfloat16, seed)
        errs_re.append((reanchored - exact).abs().max().item())
        errs_direct.append((recomputed - exact).abs().max().item())
    # One more rounding per key than writing the key at its new position directly:
    # the same order as bf16's own error, nowhere near a position error.
    assert max(errs_re) < 3 * max(errs_direct) + 1e-3, (errs_re, errs_direct)
    assert max(errs_re) < 0.05


def test_a_wrong_shift_is_caught() -> None:
    """The check above can fail: re-rotating by the wrong amount changes attention."""
    g = torch.Generator().manual_seed(1)
    k_raw = torch.randn(64, 4, 128, generator=g)
    q_raw = torch.randn(1, 4, 128, generator=g)
    v = torch.randn(64, 4, 128, generator=g)
    pos = torch.arange(9000, 9064)
    cache = apply_rope(k_raw, pos, DECODER)
    unrotate_keys_(cache, DECODER, 8191)  # one position off
    q = apply_rope(q_raw, torch.tensor([9064 - 8192]), DECODER)[0]
    want = attend(q, apply_rope(k_raw, pos - 8192, DECODER), v)
    assert (attend(q, cache, v) - want).abs().max().item() > 1e-3


def test_paged_cache_rotates_only_the_listed_blocks_and_only_keys() -> None:
    """FlashAttention's layout in vLLM 0.26: [blocks, heads, block_size, 2·head_dim],
    keys in the first half of the last dimension."""
    g = torch.Generator().manual_seed(2)
    blocks, heads, bs, d = 6, 2, 16, 128
    kv = torch.randn(blocks, heads, bs, 2 * d, generator=g)
    before = kv.clone()
    keys = kv.transpose(1, 2).split(d, dim=-1)[0]  # [blocks, bs, heads, d], a view
    unrotate_blocks_(keys, [1, 4], DECODER, 8192, chunk=1)
    assert torch.equal(kv[..., d:], before[..., d:]), "values must not change"
    for b in (0, 2, 3, 5):
        assert torch.equal(kv[b], before[b])
    for b in (1, 4):
        want = before[b].transpose(0, 1)[..., :d].clone()  # [bs, heads, d]
        unrotate_keys_(want, DECODER, 8192)
        assert torch.allclose(kv[b].transpose(0, 1)[..., :d], want, atol=1e-6)
