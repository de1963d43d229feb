"""The `outputs:` section of the event file, and how it becomes running outputs.

```yaml
outputs:
  archive: {dir: archives, profile: web}          # dir: null turns archives off
  hls: {segment_s: 6, window: 10, delay_s: 6, mpegts: 0}
  youtube:
    - {stream: hall-a, lang: en, url_env: YT_HALL_A_CAPTIONS}
```

The YouTube ingestion URL holds the stream key, so the file names only the
environment variable that holds it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from orchestrator.outputs.hls import HlsOptions
from orchestrator.outputs.runner import OutputsOptions, OutputsRunner
from orchestrator.outputs.youtube import YoutubeConfigError, YoutubeOptions
from workers.bus import connect_redis
from workers.captions.linebreak import get_profile
from workers.events import StreamOptions

log = logging.getLogger(__name__)

ProfileName = Literal["web", "cea608", "youtube"]
Loc = tuple[str | int, ...]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LANG = re.compile(r"^[a-z]{2}$")


# The same conventions as orchestrator/config.py, which will import this module (so this
# one cannot import it back).
def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("babelcast_config", "{reason}", {"reason": message})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamLike(Protocol):
    """What `outputs_problems` needs of a stream (orchestrator.config.StreamConfig)."""

    @property
    def id(self) -> str: ...
    @property
    def language(self) -> str: ...
    @property
    def targets(self) -> list[str]: ...


class ArchiveConfig(_Strict):
    dir: str | None = Field(
        default="archives",
        description="folder for {stream}/{lang}.vtt and .srt, relative to the event file; "
                    "null: no archives")
    profile: ProfileName = Field(default="web", description="line-breaking profile of cues")
    _resolved_dir: Path | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> Self:
        if self.dir is None:
            return self
        if not self.dir.strip():
            raise _fail("dir is empty; give a folder, or null to turn archives off")
        base = Path((info.context or {}).get("base_dir") or Path.cwd())
        path = Path(self.dir).expanduser()
        path = path if path.is_absolute() else base / path
        if path.exists() and not path.is_dir():
            raise _fail(f"{path} exists and is not a folder")
        self._resolved_dir = path.resolve()
        return self

    @property
    def resolved_dir(self) -> Path | None:
        """Absolute archive folder (relative ones resolve against the event file's folder)."""
        return self._resolved_dir


class HlsConfig(_Strict):
    enabled: bool = Field(default=True, description="serve /hls/{stream}/{lang}.m3u8")
    segment_s: float = Field(default=6.0, ge=0.5, le=60, description="segment duration")
    window: int = Field(default=10, ge=3, le=10_000, description="segments in the playlist")
    delay_s: float = Field(
        default=6.0, ge=0, le=600,
        description="publish a segment this long after the audio passed its end, so its "
                    "finals and translations are in it")
    mpegts: int = Field(
        default=0, ge=0, lt=2**33,
        description="X-TIMESTAMP-MAP MPEGTS value: video PTS (90 kHz) of audio second 0")
    profile: ProfileName = Field(default="web", description="line-breaking profile of cues")


class YoutubeSinkConfig(_Strict):
    stream: str = Field(description="stream id whose captions are posted")
    lang: str = Field(description="caption language posted: the stream's language or a target")
    url_env: str = Field(
        description="environment variable holding the YouTube caption ingestion URL "
                    "(YouTube Studio > stream settings > closed captions > POST captions to URL)")
    profile: ProfileName = Field(default="youtube", description="line-breaking profile")
    max_backlog: int = Field(default=64, ge=1, le=10_000,
                             description="finals waiting to be posted; beyond, the oldest go")
    give_up_s: float = Field(default=120.0, gt=0, le=3600,
                             description="stop retrying a failing POST after this long")

    @field_validator("lang", mode="before")
    @classmethod
    def _lang(cls, v: object) -> str:
        # "src": the captions of a stream whose language is auto-detected.
        if isinstance(v, str) and (v == "src" or _LANG.match(v)):
            return v
        if isinstance(v, bool):  # YAML 1.1 reads an unquoted `no` (Norwegian) as false
            raise _fail("got a YAML boolean; quote language codes, e.g. 'no'")
        raise _fail(f"expected a 2-letter ISO-639-1 code such as 'en' (or 'src' for a stream "
                    f"whose language is auto), got {v!r}")

    @field_validator("url_env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise _fail(f"{v!r} is not an environment variable name; put the URL in an "
                        "environment variable and give its name here")
        return v


class OutputsConfig(_Strict):
    archive: ArchiveConfig = Field(default_factory=ArchiveConfig,
                                   description="WebVTT/SRT archives of finals")
    hls: HlsConfig = Field(default_factory=HlsConfig, description="live HLS WebVTT playlists")
    youtube: list[YoutubeSinkConfig] = Field(
        default_factory=list, description="YouTube Live caption ingestion, per stream/lang")

    @model_validator(mode="before")
    @classmethod
    def _validate_defaults(cls, data: object) -> object:
        # A missing archive section is validated, not defaulted, so that its relative
        # folder resolves against the event file (the context), not the working directory.
        if isinstance(data, dict):
            data = {k: ({} if k == "archive" and v is None else v) for k, v in data.items()}
            data.setdefault("archive", {})
        return data


def outputs_problems(cfg: OutputsConfig, streams: Sequence[StreamLike]) -> list[
        tuple[Loc, str, object]]:
    """Rules that need the event's streams; locations are relative to `outputs`."""
    problems: list[tuple[Loc, str, object]] = []
    langs = {s.id: {s.language if s.language != "auto" else "src", *s.targets} for s in streams}
    seen: dict[tuple[str, str], int] = {}
    for i, y in enumerate(cfg.youtube):
        if y.stream not in langs:
            problems.append((("youtube", i, "stream"), f"no stream {y.stream!r} in this event "
                             f"(streams: {', '.join(sorted(langs))})", y.stream))
            continue
        if y.lang not in langs[y.stream]:
            problems.append((("youtube", i, "lang"), f"stream {y.stream!r} has captions in "
                             f"{', '.join(sorted(langs[y.stream]))}, not {y.lang!r}", y.lang))
        pair = (y.stream, y.lang)
        if pair in seen:
            problems.append((("youtube", i), f"a second youtube sink for {y.stream}/{y.lang} "
                             f"(first: youtube[{seen[pair]}])", y.stream))
        seen.setdefault(pair, i)
    return problems


def hls_options(cfg: OutputsConfig) -> HlsOptions:
    h = cfg.hls
    return HlsOptions(enabled=h.enabled, segment_s=h.segment_s, window=h.window,
                      delay_s=h.delay_s, mpegts=h.mpegts, profile=get_profile(h.profile))


def outputs_options(cfg: OutputsConfig, environ: Mapping[str, str] | None = None
                    ) -> tuple[OutputsOptions, list[str]]:
    """The runner's options, and one message per YouTube sink that cannot start
    (its environment variable is unset or not a URL); the URL is never in a message."""
    env = os.environ if environ is None else environ
    sinks: list[YoutubeOptions] = []
    problems: list[str] = []
    for y in cfg.youtube:
        url = env.get(y.url_env, "").strip()
        if not url:
            problems.append(f"youtube sink {y.stream}/{y.lang}: environment variable "
                            f"{y.url_env} is not set; export it with the stream's caption "
                            "ingestion URL")
            continue
        try:
            sinks.append(YoutubeOptions(
                stream=y.stream, lang=y.lang, url=url, url_env=y.url_env,
                profile=get_profile(y.profile), max_backlog=y.max_backlog,
                give_up_s=y.give_up_s))
        except YoutubeConfigError as exc:
            problems.append(str(exc))
    options = OutputsOptions(archive_dir=cfg.archive.resolved_dir,
                             archive_profile=get_profile(cfg.archive.profile),
                             youtube=tuple(sinks))
    return options, problems


def caption_tracks(streams: Sequence[StreamOptions]) -> list[tuple[str, str]]:
    """Every (stream, lang) that has captions: the stream's own language and its targets."""
    return [(s.stream_id, lang) for s in streams for lang in (s.caption_lang, *s.targets)]


async def start_outputs(redis_url: str, streams: Sequence[StreamOptions], cfg: OutputsConfig,
                        *, environ: Mapping[str, str] | None = None) -> OutputsRunner:
    """Start archives and YouTube sinks for `streams`; stop them with `await runner.aclose()`.

    A YouTube sink that cannot start is logged as an error; the other outputs run."""
    options, problems = outputs_options(cfg, environ)
    for problem in problems:
        log.error("%s", problem)
    runner = OutputsRunner(connect_redis(redis_url), caption_tracks(streams), options,
                           own_redis=True)
    try:
        await runner.start()
    except BaseException:
        await runner.aclose()
        raise
    return runner
