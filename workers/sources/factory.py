"""Picks the source for a URL by its scheme: the one place that maps URLs to classes."""

from __future__ import annotations

from concurrent.futures import Executor
from urllib.parse import urlsplit

from workers.sources.base import AudioSource
from workers.sources.file import FileSource
from workers.sources.pyav import PyAVSource
from workers.sources.srt import SrtSource

_PYAV_SCHEMES = frozenset({"http", "https", "rtmp", "rtmps", "rtsp"})


def open_source(url: str, *, loop: bool = False, executor: Executor | None = None) -> AudioSource:
    """The source for `url`; `loop` applies to files only. Does no I/O.

    Raises ValueError for pushed streams (their audio arrives through the
    gateway, not from a pulled URL) and for schemes nothing here can read.
    """
    scheme = urlsplit(url).scheme.lower()
    if url.strip().lower() == "push" or scheme == "push":
        raise ValueError(
            "a pushed stream has no pulled source: its audio comes through the gateway"
        )
    if scheme in ("", "file"):
        return FileSource(url, loop=loop, executor=executor)
    if scheme in _PYAV_SCHEMES:
        return PyAVSource(url, executor=executor)
    if scheme == "srt":
        return SrtSource(url)
    raise ValueError(
        f"unsupported source URL scheme {scheme!r}; "
        "use a file path or file://, http(s)://, rtmp(s)://, rtsp:// or srt://"
    )
