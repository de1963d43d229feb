#!/usr/bin/env bash
# Install what is missing, then run every check: ruff, mypy, the event validator, pytest.
# Extra arguments go to pytest (e.g. -k pipeline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff";   .venv/bin/ruff check .
echo "== mypy";   .venv/bin/mypy
echo "== babelcast validate examples/demo.yaml"; .venv/bin/babelcast validate examples/demo.yaml
# --durations: the slowest tests, so a run shows where the suite's time goes (~15 min aim).
# Two workers, a test file each at a time (xdist's loadfile: a file's module fixtures, its
# Ray and its models, stay in one worker): the suite mostly waits on real time (speech fed
# at its pace, outages held for their seconds), 7.5 min of CPU in 22.5 min one at a time
# (2026-12-04). `-n 0` runs it in one process.
echo "== pytest"; .venv/bin/pytest -ra -n 2 --dist loadfile --durations=25 "$@"
