"""The re-anchoring scheduler on vLLM's real scheduler objects (no GPU work): a real
`VllmConfig` for the Voxtral model folder, a real hybrid KV cache config (the decoder's
sliding window and the pooled encoder's, as vLLM groups them), the plugin's
`ReanchorAsyncScheduler`, and streaming requests fed chunk by chunk as AsyncLLM feeds
them, with one sampled token per step. A re-anchoring request runs for 3 ×
max_model_len; a stock one beside it is untouched.

Runs with the GPU tier (BABELCAST_VOXTRAL_DIR set; fails if vLLM is missing).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MODEL_DIR = os.environ.get("BABELCAST_VOXTRAL_DIR", "")
if not MODEL_DIR:
    pytest.skip("set BABELCAST_VOXTRAL_DIR to run the GPU tier", allow_module_level=True)
if not importlib.util.find_spec("vllm"):
    pytest.fail("BABELCAST_VOXTRAL_DIR is set but vLLM is missing", pytrace=False)

from workers.engines.vllm_reanchor.scheduler import (  # noqa: E402
    FAILURES_ATTR,
    REANCHORS_ATTR,
    ReanchorAsyncScheduler,
)


def scheduler(window: int, max_model_len: int) -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = EngineArgs(model=MODEL_DIR, tokenizer_mode="mistral", config_format="mistral",
                     load_format="dummy", max_model_len=max_model_len, max_num_seqs=4,
                     enable_prefix_caching=False, limit_mm_per_prompt={"audio": 1},
                     enforce_eager=True, max_num_batched_tokens=2048,
                     async_scheduling=True).create_engine_config()
    specs: dict[str, Any] = {}
    for i in range(4):  # Voxtral's two kinds of layers (fewer of each: same grouping)
        specs[f"language_model.model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
            sliding_window=window)
        specs[f"whisper_encoder.whisper_encoder.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=128, head_size=64, dtype=torch.bfloat16,
            sliding_window=189)
    kvc = get_kv_cache_configs(cfg, [specs], [4 << 30])[0]
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    bs, hbs = resolve_kv_cache_block_sizes(kvc, cfg)
    return ReanchorAsyncScheduler(vllm_config=cfg, kv_cache_config=kvc,
                                  structured_output_manager=StructuredOutputManager(cfg),
                                  block_size=bs, hash_block_size=hbs,
                                  include_finished_set=False, log_stats=False)


@pytest.mark.parametrize(("window", "max_model_len", "every"),
                         [(256, 2048, 128), (8192, 32768, 4096)])
def test_a_reanchoring_request_runs_three_times_max_model_len(
        window: int, max_model_len: int, every: int) -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = scheduler(window, max_model_len)
    params = {
        "moved": SamplingParams.from_optional(
            temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA,
            extra_args={"babelcast_reanchor_every": every}),
        "still": SamplingParams.from_optional(temperature=0.0, max_tokens=1,
                                              output_kind=RequestOutputKind.DELTA),
    }
    ids = itertools.count()

    def chunk(rid: str, n: int) -> Any:
        feature = MultiModalFeatureSpec(data=None, modality="audio", identifier=f"h{next(ids)}",
                                        mm_position=PlaceholderRange(0, n))
        return Request(request_id=rid, prompt_token_ids=[32] * n, sampling_params=params[rid],
                       pooling_params=None, mm_features=[feature], resumable=True)

    for rid in params:
        sched.add_request(chunk(rid, 39))
    fed = dict.fromkeys(params, 39)
    shifts: list[int] = []
    longest = dict.fromkeys(params, 0)
    target = 3 * max_model_len if window < 1000 else 22_000
    while fed["moved"] < target:
        out = sched.schedule()
        shifts += [r.shift for r in getattr(out, REANCHORS_ATTR, ())]
        assert not getattr(out, FAILURES_ATTR, None)
        for new in out.scheduled_new_reqs:
            longest[new.req_id] = max(longest[new.req_id], len(new.prompt_token_ids))
            # Every position the next query can see is in a live block of every group.
            for g, block_ids in enumerate(new.block_ids):
                m = sched.kv_cache_manager.coordinator.single_type_managers[g]
                n = new.num_computed_tokens
                first = max(0, n - m.sliding_window + 1) // m.block_size
                for b in range(first, (n - 1) // m.block_size + 1):
                    assert block_ids[b] != 0, (new.req_id, g, b)
            if fed[new.req_id] % 50 == 0:
                for f in new.mm_features:
                    assert 0 <= f.mm_position.offset < len(new.prompt_token_ids)
        stepped = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=stepped, req_id_to_index={r: i for i, r in enumerate(stepped)},
            sampled_token_ids=[[32] for _ in stepped]))
        for rid in stepped:
            if rid == "still" and fed[rid] >= max_model_len - 80:
                continue  # a stock session ends before the cap (the session budget)
            sched.add_request(chunk(rid, 1))
            fed[rid] += 1
    assert len(shifts) >= (target - window - every) // every
    assert longest["moved"] < window + every + 2 * max(128, every // 8) + 64
    assert longest["still"] >= min(target, max_model_len - 80) - 100
