"""Whether CUDA MPS runs for this process's GPU, and what it costs to run without it.

Without MPS a GPU runs one process's kernels at a time and switches between the
processes' contexts. Engines that share a GPU (`engine.vllm.engines_per_gpu` > 1) each
run small batches, so their kernels could run side by side. Under MPS they do. Measured on
the H200 (vLLM 0.26.0, random weights, three engines with fp8 KV and the "keys" trim,
production feed, 112 sessions aged 30 min, two runs back to back on one host,
2026-12-03): 9.58 frames/s per session p50 without MPS (0 of 112 real time, GPU 100 %
busy), 12.15 with it (75 of 112); 110 held under MPS (110 of 110 over the phase, one run).
README, *CUDA MPS*. An operator whose GPU nodes run MPS says so (`engine.vllm.cuda_mps`):
the budget is then the knee measured under MPS, and an engine with no daemon answering
refuses to start.

MPS is the GPU node's business, not the project's: its control daemon
(`nvidia-cuda-mps-control -d`) must be up before the engines create their CUDA contexts,
with the same pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, default /tmp/nvidia-mps) as they
see. The ASR actor only asks that daemon, through the same binary, whether it answers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

CONTROL = "nvidia-cuda-mps-control"

MEASURED = ("H200, three engines, 112 sessions aged 30 min: 9.58 frames/s per session "
            "without MPS, 12.15 with it")


def mps_servers(timeout_s: float = 10.0) -> list[str] | None:
    """The MPS servers the control daemon on this process's pipe directory reports (an
    empty list: the daemon is up and no client has started a server yet), or None when no
    daemon answers (or its binary is not installed)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([CONTROL], input="get_server_list\n", capture_output=True,
                             text=True, timeout=timeout_s)
        if out.returncode == 0:
            return out.stdout.split()
    return None


def mps_missing() -> str:
    """Why an engine told the node runs MPS (`engine.vllm.cuda_mps`) will not start."""
    return (f"engine.vllm.cuda_mps is on but no CUDA MPS control daemon answers on this GPU "
            f"node ({CONTROL} get_server_list failed; pipe directory "
            f"{os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '/tmp/nvidia-mps')}): start "
            f"`{CONTROL} -d` there before the engines, or set cuda_mps false (and a budget "
            f"measured without MPS)")


def mps_advice(engines_per_gpu: int, servers: list[str] | None) -> str | None:
    """What to tell the operator when engines share a GPU without MPS (None: nothing)."""
    if engines_per_gpu <= 1 or servers is not None:
        return None
    return (f"{engines_per_gpu} engines share this GPU without CUDA MPS, so their kernels "
            f"take turns ({MEASURED}): start `{CONTROL} -d` on the GPU node before the "
            f"engines (README, CUDA MPS)")
