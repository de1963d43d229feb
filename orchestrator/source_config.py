"""The rules of a stream's source in the event file: listeners, their secrets, HLS options.

`orchestrator.config.StreamConfig` holds the fields; this module checks them
(`source_problems`, `listen_port_problems`, at validation) and, when the event
starts, reads the secrets from the environment (`read_stream_secrets`):

- A listen URL no source can serve is a validation error (workers.sources.listen
  says which URLs listen), as is a secret written in the file: an SRT
  `passphrase=` in the URL, a stream key at the end of an RTMP listen URL.
- An RTMP(S) listener needs `key_env`; an rtmps listener needs `tls` files.
- `key_env`, `tls` and `hls_start_segments` on a source they do not apply to
  are errors, not silently ignored settings.
- Two streams cannot listen on the same port (TCP for RTMP, UDP for SRT).
- `validate` does not need the secrets (it may run in CI); `babelcast run`
  refuses to start when one is unset, naming the variable, never its value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit

from workers.sources.hls import is_hls_url
from workers.sources.listen import (
    check_listen_url,
    parse_rtmp_listen,
    srt_listen_address,
    wants_listen,
)

Loc = tuple[str | int, ...]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# libsrt refuses passphrases outside 10..79 characters (SRTO_PASSPHRASE).
SRT_PASSPHRASE_LEN = (10, 79)


class TlsLike(Protocol):
    @property
    def cert(self) -> str: ...
    @property
    def key(self) -> str: ...


class StreamLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def key_env(self) -> str | None: ...
    @property
    def tls(self) -> TlsLike | None: ...
    @property
    def hls_start_segments(self) -> int: ...
    @property
    def model_fields_set(self) -> set[str]: ...


def _scheme(source: str) -> str:
    return urlsplit(source).scheme.lower() if "://" in source else ""


def is_rtmp_listener(source: str) -> bool:
    return _scheme(source) in ("rtmp", "rtmps") and wants_listen(source)


def source_problems(s: StreamLike) -> list[tuple[Loc, str, object]]:
    """Problems of one stream's source settings; locations relative to the stream."""
    problems: list[tuple[Loc, str, object]] = []
    source, scheme = s.source, _scheme(s.source)
    bad = check_listen_url(source) if scheme else None
    if bad is not None:
        problems.append((("source",), bad, source))
        return problems
    if scheme == "srt" and "passphrase" in {k.lower() for k, _ in
                                            parse_qsl(urlsplit(source).query)}:
        problems.append((("source",), "the SRT passphrase is a secret: remove passphrase= "
                         "from the URL, put it in an environment variable and name that in "
                         "key_env", source))
    rtmp_listen = is_rtmp_listener(source)
    if s.key_env is not None:
        if not ENV_NAME.match(s.key_env):
            problems.append((("key_env",), f"{s.key_env!r} is not an environment variable "
                             "name; put the key in an environment variable and give its name "
                             "here", s.key_env))
        elif not (rtmp_listen or scheme == "srt"):
            problems.append((("key_env",), "key_env is for RTMP listeners (the stream key) "
                             "and SRT sources (the passphrase)", s.key_env))
    elif rtmp_listen:
        problems.append((("key_env",), "an RTMP listener needs a stream key: put it in an "
                         "environment variable and name that in key_env (OBS sends it as its "
                         "Stream Key)", None))
    tls = s.tls
    if rtmp_listen and scheme == "rtmps" and tls is None:
        problems.append((("tls",), "an rtmps listener needs tls: {cert: FILE, key: FILE} "
                         "(PEM certificate chain and private key)", None))
    elif tls is not None and not (rtmp_listen and scheme == "rtmps"):
        problems.append((("tls",), "tls is for rtmps listeners (rtmps://0.0.0.0:PORT/APP)",
                         None))
    if "hls_start_segments" in s.model_fields_set and not is_hls_url(source):
        problems.append((("hls_start_segments",), "hls_start_segments is for HLS sources "
                         "(http(s) URLs ending in .m3u8)", s.hls_start_segments))
    return problems


def _listen_socket(source: str) -> tuple[str, int] | None:
    """("tcp"|"udp", port) a listening source binds, or None."""
    if not wants_listen(source) or check_listen_url(source) is not None:
        return None
    scheme = _scheme(source)
    if scheme in ("rtmp", "rtmps"):
        return "tcp", parse_rtmp_listen(source).port
    if scheme == "srt":
        return "udp", srt_listen_address(source)[1]
    return None


def listen_port_problems(streams: Sequence[StreamLike]) -> list[tuple[Loc, str, object]]:
    """One listener per port: a second stream on a port is an error at its source."""
    problems: list[tuple[Loc, str, object]] = []
    owner: dict[tuple[str, int], str] = {}
    for i, s in enumerate(streams):
        sock = _listen_socket(s.source)
        if sock is None:
            continue
        if sock in owner:
            problems.append((("streams", i, "source"), f"{sock[0].upper()} port {sock[1]} is "
                             f"already the listener of stream {owner[sock]!r}; give each "
                             "listening stream its own port", s.source))
        owner.setdefault(sock, s.id)
    return problems


def resolve_file(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def read_stream_secrets(streams: Sequence[StreamLike], environ: Mapping[str, str]
                        ) -> tuple[dict[str, str], list[str]]:
    """({stream id: secret}, problems) for the streams with key_env; a problem names the
    stream and the variable, never a value."""
    secrets: dict[str, str] = {}
    problems: list[str] = []
    for i, s in enumerate(streams):
        if s.key_env is None:
            continue
        value = environ.get(s.key_env, "")
        where = f"streams[{i}] ({s.id}): key_env {s.key_env}"
        if not value:
            problems.append(f"{where} is not set; export it with the stream's "
                            + ("passphrase" if _scheme(s.source) == "srt" else "stream key"))
            continue
        if _scheme(s.source) == "srt":
            lo, hi = SRT_PASSPHRASE_LEN
            if not lo <= len(value) <= hi:
                problems.append(f"{where}: an SRT passphrase has {lo} to {hi} characters; "
                                f"this one has {len(value)}")
                continue
        secrets[s.id] = value
    return secrets, problems
