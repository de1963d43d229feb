"""The HTTP gateway: where it listens, which origins it serves, its limits and processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from orchestrator.config.base import _fail, _Strict
from orchestrator.gateway.security_config import LimitsConfig


class GatewayConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="gateway port; 0 picks a free port")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="web origins (scheme://host[:port]) whose pages may open WebSockets "
                    "besides the gateway's own; '*' allows any")
    limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                 description="bounds on connections, audio and queues "
                                             "(the connection caps hold per worker)")
    workers: int | Literal["auto"] = Field(
        default="auto",
        description="gateway processes serving the port (SO_REUSEPORT), 1-64; 'auto': one "
                    "per core, at most 16. /metrics and /v1/status count them all; the "
                    "connection caps hold per process; see docs/deployment.md, Gateway workers")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: object) -> object:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_GATEWAY_WORKERS:
            raise _fail(f"workers is the number of gateway processes: an integer 1-"
                        f"{MAX_GATEWAY_WORKERS} or 'auto' (one per core), not {v!r}")
        return v

    def worker_count(self) -> int:
        """`workers` as a number: 'auto' is the cores this process may use (its CPU
        affinity, and a container's CPU limit where one is set), at most 16."""
        if self.workers != "auto":
            return self.workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        quota = cgroup_cpu_limit()
        if quota is not None:
            cores = min(cores, quota)
        return max(1, min(AUTO_GATEWAY_WORKERS_MAX, cores))


MAX_GATEWAY_WORKERS = 64
AUTO_GATEWAY_WORKERS_MAX = 16


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Whole cores of this process's cgroup CPU limit, rounded up (a container's
    `resources.limits.cpu`; affinity does not show it); None without one (cgroup v2
    `cpu.max`, else v1 `cpu.cfs_quota_us`; only the root cgroup's files are read, which
    is what a container sees)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no limit
        return None
    if q <= 0 or p <= 0:  # v1 says -1 for none
        return None
    return max(1, -(-q // p))
