"""Re-rotating cached keys by R(−D), then attending, equals recomputing with every
position lowered by D — for both RoPE pair layouts (NeoX for the decoder, GPT-J with
4 rope positions per token for the audio encoder), in fp32 and in bf16; and in fp8,
through vLLM 0.26's own cache layout (bytes)."""

from __future__ import annotations

import pytest
import torch

from workers.engines.vllm.reanchor.rope import (
    RopeStyle,
    _rotate,
    apply_rope,
    key_storage,
    shift_cos_sin,
    unrotate_blocks_,
    unrotate_keys_,
)

pytestmark = pytest.mark.unit

# These tensors are small: one thread, so that torch starts no OpenMP thread pool in the
# suite's process beside ctranslate2's own OpenMP (a fresh-clone run here once aborted at
# interpreter exit with "corrupted double-linked list" after these tests joined the suite).
torch.set_num_threads(1)

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


# ---- fp8 KV caches, as vLLM 0.26 lays them out ------------------------------------------
E4M3 = torch.float8_e4m3fn
U_E4M3 = 2.0 ** -4  # unit roundoff: 3 stored mantissa bits, round to nearest
U_BF16 = 2.0 ** -8  # 7 stored mantissa bits


def vllm_kv_cache(num_blocks: int, block_size: int, heads: int, head: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """A layer's KV cache tensor as vLLM 0.26 makes it for FlashAttention: the logical
    shape (blocks, heads, block_size, 2·head) of FlashAttentionBackend.get_kv_cache_shape,
    laid out in memory as (blocks, block_size, heads, 2·head) (get_kv_cache_stride_order,
    "NHD"), and for kv_cache_dtype "fp8" made of uint8 (STR_DTYPE_TO_TORCH_DTYPE)."""
    memory = torch.zeros(num_blocks, block_size, heads, 2 * head, dtype=dtype)
    return memory.permute(0, 2, 1, 3)  # the logical view vLLM hands each layer


def key_half(kv: torch.Tensor, head: int) -> torch.Tensor:
    """The worker's key view: what flash_attn.py's forward splits off (keys first)."""
    return kv.transpose(1, 2)[..., :head]


def write_fp8(keys_view: torch.Tensor, block: int, values: torch.Tensor,
              k_scale: float) -> None:
    """What reshape_and_cache_flash does for fp8: key / k_scale, saturated to e4m3, stored
    as its bytes."""
    q = (values / k_scale).clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)
    keys_view[block].copy_(q)


def fp8_case(shift: int, rotations: int, k_scale: float = 0.05, seed: int = 3
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder keys written at positions 9000… into an fp8 cache (vLLM's layout), then
    re-anchored `rotations` times by `shift`: (what the cache holds afterwards, as keys;
    the exact keys at their new positions, in fp32)."""
    g = torch.Generator().manual_seed(seed)
    blocks, bs, heads, d = 4, 16, 8, DECODER.rotary_dim
    kv = vllm_kv_cache(blocks, bs, heads, d, torch.uint8)
    keys = key_half(kv, d)
    raw = torch.randn(blocks * bs, heads, d, generator=g) * 0.4  # |k| ~ 0.4 / 0.05 = 8 stored
    pos = torch.arange(9000, 9000 + blocks * bs)
    written = apply_rope(raw, pos, DECODER)
    for b in range(blocks):
        write_fp8(keys, b, written[b * bs:(b + 1) * bs], k_scale)
    for _ in range(rotations):
        unrotate_blocks_(keys, list(range(blocks)), DECODER, shift, chunk=3, stored_as=E4M3)
    held = keys.reshape(-1, heads, d).view(E4M3).float() * k_scale
    exact = apply_rope(raw, pos - rotations * shift, DECODER)
    return held, exact


def pair_error_ratio(held: torch.Tensor, exact: torch.Tensor, unit: float,
                     writes: int) -> float:
    """Each NeoX pair's error norm against what `writes` roundings of `unit` could give
    it: a rotation keeps a pair's length and its error's, and each rounding adds at most
    `unit` × the element (plus e4m3's smallest subnormal step, 2^-10 of k_scale, here
    below 1e-3 absolute). ≤ 1 means within the dtype's bound."""
    half = DECODER.rotary_dim // 2
    def pairs(x: torch.Tensor) -> torch.Tensor:
        return torch.stack((x[..., :half], x[..., half:]), dim=-1)
    err = (pairs(held) - pairs(exact)).norm(dim=-1)
    bound = writes * (unit * pairs(exact).norm(dim=-1) * 1.05 + 1e-3)
    return float((err / bound).max())


@pytest.mark.parametrize("rotations", [1, 2, 3])
def test_fp8_keys_rotate_as_fp8_through_vllms_cache_layout(rotations: int) -> None:
    """vLLM's fp8 cache holds bytes; rotated as e4m3 (widen, rotate in fp32, saturate,
    store), every key lands within (1 + rotations) e4m3 roundings of the exact key at its
    new position. A decoder key is rotated at most 3 times in its 8,192-position life
    (re-anchors every 4,096)."""
    held, exact = fp8_case(8192, rotations)
    assert not torch.isnan(held).any()
    assert pair_error_ratio(held, exact, U_E4M3, 1 + rotations) <= 1.0
    rel = float((held - exact).norm() / exact.norm())
    assert rel < (1 + rotations) * U_E4M3  # measured 2.7 % for the write alone


def test_fp8_rotation_leaves_values_and_other_blocks_alone() -> None:
    g = torch.Generator().manual_seed(5)
    kv = vllm_kv_cache(5, 16, 2, 128, torch.uint8)
    kv.copy_(torch.randint(0, 0x7E, kv.shape, generator=g, dtype=torch.uint8))  # no NaN bytes
    before = kv.clone()
    unrotate_blocks_(key_half(kv, 128), [1, 3], DECODER, 4096, stored_as=E4M3)
    assert torch.equal(kv.transpose(1, 2)[..., 128:], before.transpose(1, 2)[..., 128:])
    for b in (0, 2, 4):
        assert torch.equal(kv[b], before[b])
    assert not torch.equal(kv[1], before[1])


def test_fp8_bytes_rotated_as_numbers_are_refused_and_would_be_caught() -> None:
    """The negative control: rotating the cache's bytes as if they were numbers (what the
    plugin did before it knew the cache dtype) is refused, and the check above fails on
    its result by orders of magnitude."""
    g = torch.Generator().manual_seed(3)
    kv = vllm_kv_cache(4, 16, 8, 128, torch.uint8)
    keys = key_half(kv, 128)
    with pytest.raises(TypeError, match="stored_as"):
        unrotate_blocks_(keys, [0], DECODER, 8192)
    raw = torch.randn(64, 8, 128, generator=g) * 0.4
    pos = torch.arange(9000, 9064)
    for b in range(4):
        write_fp8(keys, b, apply_rope(raw, pos, DECODER)[b * 16:(b + 1) * 16], 0.05)
    as_numbers = keys.reshape(-1, 8, 128).float()  # bytes 0..255 taken as values
    cos, sin = shift_cos_sin(DECODER, 8192)
    wrong = _rotate(as_numbers, cos, -sin, True, 128).round().clamp(0, 255).to(torch.uint8)
    held = wrong.view(E4M3).float() * 0.05
    exact = apply_rope(raw, pos - 8192, DECODER)
    bad = torch.isnan(held) | (held - exact).abs().gt(1.0)
    assert bad.any()
    finite = ~torch.isnan(held)
    assert pair_error_ratio(torch.where(finite, held, 0.0), exact, U_E4M3, 2) > 10


@pytest.mark.parametrize("style", [DECODER, ENCODER], ids=["neox-decoder", "gptj-encoder"])
def test_bf16_keys_rotate_within_bf16_roundings_through_vllms_cache_layout(
        style: RopeStyle) -> None:
    g = torch.Generator().manual_seed(4)
    d = style.rotary_dim
    kv = vllm_kv_cache(4, 16, 4, d, torch.bfloat16)
    keys = key_half(kv, d)
    raw = torch.randn(64, 4, d, generator=g)
    pos = torch.arange(700, 764)
    keys.copy_(apply_rope(raw, pos, style).to(torch.bfloat16).reshape(4, 16, 4, d))
    unrotate_blocks_(keys, [0, 1, 2, 3], style, 128)
    held = keys.reshape(64, 4, d).float()
    exact = apply_rope(raw, pos - 128, style)
    rel = float((held - exact).norm() / exact.norm())
    assert rel < 2 * U_BF16


def test_key_storage_names_what_it_cannot_rotate() -> None:
    assert key_storage(torch.bfloat16, "auto") == (None, None)
    assert key_storage(torch.uint8, "fp8") == (E4M3, None)
    assert key_storage(torch.uint8, "fp8_e5m2") == (torch.float8_e5m2, None)
    element, why = key_storage(torch.uint8, "int4_per_token_head")
    assert element is None and why and "int4_per_token_head" in why
