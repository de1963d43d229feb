#!/usr/bin/env bash
# Install what is missing, then run the demo event: two rooms captioned live on the CPU.
# Extra arguments go to `babelcast run` (e.g. --duration 120 or --plain).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/babelcast run examples/demo.yaml "$@"
