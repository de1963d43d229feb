"""Tokens of a loopback event run without an `auth` section.

`babelcast run` on 127.0.0.1 without `auth:` (the demo) makes fresh secrets for the run
and writes them to a file only its user can read (0600, in a 0700 folder), like a
notebook server's runtime file: `babelcast tail`, `status` and `token` on the same
machine find it by the gateway's URL, so the demo needs no configuration while nothing,
not even captions, is open to other users of the machine or to web pages in a browser.
The file goes when the run ends.

Folder: `$BABELCAST_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/babelcast`, else
`~/.cache/babelcast/run`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def runtime_dir() -> Path:
    explicit = os.environ.get("BABELCAST_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "babelcast"
    return Path.home() / ".cache" / "babelcast" / "run"


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return (parts.hostname or "127.0.0.1"), parts.port or (443 if parts.scheme in (
        "https", "wss") else 80)


def credentials_path(url: str) -> Path:
    host, port = _host_port(url)
    if host == "localhost":
        host = "127.0.0.1"
    return runtime_dir() / f"gateway-{host.replace(':', '_')}-{port}.json"


@dataclass(frozen=True, slots=True)
class LocalCredentials:
    url: str
    admin_token: str
    viewer_token: str | None
    publish_tokens: dict[str, str]

    def write(self) -> Path:
        path = credentials_path(self.url)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "admin_token": self.admin_token,
                       "viewer_token": self.viewer_token,
                       "publish_tokens": self.publish_tokens, "pid": os.getpid()}, f)
        os.replace(tmp, path)
        return path

    @staticmethod
    def remove(url: str) -> None:
        path = credentials_path(url)
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if data.get("pid") == os.getpid():  # not a later run's file
                path.unlink()


def read_credentials(url: str) -> dict[str, Any] | None:
    """The runtime file of the gateway at `url`, if this user has one."""
    try:
        data = json.loads(credentials_path(url).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def token_for(url: str, kind: str, explicit: str | None = None) -> str | None:
    """The token a CLI command sends: `--token`, `$BABELCAST_TOKEN`, else this machine's
    runtime file for a loopback gateway (`kind`: admin or viewer)."""
    if explicit:
        return explicit
    env = os.environ.get("BABELCAST_TOKEN")
    if env:
        return env
    data = read_credentials(url) or {}
    value = data.get(f"{kind}_token")
    return value if isinstance(value, str) and value else None
