"""The GPU tier's test weights (workers/engines/vllm/reanchor/scaled_weights.py) on a toy
attention block shaped like vLLM's modules: each parameter gets its trained scale, two
models built alike get the same weights, and — the point — attention then depends on its
keys, where vLLM's dummy weights (±1e-3) make it blind to them."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engines.vllm.reanchor.scaled_weights import QK_GAIN, scale_weights_

pytestmark = pytest.mark.unit

# These tensors are small: one thread, so that torch starts no OpenMP thread pool in the
# suite's process beside ctranslate2's own OpenMP (a fresh-clone run here once aborted at
# interpreter exit with "corrupted double-linked list" after these tests joined the suite).
torch.set_num_threads(1)

DIM, HEADS, HEAD = 256, 4, 64


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(DIM, 3 * HEADS * HEAD, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD, DIM, bias=True)


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(1000, DIM)
        self.input_layernorm = RMSNorm(DIM)
        self.self_attn = Attention()
        self.conv = torch.nn.Conv1d(8, DIM, kernel_size=3)


def dummy_(model: torch.nn.Module) -> None:
    """vLLM's load_format="dummy": every state tensor uniform in ±1e-3."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.rand(t.shape, generator=g) * 2e-3 - 1e-3)


def attention_out(model: Toy, x: torch.Tensor, garbage_keys: bool) -> torch.Tensor:
    """One query (the last position) over 64 keys, as a decoder step attends."""
    h = model.input_layernorm(x)
    q, k, v = model.self_attn.qkv_proj(h).split(HEADS * HEAD, dim=-1)
    q = q[-1:].view(1, HEADS, HEAD)
    k = k.view(-1, HEADS, HEAD)
    v = v.view(-1, HEADS, HEAD)
    if garbage_keys:
        g = torch.Generator().manual_seed(9)
        k = torch.randn(k.shape, generator=g) * k.std()
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten()


def test_each_parameter_gets_its_trained_scale() -> None:
    model = Toy()
    done = scale_weights_(model, seed=0)
    assert torch.all(model.input_layernorm.weight == 1.0)
    assert torch.all(model.self_attn.o_proj.bias == 0.0)
    qkv = model.self_attn.qkv_proj.weight
    assert qkv.std().item() == pytest.approx(QK_GAIN / math.sqrt(DIM), rel=0.05)
    o = model.self_attn.o_proj.weight
    assert o.std().item() == pytest.approx(1 / math.sqrt(HEADS * HEAD), rel=0.05)
    assert model.embed_tokens.weight.std().item() == pytest.approx(1 / math.sqrt(DIM), rel=0.05)
    assert model.conv.weight.std().item() == pytest.approx(1 / math.sqrt(8 * 3), rel=0.05)
    assert done == {"norm": 1, "zero": 2, "qk": 1, "linear": 2, "embedding": 1}


def test_two_models_built_alike_hold_the_same_weights() -> None:
    a, b = Toy(), Toy()
    scale_weights_(a, seed=7)
    scale_weights_(b, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = Toy()
    scale_weights_(c, seed=8)
    assert not torch.equal(a.self_attn.qkv_proj.weight, c.self_attn.qkv_proj.weight)


def test_attention_cares_about_its_keys_with_scaled_weights_and_not_with_dummy_ones() -> None:
    """The instrument's own check: garbage keys leave the dummy-weight attention output
    unchanged to within bf16's resolution of it, and change the scaled one by the order of
    the output itself."""
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(2))
    dummy, scaled = Toy(), Toy()
    dummy_(dummy)
    scale_weights_(scaled, seed=0)
    for model, label in ((dummy, "dummy"), (scaled, "scaled")):
        good = attention_out(model, x, garbage_keys=False)
        bad = attention_out(model, x, garbage_keys=True)
        change = ((bad - good).norm() / good.norm()).item()
        if label == "dummy":
            assert change < 2.0 ** -8, change  # below one bf16 rounding
        else:
            assert change > 0.3, change
