"""A local `redis-server` child process on a free port, for events without a Redis URL.

With a `data_dir` (what `babelcast run` gives it: the event's data folder) it keeps an
append-only file, fsynced every second, so a redis-server that dies and is started
again (`orchestrator.redis_child`) comes back with the captions, jobs and seqs it had,
at most a second short. Without one (tests) persistence is off. The child dies with
us: it is stopped on exit and gets a parent-death signal for the exits that skip that.
"""

from __future__ import annotations

import fcntl
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

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
        self._log: Path | None = None
        self._lock: IO[str] | None = None
        self._log_from = 0
        self._chosen_port = port is not None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _lock_data_dir(self) -> None:
        """One redis-server per append-only folder: two writing one file corrupt it (then
        neither starts again). Held by this process for its life (restarts included)."""
        if self._lock is not None:
            return
        assert self.data_dir is not None
        f = (self.data_dir / "babelcast.lock").open("a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise RedisServerError(
                f"another babelcast run uses {self.data_dir} for its Redis data (the same "
                "event, or another event file in the same folder, is running): stop it, "
                "or give this event its own redis.data_dir") from None
        self._lock = f

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
            self._lock_data_dir()
            folder = str(self.data_dir)
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="babelcast-redis-")
            folder = self._dir.name
            persistence = ["--appendonly", "no"]
        # Its log (where redis-server says why it stopped: a port taken, an unreadable
        # append-only file) goes to a file, not a pipe that a long run would fill.
        self._log = Path(folder) / "redis-server.log"
        self._log_from = self._log.stat().st_size if self._log.exists() else 0
        self._proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--dir", folder, "--loglevel", "warning",
             "--logfile", str(self._log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=parent_death_signal(),
        )

    def ready(self) -> bool:
        """True once it answers PING; raises RedisServerError if it exited."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            err = (self._proc.stderr.read() if self._proc.stderr else b"").decode()
            if self._log is not None and self._log.exists():
                with self._log.open("rb") as f:  # what this start wrote
                    f.seek(self._log_from)
                    err += f.read().decode(errors="replace")
            raise RedisServerError(f"redis-server exited at start: {err.strip()[-500:]}")
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
        # A port picked here can be taken by another process before redis-server binds
        # it (seen once in a full test run, with Ray starting beside it): pick another.
        for attempt in range(3):
            self.spawn()
            deadline = time.monotonic() + timeout_s
            try:
                while time.monotonic() < deadline:
                    if self.ready():
                        return self.url
                    time.sleep(0.05)
            except RedisServerError as exc:
                if self._chosen_port or attempt == 2 or "already in use" not in str(exc):
                    raise
                self._proc = None
                self.port = None
                continue
            break
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
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


