"""Whether CUDA MPS runs for this process's GPU, and what it costs to run without it.

Without MPS a GPU runs one process's kernels at a time and switches between the
processes' contexts. Engines that share a GPU (`engine.vllm.engines_per_gpu` > 1) each
run small batches, so their kernels could run side by side. Under MPS they do. Measured on
the H200 (vLLM 0.26.0, random weights, three engines with fp8 KV and the "keys" trim,
production feed, 112 sessions aged 30 min, two runs back to back on one host,
2026-12-03): 9.58 frames/s per session p50 without MPS (0 of 112 real time, GPU 100 %
busy), 12.15 with it (75 of 112); 110 held under MPS (110 of 110 over the phase, one run).
docs/gpu.md, *CUDA MPS*. An operator whose GPU nodes run MPS says so (`engine.vllm.cuda_mps`):
the budget is then the knee measured under MPS, and an engine that MPS does not serve
refuses to start.

MPS is the GPU node's business, not the project's: its control daemon
(`nvidia-cuda-mps-control -d`) must be up before the engines create their CUDA contexts,
with the same pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, default /tmp/nvidia-mps) as they
see. The ASR actor only asks that daemon, through the same binary, which servers it runs
(`get_server_list`) and which processes are their clients (`get_client_list <server>`).
A daemon that answers proves nothing about this engine: one that started after the
engine's CUDA context, or that listens on another pipe directory, leaves the engine
outside MPS. So MPS counts as on only where the engine's engine-core process (the one
that holds its CUDA context) is a client. PIDs are compared as this process sees them;
where the daemon runs in another PID namespace (a container of its own) they may differ,
and an engine told `cuda_mps` would then refuse to start: not tried on such a node yet.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Collection

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


def mps_clients(server: str, timeout_s: float = 10.0) -> list[int] | None:
    """The PIDs of the client processes connected to MPS server `server` (one of
    `mps_servers()`), or None when no daemon answers."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([CONTROL], input=f"get_client_list {server}\n",
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode == 0:
            return [int(word) for word in out.stdout.split() if word.isdigit()]
    return None


def mps_unserved(pids: Collection[int], timeout_s: float = 10.0) -> str | None:
    """Why MPS does not serve the processes `pids` (an engine's engine core), or None when
    one of them is a client of a server of the daemon on this pipe directory."""
    if not pids:
        return "the engine-core process was not found"
    servers = mps_servers(timeout_s)
    if servers is None:
        return f"no CUDA MPS control daemon answers ({CONTROL} get_server_list failed)"
    if not servers:
        return "the MPS control daemon runs no server: no CUDA process is its client"
    clients: set[int] = set()
    for server in servers:
        clients.update(mps_clients(server, timeout_s) or ())
    if clients & set(pids):
        return None
    return (f"engine core pid {', '.join(map(str, sorted(pids)))} is not a client of MPS "
            f"server {', '.join(servers)}")


def pipe_directory() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def mps_missing() -> str:
    """Why an engine told the node runs MPS (`engine.vllm.cuda_mps`) will not start."""
    return (f"engine.vllm.cuda_mps is on but no CUDA MPS control daemon answers on this GPU "
            f"node ({CONTROL} get_server_list failed; pipe directory "
            f"{pipe_directory()}): start `{CONTROL} -d` there before the engines, or set "
            f"cuda_mps false (and a budget measured without MPS)")


def mps_refused(why: str) -> str:
    """Why an engine told the node runs MPS will not start although a daemon answers."""
    return (f"engine.vllm.cuda_mps is on but CUDA MPS does not serve this engine ({why}; "
            f"pipe directory {pipe_directory()}): start `{CONTROL} -d` with that pipe "
            f"directory before the engines and restart this ASR actor (an engine whose CUDA "
            f"context came first, or that sees another CUDA_MPS_PIPE_DIRECTORY or PID "
            f"namespace, stays outside MPS), or set cuda_mps false (and a budget measured "
            f"without MPS)")


def mps_advice(engines_per_gpu: int, on: bool) -> str | None:
    """What to tell the operator when engines share a GPU without MPS (None: nothing)."""
    if engines_per_gpu <= 1 or on:
        return None
    return (f"{engines_per_gpu} engines share this GPU without CUDA MPS, so their kernels "
            f"take turns ({MEASURED}): start `{CONTROL} -d` on the GPU node before the "
            f"engines (docs/gpu.md, CUDA MPS)")
