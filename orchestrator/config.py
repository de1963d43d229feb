"""Event configuration: the YAML file an operator writes, as pydantic models.

`load_event` turns every problem (YAML syntax, unknown keys, bad values, cross-field rules)
into a `ConfigError` whose issues name the file, line and key, so an operator can fix the
file without reading a traceback. Validation is pure: it reads the local filesystem to check
file sources exist, and never touches the network or starts anything.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from orchestrator import yaml_bounds
from orchestrator.gateway.security_config import (
    AuthConfig,
    LimitsConfig,
    auth_problems,
    origin_problems,
)
from orchestrator.outputs.config import OutputsConfig, outputs_problems
from orchestrator.source_config import listen_port_problems, resolve_file, source_problems
from translation.backends import KINDS as TRANSLATION_KINDS
from translation.backends import Routes, concrete, no_backend_message

SourceKind = Literal["file", "pyav", "srt", "push"]
Loc = tuple[str | int, ...]

_STREAM_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_LANG = re.compile(r"^[a-z]{2}$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_KINDS: dict[str, SourceKind] = {
    "http": "pyav", "https": "pyav", "rtmp": "pyav", "rtmps": "pyav", "rtsp": "pyav",
    "srt": "srt",
}
_SUPPORTED_SOURCES = ("a file path, file://PATH, http://, https://, rtmp://, rtmps://, rtsp://, "
                      "srt://, push")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _fail(message: str) -> PydanticCustomError:
    # A custom error keeps the operator's message verbatim; a ValueError would be prefixed
    # with "Value error, ". The message goes through the context so braces are not templates.
    return PydanticCustomError("babelcast_config", "{reason}", {"reason": message})


def _raise_at(title: str, problems: list[tuple[Loc, str, object]]) -> None:
    # A ValidationError raised inside a validator keeps its own locations (prefixed by the
    # caller's), which lets a model-level rule point at the exact key that is wrong.
    if problems:
        details = [InitErrorDetails(type=_fail(msg), loc=loc, input=value)
                   for loc, msg, value in problems]
        raise ValidationError.from_exception_data(title, details)


def _check_lang(value: object, allow_auto: bool) -> str:
    if isinstance(value, bool):
        # YAML 1.1 reads an unquoted `no` (Norwegian) as false.
        raise _fail("got a YAML boolean; quote language codes, e.g. 'no'")
    if not isinstance(value, str) or not (_LANG.match(value) or (allow_auto and value == "auto")):
        expected = "'auto' or a" if allow_auto else "a"
        raise _fail(f"expected {expected} 2-letter ISO-639-1 code such as 'en', got {value!r}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class SessionConfig(_Strict):
    """How the session manager keeps every stream captioned (rollover, watchdog, pacing)."""

    budget_s: float | None = Field(
        default=None, gt=0,
        description="audio seconds one engine session may take; null: the engine's own limit")
    margin_s: float = Field(default=30.0, gt=0,
                            description="start a warm rollover this long before the budget")
    overlap_s: float = Field(default=5.0, gt=0,
                             description="audio the new session re-reads before the switch")
    switch_pause_s: float = Field(default=0.25, gt=0,
                                  description="shortest pause a rollover may switch in")
    rut_window_s: float = Field(default=15.0, gt=0, description="rut watchdog window")
    rut_speech_s: float = Field(default=6.0, gt=0,
                                description="speech seconds without text that mean a rut")
    rut_chars_per_speech_s: float = Field(
        default=1.0, ge=0, description="below this many characters per speech second: a rut")
    rut_max_lag_s: float = Field(
        default=30.0, gt=0,
        description="seconds of speech fed to a session while its recognition does not move "
                    "at all (it stopped hearing) before the watchdog replaces it; a session "
                    "that is merely slow is never replaced (it is behind, not stuck)")
    shed_after_s: float | None = Field(
        default=None, gt=0, le=600,
        description="when a stream's captions fall this many seconds behind its audio, skip "
                    "to the live edge and say so: a `gap` event with the seconds skipped in "
                    "the captions and the archive (counted); null (default): keep every word "
                    "up to the input queue's size (~60 s), counting and logging what it drops")
    stall_s: float = Field(
        default=1.0, gt=0,
        description="source silence before dithered noise is fed; raised automatically up to "
                    "stall_max_s for transports that deliver in bursts (MPEG-TS, HLS)")
    stall_max_s: float = Field(default=3.0, gt=0,
                               description="the learned stall threshold never exceeds this")
    dither_lsb: int = Field(default=2, ge=1, le=64, description="noise amplitude in LSB")
    max_fill_s: float = Field(default=10.0, gt=0,
                              description="longer holes start a fresh session instead")

    @model_validator(mode="after")
    def _margin(self) -> Self:
        if self.budget_s is not None and self.margin_s >= self.budget_s:
            raise _fail(f"margin_s ({self.margin_s}) must be below budget_s ({self.budget_s})")
        if self.rut_speech_s > self.rut_window_s:
            raise _fail("rut_speech_s cannot exceed rut_window_s")
        if self.stall_max_s < self.stall_s:
            raise _fail(f"stall_max_s ({self.stall_max_s}) cannot be below stall_s "
                        f"({self.stall_s})")
        return self


class VllmConfig(_Strict):
    """AsyncLLM settings of the vllm engine (see VLLM.md); one engine per GPU actor."""

    max_model_len: int = Field(
        default=16384, ge=256,
        description="positions per session (× 80 ms = session cap without re-anchoring). "
                    "vLLM 0.26 reserves KV cache for one whole max_model_len request at "
                    "~1.1 MiB per position (the encoder's cache counts 4 frames per "
                    "position): 131072 needs 141 GiB and does not start on an H200; "
                    "re-anchoring keeps sessions within 16384")
    gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1,
                                          description="share of GPU memory vLLM may take")
    engines_per_gpu: int = Field(
        default=1, ge=1, le=8,
        description="ASR actors (each a vLLM engine with its own front-end process) that "
                    "share one GPU; each takes gpu_memory_utilization / engines_per_gpu. Two "
                    "held more than one (one engine's per-chunk Python work bounded it); "
                    "three, with fp8 KV and window_trim's keys mode, held 104 sessions aged "
                    "30 min where two held 88; four no more new ones than two "
                    "(bench.voxtral_capacity, README). Run CUDA MPS on the GPU node when "
                    "engines share a GPU: three at 112 aged made 12.15 frames/s per session "
                    "with it, 9.58 without (README, CUDA MPS)")
    cuda_mps: bool = Field(
        default=False,
        description="the GPU nodes run CUDA MPS (their operator starts "
                    "`nvidia-cuda-mps-control -d` before Ray starts the actors): an engine "
                    "that MPS does not serve (no daemon answers, or its engine core is not "
                    "a client of the daemon's server) refuses to start instead of running "
                    "slower than its budget, and with fp8 and three engines per GPU "
                    "the default streams_per_actor is the knee measured under MPS, 36 (110 "
                    "sessions aged 30 min held per H200, 2026-12-03; 34 without)")
    direct_input: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="build each 80 ms chunk's engine input directly instead of through "
                    "vLLM's renderer and HF processor: auto where the two were checked equal "
                    "byte for byte (vLLM 0.26.0 exactly); 12x less front-end CPU per chunk")
    load_format: Literal["mistral", "dummy", "babelcast_scaled"] = Field(
        default="mistral", description="mistral: real weights; dummy: random, every weight "
                    "in ±1e-3 (benchmarks); babelcast_scaled: random at a trained "
                    "checkpoint's scale, so attention depends on its keys (GPU tier)")
    enforce_eager: bool = Field(default=False, description="no CUDA graphs")
    cudagraph_mode: Literal["PIECEWISE", "NONE"] = Field(
        default="PIECEWISE", description="Voxtral refuses FULL graphs")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="at least 400 × (streams + headroom) is used anyway")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto", description="KV cache element type: auto (bf16) or fp8, half the GPU "
                                    "memory per position (sessions aged long are bounded by it)")
    sync_free_melspec: bool = Field(
        default=True,
        description="the encoder's spectrogram without a wait on the GPU per 80 ms chunk "
                    "(vLLM 0.26's makes a device tensor per chunk, which waits for the "
                    "stream); switched on only where it is bitwise equal to vLLM's. On the "
                    "H200 it took 48 sessions aged 30 min from 0 % to 100 % real time on "
                    "two engines (bench.voxtral_capacity +melspec, README)")
    incremental_token_writes: bool = Field(
        default=True,
        description="stage a streaming session's token history on the GPU once instead of "
                    "again at every 80 ms chunk (vLLM 0.26's V2 runner rewrites it whole); "
                    "switched on only where a check on the GPU leaves the rows as vLLM's "
                    "writes would. On the H200 it took 56 sessions aged 30 min from 0 % to "
                    "100 % real time on two engines (bench.voxtral_capacity +tokens, README)")
    window_trim: bool = Field(
        default=True,
        description="hand FlashAttention only the KV blocks each session's sliding window "
                    "can see (vLLM 0.26 hands it an aged session's whole position range, "
                    "and a slid window costs FA3 more); switched on only where a check on "
                    "the GPU finds the trimmed call as accurate as vLLM's. On the H200 it "
                    "took 88 sessions aged 30 min from 0 % to 96.6 % real time on two "
                    "engines, fp8, in one run (bench.voxtral_capacity +trim, README). Its "
                    "'keys' mode (FA3's leftpad_k; taken where its check passes) runs an "
                    "aged decode step at the cost of 8,192 positions from the start: "
                    "1.38-1.81x vLLM's call on an aged decoder layer, fp8 (bench.fa_kernels "
                    "--trim)")
    reanchor: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="keep sessions below max_model_len by re-anchoring their positions: auto "
                    "where tested (vLLM 0.26.0 exactly) and the engine's probe agrees; off: warm "
                    "rollovers before the cap")
    reanchor_every: int = Field(
        default=4096, ge=128, description="positions between a session's re-anchors")
    rollover_headroom: int | None = Field(
        default=None, ge=0,
        description="session slots beyond streams_per_actor for warm rollovers and restarts; "
                    "null: a quarter of streams_per_actor, at least 1")

    @model_validator(mode="before")
    @classmethod
    def _no_delay(cls, data: Any) -> Any:
        # The delay is the model's (one engine per delay): a second copy here could only
        # disagree with it.
        if isinstance(data, dict) and "delay_ms" in data:
            _raise_at("VllmConfig", [(("delay_ms",), "the delay comes from the model "
                                      "folder's tekken.json (audio.transcription_delay_ms); "
                                      "remove this key", data["delay_ms"])])
        return data


class EngineConfig(_Strict):
    kind: Literal["embedded", "realtime-ws", "vllm"] = Field(
        default="embedded",
        description="speech engine: embedded (CPU Whisper), vllm (Voxtral Realtime on a GPU "
                    "per actor) or realtime-ws (a /v1/realtime server)")
    model: str = Field(
        default="whisper-base",
        description="embedded: whisper-base or tiny.en (English-only); vllm: the Voxtral model "
                    "folder; realtime-ws: the model name sent in session.update")
    url: str | None = Field(
        default=None, description="realtime-ws: ws(s):// URL of the /v1/realtime endpoint")
    delay_s: float = Field(default=0.48, ge=0,
                           description="realtime-ws: how far the server's text lags its audio")
    token_env: str | None = Field(
        default=None,
        description="realtime-ws: environment variable holding the token sent as "
                    "`Authorization: Bearer` (another Babelcast's publish token)")
    max_session_s: float | None = Field(
        default=None, gt=0,
        description="realtime-ws: the server's session cap in audio seconds, if known")
    text_lag_s: float = Field(
        default=0.0, ge=0, le=120,
        description="realtime-ws: seconds of speech the server may hear before it sends text "
                    "(0 for vLLM; about 25 for another Babelcast's /v1/realtime, which sends "
                    "a caption's text once it is final)")
    actors: int = Field(default=1, ge=1, description="number of ASR actors")
    failover_after_s: float = Field(
        default=1.0, ge=0.5, le=600,
        description="an ASR actor out of reach this long (dead for good: at once) has its "
                    "streams moved to other actors with room; they resume from their cursor")
    lease_ttl_s: float | None = Field(
        default=1.5, ge=0.5, le=60,
        description="each ASR actor keeps a lease in Redis with this expiry, renewed every "
                    "quarter of it (at most 0.5 s) while its engine works; the supervisor "
                    "moves the streams of an actor whose lease lapsed at once, without "
                    "waiting for Ray to notice a lost node (~18 s) or a frozen one (never); "
                    "null: no lease, Ray's signal and failover_after_s only")
    move_after_lag_s: float | None = Field(
        default=10.0, gt=0, le=600,
        description="a stream whose captions come more than this many seconds after the "
                    "speech, for move_lag_sustain_s, moves to another actor with room that is "
                    "not behind itself; it resumes from its cursor (null: never moves for lag)")
    move_lag_sustain_s: float = Field(
        default=10.0, ge=0, le=3600,
        description="how long a stream must stay behind move_after_lag_s before it moves")
    move_cooldown_s: float = Field(
        default=120.0, ge=0, le=86400,
        description="after a move for lag, the stream does not move for lag again, and the "
                    "actor it left takes no stream moved for lag, for this many seconds")
    streams_per_actor: int = Field(
        default=4, ge=1,
        description="streams one ASR actor decodes; unset: embedded engines take what the "
                    "host's cores sustain in real time for the model, vllm its measured knee "
                    "for sessions aged 30 min (18; orchestrator/capacity.py), other engines 4")
    cpu_threads: int = Field(default=2, ge=1, description="CPU threads per ASR actor")
    step_s: float = Field(default=1.0, gt=0, description="seconds between re-decodes of a stream")
    pause_s: float = Field(default=0.6, gt=0, description="silence in seconds that ends a caption")
    final_pass: Literal["utterance", "agreement"] = Field(
        default="utterance",
        description="embedded: utterance: each final is one decode of the whole utterance at "
                    "a pause (most accurate); agreement: finals as two interim decodes agree")
    final_beam_size: int = Field(default=1, ge=1, le=10,
                                 description="embedded: beam of the final pass")
    session: SessionConfig = Field(default_factory=SessionConfig,
                                   description="session manager: rollover, rut watchdog, pacing")
    vllm: VllmConfig | None = Field(default=None, description="vllm engine settings")

    @model_validator(mode="before")
    @classmethod
    def _default_streams(cls, data: Any) -> Any:
        # Measured per model and core (orchestrator/capacity.py): never past the knee.
        if isinstance(data, dict) and data.get("streams_per_actor") is None:
            from orchestrator.capacity import default_streams_per_actor, vllm_streams_per_actor

            if data.get("kind") == "vllm":
                data = {**data, "streams_per_actor": vllm_streams_per_actor(data.get("vllm"))}
            elif data.get("kind", "embedded") == "embedded":
                data = {**data, "streams_per_actor": default_streams_per_actor(
                    str(data.get("model", "whisper-base")), data.get("cpu_threads", 2),
                    data.get("actors", 1))}
        return data

    @model_validator(mode="after")
    def _kind_fields(self) -> Self:
        if self.kind == "vllm" and self.vllm is None:
            self.vllm = VllmConfig()
        elif self.kind != "vllm" and self.vllm is not None:
            raise _fail("a vllm section needs engine kind vllm")
        if self.kind == "embedded" and self.model not in ("whisper-base", "tiny.en"):
            raise _fail(f"embedded engine model must be 'whisper-base' or 'tiny.en', "
                        f"got {self.model!r}")
        if self.kind == "realtime-ws":
            if not self.url or not self.url.startswith(("ws://", "wss://")):
                raise _fail("engine kind realtime-ws needs url: ws://HOST:PORT/v1/realtime")
        elif self.url is not None:
            raise _fail("url is only for engine kind realtime-ws")
        if self.token_env is not None and self.kind != "realtime-ws":
            raise _fail("token_env is only for engine kind realtime-ws")
        return self


BackendKind = Literal["embedded", "bergamot", "apertium", "openai-chat", "vllm"]
assert set(typing.get_args(BackendKind)) == set(TRANSLATION_KINDS)
_ROUTE_KEY = re.compile(r"^([a-z]{2}|\*)-([a-z]{2}|\*)$")


class OpenAIChatConfig(_Strict):
    url: str = Field(description="base URL of an OpenAI-compatible API, e.g. http://host:8000/v1")
    model: str = Field(description="model name the endpoint serves")
    api_key_env: str | None = Field(
        default=None, description="environment variable holding the API key (not the key)")
    timeout_s: float = Field(default=10.0, gt=0, description="per request")
    max_retries: int = Field(default=2, ge=0, description="retries of a failed request")
    batch_size: int = Field(default=16, ge=1, description="sentences per request")
    concurrency: int = Field(default=4, ge=1, description="requests in flight per translator")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise _fail(f"must start with http:// or https://; got {v!r}")
        return v


class VllmTranslationConfig(_Strict):
    model: str = Field(description="instruction-tuned chat model (folder or name)")
    max_model_len: int = Field(default=8192, ge=512, description="context length")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1,
                                          description="share of the GPU vLLM may take")
    batch_size: int = Field(default=16, ge=1, description="sentences per prompt")


class TranslationConfig(_Strict):
    """The translator pool: how many actors, and which backend translates which pair."""

    actors: int = Field(default=1, ge=1, description="translation actors (job consumers)")
    default: BackendKind = Field(default="embedded",
                                 description="backend for pairs no route names")
    routes: dict[str, BackendKind] = Field(
        default_factory=dict,
        description='backend per pair: "en-pt", or "*-fr" / "en-*" for all sources/targets')
    context_sentences: int = Field(default=3, ge=0, le=10,
                                   description="previous sentences sent as context (LLMs)")
    partials_every_s: float | None = Field(
        default=None, gt=0,
        description="also translate the open sentence (non-final) at most this often; "
                    "null: finals only")
    batch_size: int = Field(default=32, ge=1, description="jobs a translator takes at once")
    timeout_s: float = Field(default=15.0, gt=0,
                             description="longest a backend may take for one batch")
    claim_idle_s: float = Field(
        default=10.0, gt=0,
        description="a job pending this long with a dead translator is taken over")
    openai: OpenAIChatConfig | None = Field(default=None,
                                            description="openai-chat backend settings")
    vllm: VllmTranslationConfig | None = Field(default=None,
                                               description="vllm backend settings")

    @field_validator("routes")
    @classmethod
    def _route_keys(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _ROUTE_KEY.match(k) or k == "*-*"]
        if bad:
            raise _fail(f"route keys look like 'en-pt', '*-pt' or 'en-*'; got {bad[0]!r} "
                        "(use translation.default for every pair)")
        return v

    @model_validator(mode="after")
    def _settings(self) -> Self:
        kinds = {self.default, *self.routes.values()}
        problems: list[tuple[Loc, str, object]] = []
        if "openai-chat" in kinds and self.openai is None:
            problems.append((("openai",), "backend openai-chat is routed but has no settings; "
                             "add translation.openai with url and model", None))
        if "vllm" in kinds and self.vllm is None:
            problems.append((("vllm",), "backend vllm is routed but has no settings; add "
                             "translation.vllm with model", None))
        _raise_at("TranslationConfig", problems)
        return self

    @property
    def routing(self) -> Routes:
        return Routes(default=self.default, pairs=dict(self.routes))


class GlossaryEntry(_Strict):
    term: str = Field(min_length=1, description="the term as spoken in the source")
    keep: bool = Field(default=False,
                       description="do not translate (in languages without a translation)")
    translations: dict[str, str] = Field(
        default_factory=dict, description="forced translation per target language code")
    case_sensitive: bool = Field(default=False, description="match the term's case exactly")

    @field_validator("translations", mode="before")
    @classmethod
    def _langs(cls, v: object) -> object:
        if isinstance(v, dict):
            for k in v:
                _check_lang(k, allow_auto=False)
        return v

    @model_validator(mode="after")
    def _something(self) -> Self:
        if not self.keep and not self.translations:
            raise _fail(f"glossary term {self.term!r} needs keep: true or translations")
        return self


class IngestConfig(_Strict):
    actors: int = Field(default=1, ge=1, description="number of ingest (audio source) actors")


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
                    "connection caps hold per process; see README, Gateway workers")

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


def _split_source(source: str) -> tuple[SourceKind, str]:
    """(kind, rest): rest is the path for files (file:// stripped), else the source as given."""
    if source == "push":
        return "push", source
    m = _SCHEME.match(source)
    if m is None:
        return "file", source
    scheme = m.group(1).lower()
    if scheme == "file":
        return "file", source[m.end():]
    if scheme not in _URL_KINDS:
        raise _fail(f"unknown scheme {scheme + '://'!r}; supported: {_SUPPORTED_SOURCES}")
    return _URL_KINDS[scheme], source


class ListenTlsConfig(_Strict):
    cert: str = Field(description="PEM certificate chain file (relative: to the event file)")
    key: str = Field(description="PEM private key file (relative: to the event file)")


class StreamConfig(_Strict):
    id: str = Field(description="stream id: lowercase letters, digits, '-' and '_', ≤64 chars")
    name: str = Field(default="", description="display name; empty or omitted: the id")
    source: str = Field(min_length=1, description=f"audio source: {_SUPPORTED_SOURCES}")
    loop: bool = Field(default=False, description="restart a file source at its end")
    language: str = Field(default="auto", description="spoken language: 'auto' or ISO-639-1")
    targets: list[str] = Field(
        default_factory=list, description="ISO-639-1 codes to translate captions into")
    key_env: str | None = Field(
        default=None, description="environment variable holding the stream key (RTMP "
                                  "listener) or the SRT passphrase; never the key itself")
    tls: ListenTlsConfig | None = Field(
        default=None, description="rtmps listener: its certificate and key files")
    hls_start_segments: int = Field(
        default=1, ge=1, le=20,
        description="HLS: start this many segments from the live edge (1: the newest)")
    _resolved_source: str = PrivateAttr("")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _STREAM_ID.match(v):
            raise _fail(f"{v!r} is not a valid stream id: use 1-64 lowercase letters, digits, "
                        "'-' or '_', starting with a letter or digit")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        _split_source(v)
        return v

    @field_validator("language", mode="before")
    @classmethod
    def _language(cls, v: object) -> str:
        return _check_lang(v, allow_auto=True)

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, v: object, info: ValidationInfo) -> object:
        if not isinstance(v, list):
            return v  # pydantic reports the wrong type itself
        codes = [_check_lang(t, allow_auto=False) for t in v]
        dups = sorted({t for t in codes if codes.count(t) > 1})
        if dups:
            raise _fail(f"duplicate target language(s): {', '.join(dups)}")
        own = info.data.get("language")
        if own in codes:
            raise _fail(f"{own!r} is the stream's own language; remove it from targets")
        return codes

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> Self:
        self.name = self.name or self.id
        kind, rest = _split_source(self.source)
        base_dir = Path((info.context or {}).get("base_dir") or Path.cwd())
        problems = source_problems(self)
        if self.tls is not None and not any(loc == ("tls",) for loc, _, _ in problems):
            for name in ("cert", "key"):
                path = resolve_file(getattr(self.tls, name), base_dir)
                if not path.is_file():
                    problems.append((("tls", name), f"file not found: {path}",
                                     getattr(self.tls, name)))
                setattr(self.tls, name, str(path))
        _raise_at("StreamConfig", problems)
        if kind != "file":
            self._resolved_source = rest
            return self
        # Relative paths resolve against the YAML file's folder so an event file works from
        # any working directory; without a context (models built in code) the cwd is used.
        base = Path((info.context or {}).get("base_dir") or Path.cwd())
        path = Path(rest).expanduser()
        path = (path if path.is_absolute() else base / path).resolve()
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "file not found"
            _raise_at("StreamConfig", [(("source",), f"{what}: {path}", self.source)])
        self._resolved_source = str(path)
        return self

    @property
    def resolved_source(self) -> str:
        """Absolute path for file sources (file:// stripped); URLs and "push" unchanged."""
        return self._resolved_source

    @property
    def source_kind(self) -> SourceKind:
        return _split_source(self.source)[0]


class EventConfig(_Strict):
    event: str = Field(description="event name, shown in the UI and logs")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="caption bus")
    ray: RayConfig = Field(default_factory=RayConfig, description="where actors run")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="ASR engine pool")
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="audio ingest pool")
    streams: list[StreamConfig] = Field(min_length=1, description="audio streams to caption")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway")
    auth: AuthConfig | None = Field(
        default=None,
        description="tokens for publishing, reading and administering; null: on a loopback "
                    "gateway, tokens made per run; elsewhere an error")
    translation: TranslationConfig = Field(default_factory=TranslationConfig,
                                           description="translator pool and backend routes")
    glossary: list[GlossaryEntry] = Field(
        default_factory=list, description="terms with forced translations or kept as is")
    outputs: OutputsConfig = Field(
        default_factory=OutputsConfig,
        description="caption outputs: archives, live HLS WebVTT, YouTube Live")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `redis:` with nothing under it is YAML null; treat it as "all defaults".
        sections = ("redis", "ray", "engine", "ingest", "gateway", "translation", "outputs")
        if isinstance(data, dict):
            data = {k: ({} if k in sections and v is None else v) for k, v in data.items()}
            # Validated (not defaulted) so that their relative folders (archives, the
            # local redis-server's append-only file) resolve against the event file, like
            # every other path in it, not against the folder babelcast was started from.
            data.setdefault("outputs", {})
            data.setdefault("redis", {})
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> Self:
        problems: list[tuple[Loc, str, object]] = []
        seen: dict[str, int] = {}
        for i, s in enumerate(self.streams):
            if s.id in seen:
                problems.append((("streams", i, "id"),
                                 f"duplicate stream id {s.id!r} (first used by streams"
                                 f"[{seen[s.id]}])", s.id))
            seen.setdefault(s.id, i)
            if (self.engine.kind == "embedded" and self.engine.model == "tiny.en"
                    and s.language != "en"):
                problems.append((("streams", i, "language"),
                                 f"model 'tiny.en' is English-only but language is "
                                 f"{s.language!r}; set language: en or engine.model: "
                                 "whisper-base", s.language))
            routes = self.translation.routing
            for j, target in enumerate(s.targets):
                kind = routes.kind_for(s.language, target)
                if concrete(kind, s.language, target) is None:
                    problems.append((("streams", i, "targets", j),
                                     no_backend_message(kind, s.language, target), target))
        n, e = len(self.streams), self.engine
        if n > e.actors * e.streams_per_actor:
            problems.append((("streams",), f"{n} streams configured but the engine pool fits "
                             f"{e.actors * e.streams_per_actor} (engine.actors {e.actors} × "
                             f"engine.streams_per_actor {e.streams_per_actor}); raise "
                             "engine.actors or engine.streams_per_actor", n))
        problems += [(("outputs", *loc), msg, v)
                     for loc, msg, v in outputs_problems(self.outputs, self.streams)]
        problems += auth_problems(self.auth, self.gateway.host, self.streams)
        problems += [(("gateway", "allowed_origins", *loc), msg, v)
                     for loc, msg, v in origin_problems(self.gateway.allowed_origins)]
        problems += listen_port_problems(self.streams)
        if self.ray.address is not None and self.redis.url is None:
            problems.append((("redis", "url"), "ray.address runs actors on other machines, "
                             "which cannot reach a redis-server started on this one (it "
                             "listens on 127.0.0.1): set redis.url to a Redis every node "
                             "reaches", None))
        _raise_at("EventConfig", problems)
        return self


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    file: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}"


class ConfigError(Exception):
    def __init__(self, errors: list[ConfigIssue]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def _index_lines(node: yaml.Node, path: Loc, lines: dict[Loc, int],
                 dups: list[tuple[Loc, int]]) -> None:
    """Map key paths to 1-based lines: the key node for mapping keys, the item for lists."""
    if len(path) > 64:  # a recursive alias (`&a [*a]`) would otherwise never end
        return
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            sub = (*path, key_node.value)
            if sub in lines and key_node.value != "<<":
                dups.append((sub, key_node.start_mark.line + 1))
            lines[sub] = key_node.start_mark.line + 1  # the last duplicate is the one kept
            _index_lines(value_node, sub, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _index_lines(item, (*path, i), lines, dups)


def _display_key(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out or "<top level>"


def _line_for(loc: Loc, lines: dict[Loc, int]) -> int | None:
    # A missing key has no line of its own: point at the nearest parent that exists.
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc)


def _allowed_keys(parent: Loc) -> list[str]:
    """Keys the model at `parent` accepts, found by walking the field annotations."""
    model: type[BaseModel] | None = EventConfig
    for part in parent:
        if isinstance(part, str) and model is not None:
            field = model.model_fields.get(part)
            hints = (field.annotation, *typing.get_args(field.annotation)) if field else ()
            model = next((h for h in hints if isinstance(h, type) and issubclass(h, BaseModel)),
                         None)
    return list(model.model_fields) if model else []


def _message(err: Any) -> str:
    loc: Loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"unknown key {loc[-1]!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if err["type"] == "missing":
        return "required key is missing"
    return str(err["msg"])


def parse_event(text: str, *, filename: str = "<string>",
                base_dir: Path | None = None) -> EventConfig:
    """Parse and validate event YAML; relative file sources resolve against `base_dir`."""
    loader: yaml.SafeLoader | None = None
    try:
        # The constructor already reads: a control character fails here (found by fuzzing).
        # Composed under a budget of aliases and expanded size before anything walks it.
        root, loader = yaml_bounds.compose(text)
        lines: dict[Loc, int] = {}
        dups: list[tuple[Loc, int]] = []
        if root is not None:
            # Before construction: merge keys (`<<: *defaults`) rewrite the nodes in place,
            # after which a merged key and its override read as a duplicate.
            lines[()] = root.start_mark.line + 1
            _index_lines(root, (), lines, dups)
        data = loader.construct_document(root) if root is not None else None
    except yaml_bounds.AliasRefused as e:
        raise ConfigError([ConfigIssue(filename, e.line, _display_key(e.path) if e.path
                                       else "<yaml>", e.message)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        parts = (getattr(e, "context", None), getattr(e, "problem", None))
        problem = "; ".join(p for p in parts if p) or str(e)
        raise ConfigError([ConfigIssue(filename, line, "<yaml>", problem)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if root is None:
        raise ConfigError([ConfigIssue(filename, None, "<top level>", "file is empty; expected "
                                       "a mapping with at least 'event' and 'streams'")])
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError([ConfigIssue(filename, root.start_mark.line + 1, "<top level>",
                                       f"expected a mapping of keys, got a {kind}")])
    # YAML silently keeps the last of two equal keys; an operator almost never means that.
    issues = [ConfigIssue(filename, ln, _display_key(loc), "duplicate key; the earlier one "
                          "would be ignored") for loc, ln in dups]
    try:
        config = EventConfig.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as e:
        issues += [ConfigIssue(filename, _line_for(tuple(err["loc"]), lines),
                               _display_key(tuple(err["loc"])), _message(err))
                   for err in e.errors(include_url=False)]
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: (i.line or 0, i.key)))
    return config


def load_event(path: str | os.PathLike[str]) -> EventConfig:
    """Read and validate an event YAML file; raises ConfigError with file:line: key: message."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([ConfigIssue(str(p), None, "<file>", f"cannot read: {e}")]) from None
    return parse_event(text, filename=str(p), base_dir=p.parent.resolve())
