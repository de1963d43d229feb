"""The services an event runs on: its Redis (the caption bus) and its Ray cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from orchestrator.config.base import _fail, _raise_at, _Strict

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class RedisConfig(_Strict):
    url: str | None = Field(default=None, description="Redis URL; null: start a local redis")
    data_dir: str | None = Field(
        default=None,
        description="local redis-server only: folder of its append-only file (relative to "
                    "the event file); null: .babelcast/redis beside the event file")
    _resolved_data_dir: str = PrivateAttr("")

    @model_validator(mode="after")
    def _data_dir(self, info: ValidationInfo) -> Self:
        if self.url is not None and self.data_dir is not None:
            _raise_at("RedisConfig", [(("data_dir",), "only for the local redis-server; "
                                       "remove it or remove redis.url", self.data_dir)])
        base = Path((info.context or {}).get("base_dir") or Path.cwd())
        path = Path(self.data_dir or ".babelcast/redis").expanduser()
        self._resolved_data_dir = str(path if path.is_absolute() else base / path)
        return self

    @property
    def resolved_data_dir(self) -> str:
        """Absolute folder for the local redis-server's AOF files."""
        return self._resolved_data_dir

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(_REDIS_SCHEMES):
            raise _fail(f"must start with {', '.join(_REDIS_SCHEMES)}; got {v!r}")
        return v


class RayConfig(_Strict):
    address: str | None = Field(
        default=None, description='cluster address ("auto", "ray://host:10001"); null: local')
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs for a local Ray; null: all")

    @model_validator(mode="after")
    def _local_only(self) -> Self:
        # ray.init refuses num_cpus when connecting to an existing cluster; say so at load time.
        if self.address is not None and self.num_cpus is not None:
            _raise_at("RayConfig", [(("num_cpus",), "only applies to a local Ray; remove it "
                                     "or remove ray.address", self.num_cpus)])
        return self
