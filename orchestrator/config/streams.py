"""The audio streams to caption, and the ingest pool that reads their sources.

The fields live here; the rules of a source (listeners, their secrets, HLS options) in
orchestrator/source_config.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from orchestrator.config.base import _check_lang, _fail, _raise_at, _Strict
from orchestrator.source_config import resolve_file, source_problems

SourceKind = Literal["file", "pyav", "srt", "push"]

_STREAM_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_KINDS: dict[str, SourceKind] = {
    "http": "pyav", "https": "pyav", "rtmp": "pyav", "rtmps": "pyav", "rtsp": "pyav",
    "srt": "srt",
}
_SUPPORTED_SOURCES = ("a file path, file://PATH, http://, https://, rtmp://, rtmps://, rtsp://, "
                      "srt://, push")


class IngestConfig(_Strict):
    actors: int = Field(default=1, ge=1, description="number of ingest (audio source) actors")



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
