"""A local `redis-server` child process on a free port, for events without a Redis URL.

With a `data_dir` (what `babelcast run` gives it: the event's data folder) it keeps an
append-only file, fsynced every second, so a redis-server that dies and is started
again (`orchestrator.redis_child`) comes back with the captions, jobs and seqs it had,
at most a second short. Without one (tests) persistence is off. The child dies with
us: it is stopped on exit and gets a parent-death signal for the exits that skip that.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from orchestrator.lifecycle import parent_death_signal


class RedisServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalRedisServer:
    def __init__(self, *, port: int | None = None, binary: str = "redis-server",
                 data_dir: str | Path | None = None) -> None:
        self.port = port
        self.binary = binary
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process (on the port it had, if any) without waiting for it. Call
        from a thread that lives as long as the child should: the parent-death signal
        follows the thread that forked."""
        exe = shutil.which(self.binary)
        if exe is None:
            raise RedisServerError(
                "redis-server is not installed: run `apt-get install redis-server`, "
                "or set redis.url in the event file"
            )
        self.port = self.port or free_port()
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            folder = str(self.data_dir)
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="babelcast-redis-")
            folder = self._dir.name
            persistence = ["--appendonly", "no"]
        self._proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--dir", folder, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=parent_death_signal(),
        )

    def ready(self) -> bool:
        """True once it answers PING; raises RedisServerError if it exited."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            err = (self._proc.stderr.read() if self._proc.stderr else b"").decode()[-500:]
            raise RedisServerError(f"redis-server exited at start: {err}")
        try:
            with socket.create_connection(("127.0.0.1", self.port or 0), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return self.url
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


