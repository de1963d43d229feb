"""Voxtral Realtime chunk inputs built directly, without vLLM's renderer (vLLM 0.26.0).

Why: with 64 sessions the front-end process spent 36 % of its busy time rendering each
80 ms chunk. Every chunk of every session takes the generic multimodal path, whose result
is one token id, one bf16 waveform tensor, one hash and one placeholder range. Median per
steady chunk, one session:
- H200 host (2026-12-01, `check_equal`): `render_cmpl_async` 952 µs, direct 71 µs.
  `process_inputs` takes 27 µs and msgpack encoding 24 µs; neither changes.
- Local CPU: 340-410 µs against 25-39 µs, and about 16 µs without the content hash.

## One chunk today (file:line = vllm 0.26.0)
1. `VoxtralRealtimeGeneration.buffer_realtime_audio` (models/voxtral_realtime.py:234) →
   `VoxtralRealtimeBuffer.get_input_stream` (:172). It yields
   `TokensPrompt(prompt_token_ids=[last output token], multi_modal_data={"audio":
   (frame, None)})`. `frame` is float32 and 1-D: 1280 new samples, 840 look-back and 40
   look-ahead, so 2160 samples. The first prompt is different: 39 tokens (BOS, 32 left-pad,
   6 delay) and 49960 samples. This part stays: it is plain numpy and it defines the
   geometry.
2. `BaseRenderer.render_cmpl_async` (renderers/base.py:1007) does these steps:
   - `tokenize_prompts_async` → `TokenizeParams.apply_post_tokenization` (params.py:466).
     This is a length check only, because the ids are given.
   - `_process_multimodal_async` is a thread-pool hop (base.py:108) →
     `_process_multimodal` (:728). It takes `mm_req_id` from a counter, runs
     `parse_mm_data` (sr None, so no resampling; `normalize_audio` does nothing to 1-D
     input), `_process_mm_uuids` (:699) and then `mm_processor.apply`
     (multimodal/processing/processor.py:1663).
   - `VoxtralMultiModalProcessor._cached_apply_hf_processor` (models/voxtral.py:292) runs
     with cache None: `VoxtralRealtimeMultiModalProcessor.__init__` (voxtral_realtime.py:50)
     drops the cache. The token prompt skips the tokenizer. `_apply_hf_processor_mm_only`
     (processor.py:1214) builds a new `MistralCommonVoxtralProcessor` (ProcessorMixin) and
     calls it with `text=""`. That is transformers' `ProcessorMixin.__call__` plus
     `MistralCommonFeatureExtractor.__call__` (transformers_utils/processors/voxtral.py:37),
     which does only `torch.from_numpy(np.asarray(a, np.float32).ravel())`: a streaming
     config is never padded. Then `InputProcessingContext._postprocess_output`
     (multimodal/processing/context.py:226) casts the float tensor to `model_config.dtype`.
     The engine therefore receives the raw waveform in **bf16** (shape (2160,)). The mel
     spectrogram is computed on the GPU, in `embed_multimodal` → `compute_whisper_melspec`
     (voxtral.py:754). No front-end mel exists to compute, and none may be added.
   - `MultiModalKwargsItems.from_hf_inputs` with `audio_arrays=MultiModalFieldConfig
     .batched("audio")` (voxtral.py:212).
   - `ProcessorInputs.get_mm_hashes` (multimodal/processing/inputs.py:25) computes
     `MultiModalHasher.hash_kwargs(model_id=model, audio=frame)`, a blake3 of the float32
     frame.
   - `_get_prompt_updates` builds a second HF processor. Its result is overridden by
     `_maybe_apply_prompt_updates` (voxtral_realtime.py:60), which gives
     `PlaceholderRange(offset=0, length=audio_config.num_audio_tokens(len(frame)))`. That is
     2 for 2160 samples and 39 for the first prompt, although the model makes 1 (39)
     embedding: keep it as it is.
   - The result is `mm_input(...)` (inputs/engine.py:165) plus `arrival_time`.
3. `AsyncLLM._add_streaming_input_request.handle_inputs` (v1/engine/async_llm.py:458) runs
   per chunk:
   - `InputProcessor.process_inputs(..., resumable=True)` (v1/engine/input_processor.py:242)
     does: params.verify, a shallow clone (skip_clone=True), prompt-length and vocab checks,
     and `MultiModalFeatureSpec(data, modality, identifier=mm_hash, mm_position, mm_hash)`,
     giving an `EngineCoreRequest`.
   - `OutputProcessor.add_request` does `_update_streaming_request_state`
     (output_processor.py:553).
   - `engine_core.add_request_async` → `MsgpackEncoder.encode` (v1/serial_utils.py:166).
     The 4320-byte bf16 tensor goes out of band, above the 256 B threshold, then
     `send_multipart(copy=False)` (core_client.py:1064).
4. Engine core: `preprocess_add_request` (v1/engine/core.py:954) passes the features
   through `MultiModalReceiverCache` (LRU, mm_processor_cache_gb=4 by default), keyed by
   `mm_hash`. **If the hash is already cached, the cached data replaces the data sent.**
   Then `Scheduler.add_request` → `_update_request_as_session` (v1/core/sched/
   scheduler.py:1286) shifts `mm_position.offset` by `session.num_tokens`. The encoder
   cache is keyed by `identifier`.

## What the direct builder does
It keeps step 1, replaces step 2 with `DirectChunkBuilder.build` and leaves steps 3-4 as
they are. Its output must equal the renderer's output field for field:
- `type="multimodal"` and `prompt_token_ids`, the same list.
- `mm_kwargs["audio"][0]["audio_arrays"]`: a `MultiModalFieldElem` with
  `torch.from_numpy(f32 frame).to(model_config.dtype)` (contiguous, offset 0, shape (n,)).
  Its field is the one the model's processor declares (`_get_mm_fields_config`).
- `mm_hashes["audio"] == [hash_kwargs(model_id=model_config.model, audio=frame)]`, the same
  function on the same bytes. The id must be a faithful content hash or unique: because of
  the receiver cache in step 4, two different frames under one id would silently decode
  the wrong audio. When `mm_processor_cache_gb == 0` and prefix caching is off, vLLM itself
  uses per-item ids (`renderer{rank}-mm-{n}-audio-0`, base.py:719); the builder then uses
  its own unique ids (`direct-{random}-mm-{n}-audio-0`) and skips hashing. Setting that
  flag also removes the engine core's per-chunk LRU insert. It is worth a separate
  measurement, because it is a config change of its own.
- `mm_placeholders["audio"] == [PlaceholderRange(0, num_audio_tokens(n), None)]`.
- `arrival_time=time.time()`. Nothing more: no `prompt` and no `cache_salt`.
Anything unexpected (a sample rate, 2-D audio, more items, a non-streaming config, extra
prompt keys) falls back to the renderer for that prompt.

## What it does not skip, and why
`process_inputs` (~22 µs) and the encode+send stay. `StreamingInput.prompt` always goes
through `process_inputs` (async_llm.py:468). Skipping it would mean copying the private
`_add_streaming_input_request` (the final-request sentinel, `assign_request_id`, the
output collector). That saves about 6 % of the old per-chunk cost and ties us to 0.26's
internals. Not worth it. The 15 % in msgpack/ZMQ is the payload itself, which must stay
identical.

## Checking it on the GPU machine (one call)
`python -m workers.engines.vllm.direct MODEL_DIR` starts one AsyncLLM (dummy weights and
the project's engine kwargs) and runs two checks:
(a) `check_equal` renders ~40 chunks both ways and compares every field (tensor
    dtype/shape/stride, max abs diff, hashes, placeholders). It also compares the msgpack
    bytes of both `EngineCoreRequest`s after setting the arrival time to one value.
    Identical bytes mean the engine core cannot tell the two paths apart.
(b) `compare_generate` runs one session per path, one after the other, with the same
    audio, and compares the greedy token ids. The mm and encoder caches are reset between
    the two runs, so the caches cannot hide a difference.
It prints one JSON object; `"ok": true` proves the claim.
Run on the H200 on 2026-12-01 (vLLM 0.26.0, dummy weights, `--eager`):
- `check_equal`: 60 prompts, every field equal, `EngineCoreRequest` bytes equal, max abs
  diff 0.
- `compare_generate`: 110 outputs on each path, token ids identical.
The same check also passed on CPU with `mm_processor_cache_gb=0`, the per-item-id mode.
A negative control was run as well: a float32 tensor, a wrong model id in the hash, or a
placeholder length of 1 is reported as a mismatch, and the request bytes differ.
Setup on a bare host: carry `.stage/part01`…`part06` one call at a time
(`bash .stage/partNN/reassemble.sh stash`). In the last call, run `reassemble.sh`, then
`python3 -m tests.gpu.voxtral_model /tmp/voxtral`, then, with
`PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0`,
`python3 -m workers.engines.vllm.direct /tmp/voxtral --eager` (~35 s after the install).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["DirectChunkBuilder", "check_equal", "check_equal_async", "compare_generate",
           "direct_prompts", "renderer_prompts"]

PromptsFn = Callable[[Any, Any, AsyncIterator[np.ndarray], "asyncio.Queue[list[int]]"],
                     AsyncIterator[Any]]


class DirectChunkBuilder:
    """Builds one realtime prompt's engine input the way vLLM's renderer would."""

    def __init__(self, *, dtype: Any, model_id: str, fields: Mapping[str, Any],
                 num_audio_tokens: Callable[[int], int], unique_ids: bool) -> None:
        import torch
        from vllm.inputs.engine import mm_input
        from vllm.multimodal.hasher import MultiModalHasher
        from vllm.multimodal.inputs import (
            MultiModalFieldElem,
            MultiModalKwargsItem,
            MultiModalKwargsItems,
            PlaceholderRange,
        )

        if set(fields) != {"audio_arrays"} or fields["audio_arrays"].modality != "audio":
            raise ValueError(f"unexpected Voxtral processor fields: {dict(fields)}")
        self._from_numpy = torch.from_numpy
        self._dtype = dtype
        self._field = fields["audio_arrays"].field
        self._model_id = model_id
        self._num_audio_tokens = num_audio_tokens
        self._lengths: dict[int, int] = {}
        self._hash = MultiModalHasher.hash_kwargs
        self._ids = (itertools.count() if unique_ids else None)
        self._id_prefix = f"direct-{uuid.uuid4().hex[:12]}-mm"
        self._elem, self._item, self._items = (MultiModalFieldElem, MultiModalKwargsItem,
                                               MultiModalKwargsItems)
        self._range, self._mm_input = PlaceholderRange, mm_input

    @classmethod
    def for_llm(cls, llm: Any) -> DirectChunkBuilder:
        """From an AsyncLLM (or anything with `.renderer`, `.model_config`, `.vllm_config`)."""
        model_config = llm.model_config
        processor = llm.renderer.get_mm_processor()
        audio_config = processor.info.get_tokenizer().instruct.audio_encoder.audio_config
        if not audio_config.is_streaming:
            raise ValueError("not a streaming (realtime) Voxtral model")
        mm_config = model_config.multimodal_config
        unique = bool(mm_config is not None and mm_config.mm_processor_cache_gb == 0
                      and not llm.vllm_config.cache_config.enable_prefix_caching)
        return cls(dtype=model_config.dtype, model_id=str(model_config.model),
                   fields=processor._get_mm_fields_config({}, {}),
                   num_audio_tokens=audio_config.num_audio_tokens, unique_ids=unique)

    def build(self, prompt: Mapping[str, Any]) -> Any | None:
        """The `MultiModalInput` for `prompt`, or None where only the renderer knows how."""
        mm = prompt.get("multi_modal_data")
        if (set(prompt) != {"prompt_token_ids", "multi_modal_data"}
                or not isinstance(mm, Mapping) or set(mm) != {"audio"}):
            return None
        frame = mm["audio"]
        if isinstance(frame, tuple):
            if len(frame) != 2 or frame[1] is not None:
                return None  # a sample rate means resampling: the renderer's job
            frame = frame[0]
        if not isinstance(frame, np.ndarray) or frame.ndim != 1:
            return None
        samples = np.asarray(frame, dtype=np.float32).ravel()
        data = self._from_numpy(samples).to(dtype=self._dtype)
        n = samples.shape[0]
        length = self._lengths.get(n)
        if length is None:
            length = self._lengths.setdefault(n, int(self._num_audio_tokens(n)))
        if self._ids is not None:
            mm_hash = f"{self._id_prefix}-{next(self._ids)}-audio-0"
        else:
            mm_hash = self._hash(model_id=self._model_id, audio=frame)
        engine_input = self._mm_input(
            prompt_token_ids=list(prompt["prompt_token_ids"]),
            mm_kwargs=self._items(
                {"audio": [self._item({"audio_arrays": self._elem(data, self._field)})]}),
            mm_hashes={"audio": [mm_hash]},
            mm_placeholders={"audio": [self._range(offset=0, length=length)]},
        )
        engine_input["arrival_time"] = time.time()
        return engine_input


async def renderer_prompts(llm: Any, model_cls: Any, audio: AsyncIterator[np.ndarray],
                           tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
    """What `_AsyncLLMBackend.prompts` does today (the reference path)."""
    from vllm.engine.protocol import StreamingInput
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    model_config = llm.model_config
    async for prompt in model_cls.buffer_realtime_audio(audio, tokens, model_config):
        (engine_input,) = await llm.renderer.render_cmpl_async(
            [parse_model_prompt(model_config, prompt)])
        yield StreamingInput(prompt=engine_input)


async def direct_prompts(llm: Any, model_cls: Any, audio: AsyncIterator[np.ndarray],
                         tokens: asyncio.Queue[list[int]],
                         builder: DirectChunkBuilder | None = None) -> AsyncIterator[Any]:
    """Same contract as `_AsyncLLMBackend.prompts`, without the renderer per chunk.
    Pass one `builder` per engine (`DirectChunkBuilder.for_llm(llm)`) to skip its set-up."""
    from vllm.engine.protocol import StreamingInput
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    model_config = llm.model_config
    build = (builder or DirectChunkBuilder.for_llm(llm)).build
    async for prompt in model_cls.buffer_realtime_audio(audio, tokens, model_config):
        engine_input = build(prompt)
        if engine_input is None:
            (engine_input,) = await llm.renderer.render_cmpl_async(
                [parse_model_prompt(model_config, prompt)])
        yield StreamingInput(prompt=engine_input)


# ---- verification (run on the GPU machine; see the module docstring) -------------------

def _is_own_id(h: object) -> bool:
    return isinstance(h, str) and len(h) != 64 and h.endswith("-audio-0")


def _compare(ref: Mapping[str, Any], new: Mapping[str, Any], ids_unique: bool
             ) -> tuple[list[str], float]:
    """Mismatches between two engine inputs (besides arrival_time), and the max abs diff."""
    import torch

    bad: list[str] = []
    worst = 0.0
    if list(ref) != list(new):
        bad.append(f"keys {list(ref)} != {list(new)}")
    for key in ("type", "prompt_token_ids", "mm_placeholders", "prompt", "cache_salt"):
        if ref.get(key) != new.get(key):
            bad.append(f"{key}: {ref.get(key)!r} != {new.get(key)!r}")
    if not isinstance(new.get("arrival_time"), float):
        bad.append("arrival_time missing")
    rh, nh = ref.get("mm_hashes"), new.get("mm_hashes")
    if ids_unique:
        if not (rh and nh and all(_is_own_id(h) for v in (*rh.values(), *nh.values())
                                  for h in v)):
            bad.append(f"mm_hashes not per-item ids: {rh} / {nh}")
    elif rh != nh:
        bad.append(f"mm_hashes {rh} != {nh}")
    rk, nk = ref.get("mm_kwargs") or {}, new.get("mm_kwargs") or {}
    if type(rk) is not type(nk) or set(rk) != set(nk):
        bad.append(f"mm_kwargs {type(rk).__name__}{set(rk)} != {type(nk).__name__}{set(nk)}")
        return bad, worst
    for modality in rk:
        if len(rk[modality]) != len(nk[modality]):
            bad.append(f"{modality}: {len(rk[modality])} items != {len(nk[modality])}")
            continue
        for i, (ri, ni) in enumerate(zip(rk[modality], nk[modality], strict=True)):
            where = f"{modality}[{i}]"
            if type(ri) is not type(ni) or list(ri) != list(ni):
                bad.append(f"{where}: item keys {list(ri)} != {list(ni)}")
                continue
            for k in ri:
                re_, ne_ = ri[k], ni[k]
                if type(re_) is not type(ne_) or re_.field != ne_.field:
                    bad.append(f"{where}.{k}: field {re_.field!r} != {ne_.field!r}")
                rt, nt = re_.data, ne_.data
                if not (isinstance(rt, torch.Tensor) and isinstance(nt, torch.Tensor)):
                    bad.append(f"{where}.{k}: not tensors ({type(rt)}, {type(nt)})")
                    continue
                meta = [(t.dtype, tuple(t.shape), t.stride(), t.device, t.is_contiguous())
                        for t in (rt, nt)]
                if meta[0] != meta[1]:
                    bad.append(f"{where}.{k}: {meta[0]} != {meta[1]}")
                    continue
                diff = float((rt.float() - nt.float()).abs().max()) if rt.numel() else 0.0
                worst = max(worst, diff)
                if not torch.equal(rt, nt):
                    bad.append(f"{where}.{k}: values differ (max abs {diff:g})")
    return bad, worst


def _median_us(xs: Sequence[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1) if xs else 0.0


async def check_equal_async(llm: Any, model_cls: Any, chunks: Sequence[np.ndarray],
                            builder: DirectChunkBuilder | None = None) -> dict[str, Any]:
    """Build every prompt of `chunks` both ways and compare the inputs and the bytes sent."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.serial_utils import MsgpackEncoder

    model_config = llm.model_config
    builder = builder or DirectChunkBuilder.for_llm(llm)
    ids_unique = builder._ids is not None
    params = SamplingParams.from_optional(
        temperature=0.0, max_tokens=model_cls.realtime_max_tokens,
        output_kind=RequestOutputKind.DELTA, skip_clone=True)
    tasks = (await llm.get_supported_tasks() if hasattr(llm, "get_supported_tasks")
             else ("generate",))
    encoder = MsgpackEncoder()
    tokens: asyncio.Queue[list[int]] = asyncio.Queue()
    mismatches: list[str] = []
    worst, n, bytes_equal, fell_back = 0.0, 0, True, 0
    t_render: list[float] = []
    t_direct: list[float] = []
    t_process: list[float] = []
    t_encode: list[float] = []

    async def audio() -> AsyncIterator[np.ndarray]:
        for chunk in chunks:
            yield np.asarray(chunk, dtype=np.float32)

    stream = model_cls.buffer_realtime_audio(audio(), tokens, model_config)
    async with contextlib.aclosing(stream):
        async for prompt in stream:
            t0 = time.perf_counter()
            new = builder.build(prompt)
            t1 = time.perf_counter()
            (ref,) = await llm.renderer.render_cmpl_async(
                [parse_model_prompt(model_config, dict(prompt))])
            t2 = time.perf_counter()
            t_direct.append(t1 - t0)
            t_render.append(t2 - t1)
            if new is None:
                fell_back += 1
                mismatches.append(f"prompt {n}: the builder fell back to the renderer")
                new = ref
            bad, diff = _compare(ref, new, ids_unique)
            worst = max(worst, diff)
            mismatches += [f"prompt {n}: {b}" for b in bad]
            encoded = []
            for engine_input in (ref, new):
                t3 = time.perf_counter()
                req = llm.input_processor.process_inputs(
                    request_id="check-0", prompt=engine_input, params=params,
                    supported_tasks=tasks, arrival_time=0.0, resumable=True)
                t4 = time.perf_counter()
                if ids_unique:  # the renderer's counter ids cannot match ours
                    for f in req.mm_features or []:
                        f.identifier = f.mm_hash = "id"
                encoded.append([bytes(b) for b in encoder.encode(req)])
                t_process.append(t4 - t3)
                t_encode.append(time.perf_counter() - t4)
            if encoded[0] != encoded[1]:
                bytes_equal = False
                mismatches.append(f"prompt {n}: EngineCoreRequest bytes differ")
            n += 1
            tokens.put_nowait([int(prompt["prompt_token_ids"][-1])])
    return {"prompts": n, "equal": not mismatches and n > 0, "request_bytes_equal": bytes_equal,
            "max_abs_diff": worst, "fell_back": fell_back, "unique_ids": ids_unique,
            "mismatches": mismatches[:20], "renderer_us": _median_us(t_render[1:]),
            "direct_us": _median_us(t_direct[1:]),
            "process_inputs_us": _median_us(t_process), "encode_us": _median_us(t_encode)}


def check_equal(llm: Any, model_cls: Any, chunks: Sequence[np.ndarray]
                ) -> dict[str, Any] | Coroutine[Any, Any, dict[str, Any]]:
    """The report of `check_equal_async`. Outside an event loop it runs there and then.
    Inside a running loop (where AsyncLLM lives) it returns the coroutine, to be awaited."""
    work = check_equal_async(llm, model_cls, chunks)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    return work


async def compare_generate(llm: Any, model_cls: Any, chunks: Sequence[np.ndarray],
                           request_id: str = "direct-check") -> dict[str, Any]:
    """One session per path, one after the other, same audio: are the greedy tokens equal?"""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams.from_optional(
        temperature=0.0, max_tokens=model_cls.realtime_max_tokens,
        output_kind=RequestOutputKind.DELTA, skip_clone=True)
    builder = DirectChunkBuilder.for_llm(llm)

    async def direct(llm: Any, cls: Any, audio: AsyncIterator[np.ndarray],
                     tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        async for x in direct_prompts(llm, cls, audio, tokens, builder):
            yield x

    async def session(prompts: PromptsFn, rid: str) -> list[list[int]]:
        # Separate caches per run: otherwise one run's hashes serve the other's data.
        await llm.reset_mm_cache()
        await llm.reset_encoder_cache()
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()

        async def audio() -> AsyncIterator[np.ndarray]:
            for chunk in chunks:
                yield np.asarray(chunk, dtype=np.float32)

        out: list[list[int]] = []
        async for o in llm.generate(prompt=prompts(llm, model_cls, audio(), tokens),
                                    sampling_params=params, request_id=rid):
            if o.outputs:
                ids = list(o.outputs[0].token_ids)
                out.append(ids)
                tokens.put_nowait(ids)
        return out

    t0 = time.perf_counter()
    ref = await session(renderer_prompts, f"{request_id}-renderer")
    t1 = time.perf_counter()
    new = await session(direct, f"{request_id}-direct")
    t2 = time.perf_counter()
    first = next((i for i, (a, b) in enumerate(zip(ref, new, strict=False)) if a != b), None)
    return {"outputs": [len(ref), len(new)], "tokens_equal": ref == new and bool(ref),
            "first_difference": first, "seconds": [round(t1 - t0, 2), round(t2 - t1, 2)]}


def _noise(seconds: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000) // 1280
    return [(rng.standard_normal(1280) * 0.05).astype(np.float32) for _ in range(n)]


async def _main(model: str, eager: bool) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.model_loader import get_model_cls
    from vllm.v1.engine.async_llm import AsyncLLM

    from workers.engines.vllm.options import VllmEngineOptions, engine_kwargs

    options = VllmEngineOptions(model=model, max_streams=4, max_model_len=2048,
                                load_format="dummy", gpu_memory_utilization=0.5,
                                enforce_eager=eager)
    available = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(options, available)))
    try:
        model_cls = get_model_cls(llm.model_config)
        report: dict[str, Any] = {"check": await check_equal_async(llm, model_cls, _noise(4))}
        report["generate"] = await compare_generate(llm, model_cls, _noise(8, seed=1))
        report["ok"] = bool(report["check"]["equal"] and report["generate"]["tokens_equal"])
        return report
    finally:
        llm.shutdown()


if __name__ == "__main__":
    # python -m workers.engines.vllm.direct MODEL_DIR [--eager]  (eager: no compile wait)
    print(json.dumps(asyncio.run(_main(sys.argv[1], "--eager" in sys.argv[2:])), indent=1))
