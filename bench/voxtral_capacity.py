"""Voxtral capacity on one GPU, in one run: how many real-time sessions vLLM's own serving
path holds, and how many the project's `vllm` engine holds with each lever.

    python -m bench.voxtral_capacity --model DIR --find-knee [--ladder 64 96 128 160] \\
        [--configs stock project project-x2] [--seconds 12] [--rounds 2] --json
    python -m bench.voxtral_capacity --model DIR --streams 64 --json   # one level

Every engine runs in a process of its own (a *front end*: AsyncLLM, its output loop and
the feeding loop, as an ASR actor is), started one after another; this process only
orchestrates, samples the GPU and adds up. Configurations:
- `stock`: vLLM's realtime serving path (`OpenAIServingRealtime.transcribe_realtime`)
  on front end 0 — what `vllm serve` does per WebSocket, without the socket;
- `project`: the project's engine sessions on the same front end 0 (same AsyncLLM);
- `project-direct`: the same, with each chunk's engine input built directly
  (`workers/engines/vllm/direct.py`) instead of the renderer and the HF processor;
- `project-x2`, `project-direct-x2`: two front ends on the one GPU (1 and 2), half of
  the sessions each — the production shape of `engine.vllm.engines_per_gpu: 2`;
  `-x3`, `-x4`: three or four front ends (1…4), a third or a quarter of the sessions each.
- `…+melspec` (any of the project's): the same engines with their engine cores'
  spectrogram made without a GPU wait per chunk (`engine.vllm.sync_free_melspec`,
  switched per phase, so with and without run on the same engines in one run).
- `…+tokens`, `…+melspec+tokens`: the same with the engine cores' incremental token
  history writes (`engine.vllm.incremental_token_writes`), switched the same way.
- `…+melspec+tokens+trim`: and FlashAttention handed only the KV blocks each session's
  window sees (`engine.vllm.window_trim`'s "blocks" mode), switched the same way;
  `…+melspec+tokens+keys`: only the keys it sees (its "keys" mode, FA3's `leftpad_k`,
  the plain causal kernel for one-token queries). A lever a configuration
  does not name is off in its phases (the stock path runs with none).
Front ends 1…N start only if an `-xN` configuration is asked for. Each gets
`--gpu-memory-utilization / engines` of the GPU (so measure one N per run: a `-x2` run
next to `-x4` engines would have half the GPU's memory).

Each session is fed 80 ms of real speech every 80 ms. A session is real time when it
decodes ≥ 12.0 frames/s (12.5 is exact) over the measured window (after 3 s of warm-up).
With `--find-knee`, every configuration runs at each ladder level, in an order rotated
every round, `--rounds` times; the level counts for a configuration when the median over
rounds of its real-time share is ≥ 95 %, and its knee is the largest such level (a
configuration stops climbing at its first miss). Every configuration is warmed up at the
first level before anything is measured. Also reported per phase: CPU per chunk (µs) of
the front-end processes and of their engine-core processes, and GPU utilisation (p50).
Random weights (`--load-format dummy`) give random text and a real cost per step.

Like production:
- `--production`: the project's sessions are fed as an ASR actor feeds them, through a
  session manager per stream with Silero voice activity in helper processes
  (`VadService`, one per 40 streams); their CPU is reported as `helpers_us_per_chunk`.
- `--age-min M --aged-ladder N…`: after the knee, the project's configurations run at
  those levels with sessions first aged M minutes (fed in bulk prompts of 768 frames with
  blanks fed back, re-anchoring as configured: bench.voxtral_age; at most
  `--age-concurrency` sessions per front end in their bulk steps at once, since each holds
  the KV cache of its whole step), climbing until the first miss (`aged_knee`). With
  `--production` too, the aged phases use the production feed (`aged-production`): each
  stream's session manager opens its engine session, which first takes its age in bulk
  steps and then the stream's live audio, with VAD; a session the manager opens later
  (a restart) is new, as in production. Ageing counts as stuck once no session got a
  step for 45 s. vLLM's
  stock path has no aged steady state (it cannot re-anchor; its sessions end at
  max_model_len), so it is measured on new sessions only.
- `--aged-ab --ab-windows W`: configurations that differ only in their engine-core
  levers (e.g. `…+trim` and `…+keys`) share one aged phase per level: the sessions age
  once and are measured in W windows of `--seconds`, the levers switched between windows
  in turn (A B A B …), all front ends starting their windows together; each
  configuration's figures come from its own windows (and its GPU use from the samples in
  them). Why: two runs on one host (2026-12-02) gave whichever aged phase ran second
  ~0.5-1.1 frames/s more, as much as the levers differed, and every CPU figure of the
  first phase (VAD helpers too, which no lever touches) up to 18 % higher. A lever
  switched mid-phase leaves the backlog of the window before it: a window above real
  time catches up, so its frames/s may read above 12.5; below real time it reads its
  capacity. First run on the H200 on 2026-12-03 (110 aged, `+pin` against none). `+pin`
  (each engine-core process on a physical core of its own, everything else off those
  cores) switches the same way. Each
  configuration's row also gives every front end's (engine's) real-time sessions, p50 and
  engine-core CPU; a plain phase's row has them in `by_front_end`.
- `--share-front-end`: the one-engine configurations run on front end 1 of the -xN
  group, so N engines share the GPU's memory as `engines_per_gpu: N` would.
- `--max-model-len 16384`: the engine's production default (re-anchoring keeps sessions
  below it; 131072 needs 141 GiB of KV cache on vLLM 0.26 and does not start).
- `--profile-dir D --profile-level N`: py-spy (67 Hz, raw) on every front end taking part
  and its children over the measured window of each phase at level N (new or aged
  sessions: after ageing and warm-up); `profiles` gives each process's share and the top
  leaf frames. py-spy's own messages go to `D/<phase>.log`.
- `--gpu-profile` (with `--profile-dir`): also vLLM's torch profiler in every engine core
  taking part, for `GPU_PROFILE_S` of the same window (CUDA activity: kernels, copies;
  CPU: vLLM's per-step annotations). `gpu_profiles` gives per engine the steps, the GPU's
  busy share of the window (the union of its kernels and copies), GPU time per step and
  the kernels with the most GPU time. The raw traces stay in `D/torch-fe<k>/`. The
  profiler runs over the window's last `GPU_PROFILE_S` (the engine core writes the trace
  when it stops, after the window); CUPTI slows those seconds, so read that phase's
  frames/s as perturbed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity.ageing import AGE_BULK, AGE_CONCURRENCY  # noqa: E402
from bench.capacity.configs import CONFIGS, ab_refusal  # noqa: E402
from bench.capacity.knee import main_async  # noqa: E402
from workers.engines.vllm.options import KV_TRACE_ENV as TRACE_ENV  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--streams", type=int, default=64, help="one level (without --find-knee)")
    ap.add_argument("--find-knee", action="store_true",
                    help="climb --ladder; per configuration the largest level with ≥ 95 %% "
                         "of sessions real time")
    ap.add_argument("--ladder", type=int, nargs="+", default=[64, 96, 128, 160])
    ap.add_argument("--configs", nargs="+", default=["stock", "project", "project-x2"],
                    choices=CONFIGS)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="for the whole GPU; each engine gets its share")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per level, order rotated; the median is reported")
    ap.add_argument("--age-min", type=float, nargs="+", default=None,
                    help="with --aged-ladder: after the knee, the project's configurations "
                         "at those levels with sessions aged this many minutes (first "
                         "value); alone: cost per chunk of sessions aged this many minutes, "
                         "with and without re-anchoring (bench.voxtral_age)")
    ap.add_argument("--aged-ladder", type=int, nargs="+", default=None)
    ap.add_argument("--production", action="store_true",
                    help="feed the project's sessions as an ASR actor does: a session "
                         "manager per stream with voice activity in helper processes")
    ap.add_argument("--share-front-end", action="store_true",
                    help="one-engine configurations run on front end 1 of the -x2 pair "
                         "(no third engine: the pair keeps the GPU's memory)")
    ap.add_argument("--profile-dir", default=None,
                    help="py-spy the front ends (and their children) at --profile-level")
    ap.add_argument("--profile-level", type=int, default=None,
                    help="the level (new sessions and aged) to profile")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="with --profile-dir: also vLLM's torch profiler in the engine cores "
                         "at --profile-level (`gpu_profile` per phase: GPU busy share, GPU "
                         "time per step, top kernels)")
    ap.add_argument("--partial", default=None,
                    help="write the rows measured so far to this file after every phase")
    ap.add_argument("--age-concurrency", type=int, default=AGE_CONCURRENCY,
                    help="sessions per front end in their bulk ageing steps at once")
    ap.add_argument("--aged-ab", action="store_true",
                    help="aged levels: one phase for all the project's configurations, "
                         "which must differ only in their engine-core levers, switched in "
                         "turn over --ab-windows windows of --seconds on the same aged "
                         "sessions (no second ageing, no phase order)")
    ap.add_argument("--ab-windows", type=int, default=4,
                    help="windows of an --aged-ab phase (A B A B …)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the engines' KV cache element type (engine.vllm.kv_cache_dtype)")
    ap.add_argument("--kv-trace", default=None,
                    help="folder: the engines' schedulers write where their KV cache is, "
                         "and each phase reports it (`kv`)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.gpu_profile and not (args.profile_dir and args.profile_level):
        ap.error("--gpu-profile needs --profile-dir and --profile-level")
    if args.aged_ab:
        why = ab_refusal([c for c in args.configs if c != "stock"], args.ab_windows)
        if why:
            ap.error(f"--aged-ab: {why}")
    if args.age_min is not None and not args.aged_ladder:
        from bench import voxtral_age

        aged = argparse.Namespace(
            model=args.model, streams=args.streams, seconds=args.seconds,
            age_min=args.age_min, every=4096, bulk=AGE_BULK,
            max_model_len=max(args.max_model_len, 32768), load_format=args.load_format,
            gpu_memory_utilization=args.gpu_memory_utilization)
        result = asyncio.run(voxtral_age.main_async(aged))
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    if args.kv_trace:  # read by the engine cores' schedulers, which inherit it
        Path(args.kv_trace).mkdir(parents=True, exist_ok=True)
        os.environ[TRACE_ENV] = str(Path(args.kv_trace).resolve())
    result = asyncio.run(main_async(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
