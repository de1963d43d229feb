"""A local `redis-server` child process on a free port, for events without a Redis URL.

Persistence is off (the data plane is a live buffer, not a database) and the
child dies with us: it is stopped on exit, and `--ignore-warnings` keeps its
log quiet on small machines.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType


class RedisServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalRedisServer:
    def __init__(self, *, port: int | None = None, binary: str = "redis-server") -> None:
        self.port = port
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        exe = shutil.which(self.binary)
        if exe is None:
            raise RedisServerError(
                "redis-server is not installed: run `apt-get install redis-server`, "
                "or set redis.url in the event file"
            )
        self.port = self.port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="babelcast-redis-")
        self._proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = (self._proc.stderr.read() if self._proc.stderr else b"").decode()[-500:]
                raise RedisServerError(f"redis-server exited at start: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


