#!/usr/bin/env bash
# Install what is missing, then run every check: ruff, mypy, the event validator, pytest.
# Extra arguments go to pytest (e.g. -k pipeline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff";   .venv/bin/ruff check .
echo "== mypy";   .venv/bin/mypy
echo "== babelcast validate examples/demo.yaml"; .venv/bin/babelcast validate examples/demo.yaml
# --durations: the slowest tests, so a run shows where the suite's time goes (~15 min aim)
echo "== pytest"; .venv/bin/pytest -ra --durations=25 "$@"
