"""GPU time of vLLM's FlashAttention kernels at Voxtral Realtime's shapes (H200 only).

    python -m bench.fa_kernels [--iters 200] > fa.json

Why: `bench.voxtral_capacity --gpu-profile` (2026-12-02, 72 sessions aged 30 min on two
engines, fp8 KV) put ~63 % of the engines' GPU time in FlashAttention, ~0.28 ms per
decoder-layer call for ~14 sessions: about three times what reading their 8,192-position
fp8 windows costs at the H200's bandwidth. This bench times the same kernel call that
vLLM 0.26's FlashAttention backend makes (`flash_attn_varlen_func`, FA3, paged KV, the
model's sliding windows) outside the engine, so each knob can be read on its own:

- the KV element type (bf16, or fp8 with the query quantized as vLLM does for FA3),
- `num_splits` (0 is FA3's own heuristic, which vLLM always passes with PIECEWISE graphs;
  N > 1 splits each sequence's keys over N thread blocks and combines them),
- the batch (sessions per step) and the context (a session aged past its window reads
  8,192 positions; a new one reads what it has).

Every figure is GPU time per call from CUDA events, the median of `--repeats` timings of
`--iters` back-to-back calls, all measured in this one run. The decoder shape: 32 query /
8 KV heads, head_dim 128, window 8,192, KV blocks of 128 (vLLM's choice for this model);
the encoder's: 32/32 heads, head_dim 64, window 189 positions, blocks of 16.
Nothing here runs without CUDA and vLLM's FA3 build; on other machines it exits 2.

First run (H200, vLLM 0.26.0, torch 2.11, 2026-12-02; README has the table): FA3 already
splits on its own (its varlen scheduler plus a combine kernel): forcing `num_splits`
changed no aged shape by more than a few per cent. fp8 KV reads at 1.3-2.6 TB/s where
bf16 reads at 3.0-4.3, so fp8 buys cache, not speed. And a window that has slid costs
more than the same 8,192 positions read from the start. A second run swept `--contexts`:
fp8, 14 sessions: 99.8 µs at 8,192, 145 at 8,193, 181 at 12,288, 172 at 16,384.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

DECODER = {"heads_q": 32, "heads_kv": 8, "head_dim": 128, "window": 8192, "block": 128}
ENCODER = {"heads_q": 32, "heads_kv": 32, "head_dim": 64, "window": 189, "block": 16}


def _case(torch: Any, fa: Any, shape: dict[str, int], batch: int, context: int, q_len: int,
          kv_dtype: str, splits: int, iters: int, repeats: int) -> dict[str, Any]:
    dev = "cuda"
    hq, hk, d, block = shape["heads_q"], shape["heads_kv"], shape["head_dim"], shape["block"]
    blocks_per_seq = -(-context // block)
    n_blocks = batch * blocks_per_seq + 8
    cache_dtype = torch.bfloat16
    k_cache = torch.randn(n_blocks, block, hk, d, device=dev, dtype=cache_dtype) * 0.5
    v_cache = torch.randn(n_blocks, block, hk, d, device=dev, dtype=cache_dtype) * 0.5
    # pages of one sequence are scattered, as in a cache that has run for a while
    table = torch.randperm(n_blocks - 8, device=dev)[: batch * blocks_per_seq]
    table = table.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch * q_len, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu_q = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    seqused = torch.full((batch,), context, device=dev, dtype=torch.int32)
    kwargs: dict[str, Any] = {}
    if kv_dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        k_cache, v_cache, q = k_cache.to(fp8), v_cache.to(fp8), q.to(fp8)
        one = torch.ones(batch, hk, device=dev, dtype=torch.float32)
        kwargs = {"q_descale": one, "k_descale": one, "v_descale": one}

    def call() -> None:
        fa.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len,
            seqused_k=seqused, max_seqlen_k=context, softmax_scale=d ** -0.5, causal=True,
            window_size=[shape["window"] - 1, 0], block_table=table, fa_version=3,
            num_splits=splits, **kwargs)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    loaded = min(context, shape["window"] + q_len)
    bytes_read = batch * loaded * hk * d * 2 * (1 if kv_dtype == "fp8" else 2)
    us = statistics.median(times)
    return {"batch": batch, "context": context, "q_len": q_len, "kv": kv_dtype,
            "splits": splits, "us_per_call": round(us, 2),
            "kv_gb_per_s": round(bytes_read / (us * 1e-6) / 1e9, 1)}


def _kernel_names(torch: Any, fa: Any, shape: dict[str, int], batch: int, context: int,
                  kv_dtype: str, splits: int) -> list[str]:
    """The kernels one call launches, full names (the capacity bench cuts them at 120)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _case(torch, fa, shape, batch, context, 1, kv_dtype, splits, iters=1, repeats=1)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"
             and "flash" in e.name.lower()}
    return sorted(names)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape (part, KV type, batch, context, query length): the fastest `splits` and
    its speed-up over FA3's own heuristic (splits 0), both measured in this run."""
    best: dict[str, dict[str, Any]] = {}
    heuristic = {(r["part"], r["kv"], r["batch"], r["context"], r["q_len"]): r["us_per_call"]
                 for r in rows if r["splits"] == 0}
    for r in rows:
        shape = (r["part"], r["kv"], r["batch"], r["context"], r["q_len"])
        key = "{} {} b{} ctx{} q{}".format(*shape)
        if key in best and best[key]["us_per_call"] <= r["us_per_call"]:
            continue
        base = heuristic.get(shape)
        best[key] = {"splits": r["splits"], "us_per_call": r["us_per_call"],
                     "heuristic_us": base,
                     "speedup_vs_heuristic": round(base / r["us_per_call"], 2) if base else None}
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 14, 28])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192, 16000],
                    help="decoder positions per session (past 8,192 the window slides)")
    args = ap.parse_args(argv)
    try:
        import torch
        from vllm import vllm_flash_attn as fa
    except ImportError as exc:
        print(json.dumps({"error": f"needs torch and vLLM's FA3 build: {exc}"}))
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA GPU"}))
        return 2
    rows: list[dict[str, Any]] = []
    for kv in ("bf16", "fp8"):
        for batch in args.batches:
            for context in args.contexts:
                for splits in args.splits:
                    rows.append({"part": "decoder", **_case(
                        torch, fa, DECODER, batch, context, 1, kv, splits,
                        args.iters, args.repeats)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for batch in (14, 28):
            for q_len in (1, 4):
                for splits in (0, 1, 4):
                    rows.append({"part": "encoder", **_case(
                        torch, fa, ENCODER, batch, 2000, q_len, kv, splits,
                        args.iters, args.repeats)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    names = {f"decoder {kv} b14 ctx16000 splits{s}": _kernel_names(
        torch, fa, DECODER, 14, 16000, kv, s) for kv in ("bf16", "fp8") for s in (0, 8)}
    best = summarize(rows)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "iters": args.iters, "repeats": args.repeats, "best": best,
                      "kernels": names, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
