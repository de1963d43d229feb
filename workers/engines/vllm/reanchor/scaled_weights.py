"""Random weights at a trained checkpoint's scale, for the GPU tier and the benchmarks
(`load_format="babelcast_scaled"`). TEST AND BENCHMARK WEIGHTS ONLY: the text is random.

No Voxtral weights can be fetched on the lent GPU hosts, so the engine runs random
weights. vLLM's own `load_format="dummy"` fills every weight, norms included, uniformly in
±1e-3: activations shrink layer after layer, attention scores spread by ~1e-9, and
attention ignores its keys — replacing every cached key with noise changed the output by
exactly 0.0, so a test of re-anchoring (re-rotated keys) could not fail. Here each layer
gets the scale a trained model has:
- a weight of two or more dimensions: N(0, 1/fan_in) (fan_in = its input width times its
  kernel), so a unit-variance input gives unit-variance outputs layer after layer;
- attention's query and key projections (and the fused qkv): twice that, so a score
  q·k/√d spreads by ~4, peaked as trained attention is;
- norm weights 1, biases 0; embeddings N(0, 1/dim) (with tied embeddings the output
  head's logits then spread by ~1).
Each parameter's values come from a generator seeded by its name and the model seed, so
two engines built alike hold the same weights (the exactness checks compare engines).
Buffers are left as vLLM's loader leaves them (the mel filter bank is not one).

`register()` adds the load format to vLLM's loader registry in the calling process; the
plugin worker calls it on import (the engine core loads the model there), and the engine's
front end before it builds the engine (a forked engine core inherits it).
"""

from __future__ import annotations

import math
import zlib
from collections import Counter

import torch

LOAD_FORMAT = "babelcast_scaled"
QK_GAIN = 2.0
QK_NAMES = ("qkv_proj", "q_proj", "k_proj", "wq", "wk")
"""Modules whose weights make queries or keys (vLLM's names for Mistral and Whisper)."""


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


@torch.no_grad()
def scale_weights_(model: torch.nn.Module, seed: int = 0) -> Counter[str]:
    """Give every floating-point parameter of `model` its trained scale (module
    docstring), in place; returns how many parameters got each treatment."""
    done: Counter[str] = Counter()
    for module_name, module in model.named_modules():
        kind = type(module).__name__.lower()
        leaf = module_name.rsplit(".", 1)[-1]
        for pname, p in module.named_parameters(recurse=False):
            if not p.is_floating_point() or p.device.type == "meta":
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            if "norm" in kind:
                p.fill_(1.0 if pname == "weight" else 0.0)
                done["norm"] += 1
            elif pname == "bias" or p.dim() < 2:
                p.zero_()
                done["zero"] += 1
            else:
                fan_in = p[0].numel()
                gain = QK_GAIN if leaf in QK_NAMES else 1.0
                g = _generator(name, seed, p.device)
                values = torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype)
                p.copy_(values.mul_(gain / math.sqrt(fan_in)))
                done["qk" if gain != 1.0 else ("embedding" if "embed" in kind else "linear")] \
                    += 1
    return done


def register() -> None:
    """Add LOAD_FORMAT to vLLM's model loaders in this process (idempotent)."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if LOAD_FORMAT in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        return

    class ScaledWeightsLoader(DummyModelLoader):  # type: ignore[misc]
        """vLLM's dummy loader, then every parameter at its trained scale."""

        def load_weights(self, model: torch.nn.Module, model_config: object) -> None:
            super().load_weights(model, model_config)
            scale_weights_(model, int(getattr(model_config, "seed", 0) or 0))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the generators' temporaries: not KV's loss

    model_loader.register_model_loader(LOAD_FORMAT)(ScaledWeightsLoader)
