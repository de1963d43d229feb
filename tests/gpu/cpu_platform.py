"""A pytest plugin for running the scheduler-only GPU tier module on a host without a GPU:
vLLM's platform forced to CPU, so its config and scheduler objects build. Nothing runs
a model. With vLLM 0.26.0 (and torch 2.11.0) installed in a Python 3.12 environment:

    BABELCAST_VOXTRAL_DIR=/tmp/voxtral python -m pytest -p tests.gpu.cpu_platform \\
        --noconftest tests/gpu/test_reanchor_scheduler.py

(`python -m tests.gpu.voxtral_model /tmp/voxtral` makes the model folder; `--noconftest`
because the suite's conftest imports the embedded engine's packages, which that
environment need not have.)"""

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()
