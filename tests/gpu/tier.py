"""The GPU tier's gate, shared by its modules: where BABELCAST_VOXTRAL_DIR names a model
folder the tier runs, elsewhere its modules are skipped; with the variable set but
something the tier needs missing, a module fails (a GPU run that cannot run must not look
green). No torch.cuda call here: a CUDA context in the test process breaks vLLM's forked
engine core ("Cannot re-initialize CUDA in forked subprocess")."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest


def gpu_tier(modules: tuple[str, ...] = ("vllm",), tools: tuple[str, ...] = ("nvidia-smi",)
             ) -> str:
    """The model folder, or the calling module skipped (unset) or failed (a need missing).
    Call it at module level, before the module's vLLM-dependent imports."""
    model = os.environ.get("BABELCAST_VOXTRAL_DIR", "")
    if not model:
        pytest.skip("set BABELCAST_VOXTRAL_DIR to run the GPU tier", allow_module_level=True)
    missing = ([m for m in modules if not importlib.util.find_spec(m)]
               + [t for t in tools if not shutil.which(t)])
    if missing:
        pytest.fail(f"BABELCAST_VOXTRAL_DIR is set but {', '.join(missing)} is missing "
                    f"(the GPU tier needs vLLM and a CUDA GPU)", pytrace=False)
    return model
