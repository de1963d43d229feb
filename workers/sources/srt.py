"""An SRT source, decoded by a Debian `ffmpeg` child process.

PyAV's wheels bundle an FFmpeg without libsrt, so SRT goes through the system
`ffmpeg`, which writes 16 kHz mono PCM16 to its stdout, probing only briefly
(see `ffmpeg_argv`). Only ffmpeg's own error lines (the last few) reach
the operator; the URL in them has its passphrase masked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError
from workers.sources.pyav import CHUNK_BYTES, PROBE_OPTIONS, Pacer, redact_url

_STDERR_LINES = 5
# After stdout ends ffmpeg exits at once; this only bounds a wedged process.
_EXIT_WAIT_S = 2.0


def ffmpeg_argv(ffmpeg: str, url: str) -> list[str]:
    """ffmpeg reading `url` and writing its first audio stream as PCM16 16 kHz mono to stdout."""
    probe = [arg for key, value in PROBE_OPTIONS.items() for arg in (f"-{key}", value)]
    # An SRT source is always live: drop the probed packets rather than burst them
    # out, where pacing would keep them as latency (static files need them kept).
    probe += ["-fflags", "nobuffer"]
    # -nostats: below info level ffmpeg prints its progress line straight to stderr.
    head = [ffmpeg, "-nostdin", "-loglevel", "error", "-nostats", *probe, "-i", url]
    # -map 0:a:0: only the first audio stream; ffmpeg's error says so if there is none.
    return [*head, "-map", "0:a:0", "-f", "s16le", "-ac", "1", "-ar", str(SAMPLE_RATE), "pipe:1"]


class SrtSource(AudioSource):
    """`srt://host:port?mode=caller|listener&...` through an `ffmpeg` subprocess.

    The stream ending, for any reason, is a retryable `SourceError` carrying
    ffmpeg's last error lines; a missing `ffmpeg` binary is not retryable.
    """

    def __init__(self, url: str, *, ffmpeg: str = "ffmpeg") -> None:
        self.url = url
        self._ffmpeg = ffmpeg
        self._proc: asyncio.subprocess.Process | None = None
        self._closing = False

    async def chunks(self) -> AsyncIterator[bytes]:
        self._closing = False
        proc = self._proc = await self._spawn()
        assert proc.stdout is not None and proc.stderr is not None
        errors: deque[str] = deque(maxlen=_STDERR_LINES)
        # Drained concurrently so a chatty ffmpeg never blocks on a full stderr pipe.
        drain = asyncio.create_task(self._keep_tail(proc.stderr, errors))
        pacer = Pacer()
        try:
            while True:
                try:
                    chunk = await proc.stdout.readexactly(CHUNK_BYTES)
                except asyncio.IncompleteReadError as end:
                    chunk = end.partial[: len(end.partial) // 2 * 2]
                    if chunk:
                        await pacer.wait(len(chunk) // 2)
                        yield chunk
                    break
                await pacer.wait(len(chunk) // 2)
                yield chunk
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), _EXIT_WAIT_S)
                await asyncio.wait_for(drain, _EXIT_WAIT_S)
            if self._closing:
                return
            raise SourceError(self._ended_message(proc.returncode, errors))
        finally:
            drain.cancel()
            await asyncio.wait({drain}, timeout=_EXIT_WAIT_S)
            await self._stop(proc)

    async def aclose(self) -> None:
        self._closing = True
        if self._proc is not None:
            await self._stop(self._proc)

    async def _spawn(self) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                *ffmpeg_argv(self._ffmpeg, self.url),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise SourceError(
                f"SRT source {redact_url(self.url)!r}: cannot run {self._ffmpeg!r} "
                f"({exc.strerror or type(exc).__name__}); SRT needs the system ffmpeg: "
                "apt-get install ffmpeg",
                retryable=False,
            ) from exc

    async def _keep_tail(self, stderr: asyncio.StreamReader, errors: deque[str]) -> None:
        secret, shown = self.url, redact_url(self.url)
        while True:
            try:
                line = await stderr.readline()
            except ValueError:  # a line longer than the stream's limit: not worth keeping
                continue
            if not line:
                return
            text = line.decode(errors="replace").strip().replace(secret, shown)
            if text:
                errors.append(text)

    def _ended_message(self, returncode: int | None, errors: deque[str]) -> str:
        status = "still running" if returncode is None else f"exit {returncode}"
        said = " | ".join(errors) or "no error output"
        return (
            f"SRT source {redact_url(self.url)!r} ended (ffmpeg {status}: {said}); "
            "check that the encoder is sending and the URL's mode, port and passphrase match it"
        )

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), _EXIT_WAIT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
