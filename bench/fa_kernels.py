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
the encoder's without `--trim`: 32/32 heads, head_dim 64, window 189, blocks of 16, at
2,000 positions (the pooled units vLLM's KV manager counts in, not the kernel's call:
`--trim` has the kernel's).
Nothing here runs without CUDA and vLLM's FA3 build; on other machines it exits 2.

`--trim` times, instead, vLLM's call against the window-trimmed one that
`engine.vllm.window_trim` makes (workers/engines/vllm/reanchor/window_trim.py: each
session's block table from the first block its window sees), at FA3's own splits, for the
decoder and for the encoder as the kernel sees it: Voxtral's encoder runs at 4 positions
per decoder position (vLLM's block pooling), so its call has 4 query tokens per session,
4 × the decoder's context, blocks of 64 and a 750-position window. Out-of-window blocks
are the null block (0), as vLLM's sliding-window manager leaves them. Each row also gives
the call's largest error against a float32 reference (`window_trim.reference`).

First run (H200, vLLM 0.26.0, torch 2.11, 2026-12-02; README has the table): FA3 already
splits on its own (its varlen scheduler plus a combine kernel): forcing `num_splits`
changed no aged shape by more than a few per cent. fp8 KV reads at 1.3-2.6 TB/s where
bf16 reads at 3.0-4.3, so fp8 buys cache, not speed. And a window that has slid costs
more than the same 8,192 positions read from the start. A second run swept `--contexts`:
fp8, 14 sessions: 99.8 µs at 8,192, 145 at 8,193, 181 at 12,288, 172 at 16,384.

`--trim`, first run (same day, `--batches 14 28 --iters 50 --repeats 3`; README has the
table): fp8, vLLM's call against the trimmed one, decoder 179 → 145 µs at 12,288 (14
sessions) and 311 → 252 at 16,000 (28); encoder 76 → 67 (14) and 126 → 111 (28) at every
age. Within the window's first block past 8,192 (8,193) the two calls are the same call:
that column is the run's A/A check (fp8 within 0.4 %; bf16 at 28 sessions 12 % apart, so
bf16's 28-session rows are noise at that size).

`--trim` also times the "keys" call (window_trim's "keys" mode: vLLM's tables and lengths
with FA3's leftpad_k, so a one-token query runs FA3's plain causal kernel on exactly its
window). First run (2026-12-02, `--contexts 8192 8193 12288 16000`): fp8 decoder at 14
sessions 98.6-100.7 µs at every age (vLLM's 146-178, blocks 144-147 past 8,192), at 28
180 (vLLM's 250-312, blocks 250-251); the encoder as blocks; errors as vLLM's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

DECODER = {"heads_q": 32, "heads_kv": 8, "head_dim": 128, "window": 8192, "block": 128}
ENCODER = {"heads_q": 32, "heads_kv": 32, "head_dim": 64, "window": 189, "block": 16}
ENCODER_CALL = {"heads_q": 32, "heads_kv": 32, "head_dim": 64, "window": 750, "block": 64}
"""The encoder's call as FA3 gets it: 4 query tokens and 4 × the decoder's positions."""
ENCODER_PER_POSITION = 4
TRIM_CONTEXTS = (8192, 8193, 8320, 9000, 12288, 16000)


def _case(torch: Any, fa: Any, shape: dict[str, int], batch: int, context: int, q_len: int,
          kv_dtype: str, splits: int, iters: int, repeats: int,
          variant: str | None = None) -> dict[str, Any]:
    """One shape's GPU time per call. `variant` None: every block a real one (the first
    runs); "full": out-of-window blocks null, as vLLM passes them; "trimmed": the tables
    and lengths window_trim's "blocks" mode makes; "keys": vLLM's tables and lengths with
    FA3's leftpad_k, as its "keys" mode calls FA3. All but None report their error."""
    dev = "cuda"
    hq, hk, d, block = shape["heads_q"], shape["heads_kv"], shape["head_dim"], shape["block"]
    blocks_per_seq = -(-context // block)
    left = shape["window"] - 1
    # variants: blocks out of every window are the null block 0 and need no memory
    gone = 0 if variant is None else max(0, context - q_len - left) // block
    n_blocks = batch * (blocks_per_seq - gone) + 8
    cache_dtype = torch.bfloat16
    k_cache = torch.randn(n_blocks, block, hk, d, device=dev, dtype=cache_dtype) * 0.5
    v_cache = torch.randn(n_blocks, block, hk, d, device=dev, dtype=cache_dtype) * 0.5
    # pages of one sequence are scattered, as in a cache that has run for a while
    live = torch.randperm(n_blocks - 8, device=dev)[: batch * (blocks_per_seq - gone)] + 1
    table = torch.cat([torch.zeros(batch, gone, device=dev, dtype=live.dtype),
                       live.view(batch, blocks_per_seq - gone)], dim=1).to(torch.int32)
    q = torch.randn(batch * q_len, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu_q = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    seqused = torch.full((batch,), context, device=dev, dtype=torch.int32)
    max_k = context
    from workers.engines.vllm.reanchor import window_trim

    if variant is not None:
        full_table, full_seq = table, seqused
        if variant == "trimmed":
            seqused, table, _ = window_trim.trim(seqused, cu_q, table, left, block)
            table = table.contiguous()
            max_k = window_trim.max_len_bound(context, q_len, left, block)
    kwargs: dict[str, Any] = {}
    if kv_dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        k_cache, v_cache, q = k_cache.to(fp8), v_cache.to(fp8), q.to(fp8)
        one = torch.ones(batch, hk, device=dev, dtype=torch.float32)
        kwargs = {"q_descale": one, "k_descale": one, "v_descale": one}

    pad = window_trim.leftpad(seqused, cu_q, left) if variant == "keys" else None

    def call() -> None:
        if pad is not None:
            window_trim.fa3_leftpad(q, k_cache, v_cache, out, cu_q, q_len, seqused, max_k,
                                    d ** -0.5, True, [left, 0], table, pad,
                                    num_splits=splits, **kwargs)
            return
        fa.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len,
            seqused_k=seqused, max_seqlen_k=max_k, softmax_scale=d ** -0.5, causal=True,
            window_size=[left, 0], block_table=table, fa_version=3,
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
    row = {"batch": batch, "context": context, "q_len": q_len, "kv": kv_dtype,
           "splits": splits, "us_per_call": round(us, 2),
           "kv_gb_per_s": round(bytes_read / (us * 1e-6) / 1e9, 1)}
    if variant is not None:
        ref = window_trim.reference(q.float(), k_cache, v_cache, cu_q[:3], full_seq[:2],
                                    full_table[:2], left, d ** -0.5)
        call()
        err = (out[: 2 * q_len].float() - ref[: 2 * q_len]).abs().max().item()
        row.update(variant=variant, max_err_vs_fp32=float(f"{err:.3g}"))
    return row


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


def trim_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape: vLLM's call (full) against the block-trimmed one and the key-padded one,
    same run."""
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if "variant" in r:
            by.setdefault((r["part"], r["kv"], r["batch"], r["context"], r["q_len"]),
                          {})[r["variant"]] = r
    out: dict[str, dict[str, Any]] = {}
    for shape, v in by.items():
        if "full" in v and "trimmed" in v:
            full, cut = v["full"], v["trimmed"]
            row = out["{} {} b{} ctx{} q{}".format(*shape)] = {
                "full_us": full["us_per_call"], "trimmed_us": cut["us_per_call"],
                "speedup": round(full["us_per_call"] / cut["us_per_call"], 2),
                "err_full": full.get("max_err_vs_fp32"), "err_trimmed": cut.get("max_err_vs_fp32")}
            if "keys" in v:
                keys = v["keys"]
                row.update(keys_us=keys["us_per_call"],
                           keys_speedup=round(full["us_per_call"] / keys["us_per_call"], 2),
                           err_keys=keys.get("max_err_vs_fp32"))
    return out


def _trim_rows(torch: Any, fa: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kv in ("bf16", "fp8"):
        for batch in args.batches:
            for context in args.contexts:
                for part, shape, q_len, k in (("decoder", DECODER, 1, 1),
                                              ("encoder", ENCODER_CALL, 4,
                                               ENCODER_PER_POSITION)):
                    for variant in ("full", "trimmed", "keys"):
                        rows.append({"part": part, **_case(
                            torch, fa, shape, batch, context * k, q_len, kv, 0,
                            args.iters, args.repeats, variant=variant)})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 14, 28])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="decoder positions per session (past 8,192 the window slides); "
                         "default 512 8192 16000, with --trim " +
                         " ".join(map(str, TRIM_CONTEXTS)))
    ap.add_argument("--trim", action="store_true",
                    help="vLLM's call against the window-trimmed one (engine.vllm.window_trim)")
    args = ap.parse_args(argv)
    if args.contexts is None:
        args.contexts = list(TRIM_CONTEXTS) if args.trim else [512, 8192, 16000]
    try:
        import torch
        from vllm import vllm_flash_attn as fa
    except ImportError as exc:
        print(json.dumps({"error": f"needs torch and vLLM's FA3 build: {exc}"}))
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA GPU"}))
        return 2
    if args.trim:
        from workers.engines.vllm.reanchor import window_trim

        # the engine core's own check before it switches the lever on (None: passes)
        checks = {f"{kv} {mode}": window_trim.check("cuda", dtype, mode) for kv, dtype in
                  (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))
                  for mode in window_trim.MODES}
        trimmed = _trim_rows(torch, fa, args)
        print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "iters": args.iters, "repeats": args.repeats, "check": checks,
                          "trim": trim_summary(trimmed), "rows": trimmed}, indent=1))
        return 0
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
