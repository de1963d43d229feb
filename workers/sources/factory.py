"""Picks the source for a URL by its scheme: the one place that maps URLs to classes."""

from __future__ import annotations

from concurrent.futures import Executor
from urllib.parse import urlsplit

from workers.sources.base import AudioSource
from workers.sources.file import FileSource
from workers.sources.hls import HlsSource, is_hls_url
from workers.sources.listen import check_listen_url, wants_listen
from workers.sources.pyav import PyAVSource
from workers.sources.rtmp_listen import RtmpListenSource
from workers.sources.srt import SrtSource

_PYAV_SCHEMES = frozenset({"http", "https", "rtmp", "rtmps", "rtsp"})


def open_source(url: str, *, loop: bool = False, executor: Executor | None = None,
                key: str = "", tls_cert: str = "", tls_key: str = "",
                hls_start_segments: int = 1) -> AudioSource:
    """The source for `url`; `loop` applies to files only. Does no I/O.

    `key`: the stream key an RTMP listener checks, or an SRT passphrase. Raises
    ValueError for pushed streams (their audio arrives through the gateway, not
    from a pulled URL), for schemes nothing here can read, and for listen URLs
    no source serves.
    """
    scheme = urlsplit(url).scheme.lower()
    if url.strip().lower() == "push" or scheme == "push":
        raise ValueError(
            "a pushed stream has no pulled source: its audio comes through the gateway"
        )
    if scheme in ("", "file"):
        return FileSource(url, loop=loop, executor=executor)
    problem = check_listen_url(url)
    if problem is not None:
        raise ValueError(problem)
    if scheme == "srt":
        return SrtSource(url, passphrase=key)
    if scheme in ("rtmp", "rtmps") and wants_listen(url):
        return RtmpListenSource(url, key=key, tls_cert=tls_cert, tls_key=tls_key)
    if is_hls_url(url):
        return HlsSource(url, executor=executor, start_segments=hls_start_segments)
    if scheme in _PYAV_SCHEMES:
        return PyAVSource(url, executor=executor)
    raise ValueError(
        f"unsupported source URL scheme {scheme!r}; "
        "use a file path or file://, http(s)://, rtmp(s)://, rtsp:// or srt://"
    )
