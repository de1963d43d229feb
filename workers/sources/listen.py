"""Listen URLs: the push paths, where encoders connect to Babelcast instead of the reverse.

One place says which URLs listen and what they need, so the event validator
(orchestrator/config.py) and the sources agree:

- `rtmp://ADDRESS[:PORT]/APP` (port 1935) or `rtmps://ADDRESS:PORT/APP` (TLS, a
  certificate and key needed) listens when ADDRESS is a wildcard (`0.0.0.0`,
  `[::]`) or the URL says `?listen=1` (to bind one interface, `127.0.0.1`).
  OBS: Settings → Stream → Custom; Server `rtmp://HOST:1935/APP`, Stream Key the
  key. The key comes from an environment variable (the stream's `key_env`),
  never from the URL.
- `srt://ADDRESS:PORT?mode=listener` listens (ffmpeg's syntax); its passphrase,
  if any, comes from `key_env` too.

Every other scheme only pulls: `?listen=1` on http, https or rtsp is an error
here rather than a connection refused at run time.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

RTMP_DEFAULT_PORT = 1935
_WILDCARDS = frozenset({"0.0.0.0", "::"})
_TRUE = frozenset({"1", "true", "yes", "on"})


class ListenUrlError(ValueError):
    """A listen URL that no source can serve; the message says what to write instead."""


@dataclass(frozen=True, slots=True)
class RtmpListen:
    scheme: str  # rtmp or rtmps
    host: str
    port: int
    app: str

    @property
    def tls(self) -> bool:
        return self.scheme == "rtmps"

    @property
    def shown(self) -> str:
        """The server URL an operator types into the encoder (with the host it binds)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.app}"


def _query(url: str) -> dict[str, str]:
    return {k.lower(): v for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=True)}


def wants_listen(url: str) -> bool:
    """The URL asks to listen: a wildcard host, `?listen=1`, or SRT's `mode=listener`."""
    parts = urlsplit(url)
    query = _query(url)
    if parts.scheme.lower() == "srt":
        return query.get("mode", "").lower() == "listener"
    return (parts.hostname or "") in _WILDCARDS or query.get("listen", "").lower() in _TRUE


def _bind_host(url: str, what: str) -> str:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ListenUrlError(
            f"{what} binds a local address, not a name: use 0.0.0.0 (every interface), "
            f"127.0.0.1 or one of this host's IP addresses, got {host or 'none'!r}") from None
    return host


def parse_rtmp_listen(url: str) -> RtmpListen:
    """The listener an `rtmp(s)://…` listen URL describes; ListenUrlError if it cannot be one."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("rtmp", "rtmps"):
        raise ListenUrlError(f"{scheme}:// cannot listen")
    host = _bind_host(url, "an RTMP listener")
    try:
        port = parts.port
    except ValueError:
        raise ListenUrlError(f"bad port in {url!r}") from None
    if port is None:
        if scheme == "rtmps":
            raise ListenUrlError("an rtmps listener needs its port in the URL, "
                                 "e.g. rtmps://0.0.0.0:1936/live")
        port = RTMP_DEFAULT_PORT
    segments = [s for s in parts.path.split("/") if s]
    if len(segments) > 1:
        raise ListenUrlError(
            "end a listen URL at the application name (rtmp://0.0.0.0:1935/live): the "
            "stream key is a secret and comes from the stream's key_env, not the URL")
    extra = set(_query(url)) - {"listen"}
    if extra:
        raise ListenUrlError(f"an RTMP listener takes no query options but listen=1; "
                             f"got {', '.join(sorted(extra))}")
    return RtmpListen(scheme, host, port, segments[0] if segments else "live")


def srt_listen_address(url: str) -> tuple[str, int]:
    """(host, port) an SRT listener binds; ListenUrlError if the URL cannot listen."""
    host = _bind_host(url, "an SRT listener")
    try:
        port = urlsplit(url).port
    except ValueError:
        raise ListenUrlError(f"bad port in {url!r}") from None
    if port is None:
        raise ListenUrlError("an SRT listener needs a port: srt://0.0.0.0:9000?mode=listener")
    if "passphrase" in _query(url):
        raise ListenUrlError("the passphrase is a secret: put it in an environment variable "
                             "and name that in the stream's key_env")
    return host, port


def check_listen_url(url: str) -> str | None:
    """None for a URL that pulls or a listen URL a source serves; else what is wrong."""
    if not wants_listen(url):
        return None
    scheme = urlsplit(url).scheme.lower()
    try:
        if scheme in ("rtmp", "rtmps"):
            parse_rtmp_listen(url)
        elif scheme == "srt":
            srt_listen_address(url)
        else:
            return (f"{scheme}:// cannot listen for encoders; encoders push RTMP "
                    "(rtmp://0.0.0.0:1935/live) or SRT (srt://0.0.0.0:9000?mode=listener)")
    except ListenUrlError as exc:
        return str(exc)
    return None
