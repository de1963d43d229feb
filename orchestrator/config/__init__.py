"""Event configuration: the YAML file an operator writes, as pydantic models, one module
per section of the file.

`load_event` turns every problem (YAML syntax, unknown keys, bad values, cross-field rules)
into a `ConfigError` whose issues name the file, line and key, so an operator can fix the
file without reading a traceback. Validation is pure: it reads the local filesystem to check
file sources exist, and never touches the network or starts anything.

- `services`: redis, ray; `engine`: the ASR engine pool (session, vllm);
  `streams`: streams and the ingest pool (source rules: orchestrator/source_config.py);
  `gateway`: the HTTP gateway (auth and limits: orchestrator/gateway/security_config.py);
  `translation`: the translator pool and the glossary; outputs: orchestrator/outputs/config.py;
  `event`: the root model and the rules across sections; `load`: YAML to the root model.
"""

from orchestrator.config.base import Loc
from orchestrator.config.engine import EngineConfig, SessionConfig, VllmConfig
from orchestrator.config.event import EventConfig
from orchestrator.config.gateway import (
    AUTO_GATEWAY_WORKERS_MAX,
    MAX_GATEWAY_WORKERS,
    GatewayConfig,
    cgroup_cpu_limit,
)
from orchestrator.config.load import ConfigError, ConfigIssue, load_event, parse_event
from orchestrator.config.services import RayConfig, RedisConfig
from orchestrator.config.streams import IngestConfig, ListenTlsConfig, SourceKind, StreamConfig
from orchestrator.config.translation import (
    BackendKind,
    GlossaryEntry,
    OpenAIChatConfig,
    TranslationConfig,
    VllmTranslationConfig,
)

__all__ = [
    "AUTO_GATEWAY_WORKERS_MAX",
    "MAX_GATEWAY_WORKERS",
    "BackendKind",
    "ConfigError",
    "ConfigIssue",
    "EngineConfig",
    "EventConfig",
    "GatewayConfig",
    "GlossaryEntry",
    "IngestConfig",
    "ListenTlsConfig",
    "Loc",
    "OpenAIChatConfig",
    "RayConfig",
    "RedisConfig",
    "SessionConfig",
    "SourceKind",
    "StreamConfig",
    "TranslationConfig",
    "VllmConfig",
    "VllmTranslationConfig",
    "cgroup_cpu_limit",
    "load_event",
    "parse_event",
]
