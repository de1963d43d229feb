"""The host the knee depends on: its CPU and GPU (the fingerprint a result carries), its
physical cores, and how busy it is (GPU utilisation, the CPU of this process's
children).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from workers.engines.vllm.mps import mps_servers


def host_fingerprint() -> dict[str, Any]:
    """What the knee depends on besides the GPU: the host's CPU (hosts differ a lot)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(["nvidia-smi", *gpu_select(), "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), **cpu_topology(), "gpu": gpu,
            **({"cuda_visible_devices": os.environ["CUDA_VISIBLE_DEVICES"]}
               if gpu_select() else {}),
            "mps": mps_servers()}


def gpu_select() -> list[str]:
    """nvidia-smi's `-i N` for the one GPU `CUDA_VISIBLE_DEVICES` gives this bench (two
    levels side by side on a 2-GPU host, one per GPU); nvidia-smi itself ignores that
    variable and would report every GPU, the first one first."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return ["-i", visible] if visible.isdigit() else []


def cpu_topology() -> dict[str, Any]:
    """Physical cores behind the logical CPUs this process may use: three engine cores,
    their front ends and VAD helpers on 16 hyperthreads of 8 cores are not on 16 cores."""
    usable = os.sched_getaffinity(0)
    return {"usable_cpus": len(usable), "physical_cores": len(cpu_groups(usable)) or None}


def cpu_groups(usable: set[int]) -> list[list[int]]:
    """The usable CPUs grouped by physical core (hardware-thread siblings), in CPU order."""
    groups: dict[str, list[int]] = {}
    for cpu in sorted(usable):
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                       "thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values())


async def _gpu_util(stop: asyncio.Event, out: list[float],
                    stamps: list[float] | None = None) -> None:
    while not stop.is_set():
        try:
            res = await asyncio.to_thread(
                subprocess.run, ["nvidia-smi", *gpu_select(), "--query-gpu=utilization.gpu",
                                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5)
            out.append(float(res.stdout.split()[0]))
            if stamps is not None:
                stamps.append(time.monotonic())
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        await asyncio.sleep(1.0)


def _children_cpu_s(skip: frozenset[int] = frozenset()) -> tuple[float, float]:
    """CPU seconds of this process's children but `skip` (pids): (vLLM's engine core, the
    rest: the VAD helper processes in production mode). Helpers that exit in a phase are
    not counted, so the VAD pool lives for the whole phase."""
    import psutil

    core = other = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid in skip:
            continue
        try:
            t = child.cpu_times()
            name = " ".join([child.name(), *child.cmdline()])
        except psutil.Error:
            continue
        if "EngineCore" in name:  # vLLM titles its engine-core process VLLM::EngineCore
            core += t.user + t.system
        else:
            other += t.user + t.system
    return core, other
