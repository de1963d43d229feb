"""An SRT source, decoded by a Debian `ffmpeg` child process.

PyAV's wheels bundle an FFmpeg without libsrt, so SRT goes through the system
`ffmpeg`, which writes 16 kHz mono PCM16 to its stdout, probing only briefly
(see `ffmpeg_argv`). Only ffmpeg's own error lines (the last few) reach
the operator; the URL in them has its passphrase masked.

Two modes, as in ffmpeg's URL: `mode=caller` (the default) pulls from a sender
that listens; `mode=listener` is the push path: encoders call Babelcast. A
listener outlives its callers: when one leaves (or dies: SRT notices after its
5 s peer idle timeout) the source says `idle` and listens again at once, and
a caller refused by libsrt for a wrong passphrase is counted (`refused`). The
passphrase comes from the stream's `key_env`; libsrt checks it (its key
exchange, not a string compare) and it is masked in every message.
Known limit: it is part of the ffmpeg child's command line, which local users
of the host can read in /proc; ffmpeg takes protocol options no other way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from workers.aio import wait_for
from workers.events import SAMPLE_RATE
from workers.sources.base import AudioSource, SourceError, SourceEvent, SourceItem
from workers.sources.pyav import CHUNK_BYTES, LIVE_LEAD_S, PROBE_OPTIONS, Pacer, redact_url

_STDERR_LINES = 5
# After stdout ends ffmpeg exits at once; this only bounds a wedged process.
_EXIT_WAIT_S = 2.0
# libsrt's own log line when a caller's passphrase does not match (libsrt 1.5).
_BAD_SECRET = ("BADSECRET", "Incorrect passphrase")


def ffmpeg_argv(ffmpeg: str, url: str) -> list[str]:
    """ffmpeg reading `url` and writing its first audio stream as PCM16 16 kHz mono to stdout."""
    probe = [arg for key, value in PROBE_OPTIONS.items() for arg in (f"-{key}", value)]
    # What ffmpeg probed is kept (no `-fflags nobuffer`): the pacer lets it out at once
    # (LIVE_LEAD_S), so the first half second after a (re)connect is not lost.
    # -nostats: below info level ffmpeg prints its progress line straight to stderr.
    head = [ffmpeg, "-nostdin", "-loglevel", "error", "-nostats", *probe, "-i", url]
    # -map 0:a:0: only the first audio stream; ffmpeg's error says so if there is none.
    return [*head, "-map", "0:a:0", "-f", "s16le", "-ac", "1", "-ar", str(SAMPLE_RATE), "pipe:1"]


def srt_mode(url: str) -> str:
    """`caller`, `listener` or `rendezvous`, as ffmpeg reads the URL (caller by default)."""
    query = dict(parse_qsl(urlsplit(url).query))
    return query.get("mode", "caller").lower()


def with_passphrase(url: str, passphrase: str) -> str:
    if not passphrase:
        return url
    parts = urlsplit(url)
    pairs = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k != "passphrase"]
    pairs.append(("passphrase", passphrase))
    return urlunsplit(parts._replace(query=urlencode(pairs)))


class SrtSource(AudioSource):
    """`srt://host:port?mode=caller|listener&...` through an `ffmpeg` subprocess.

    A caller's stream ending, for any reason, is a retryable `SourceError`
    carrying ffmpeg's last error lines; so is a listener that ends before any
    caller sent audio (its port is taken, say). A missing `ffmpeg` binary is
    not retryable.
    """

    gap_reasons = ("srt-disconnect", "srt-waiting")

    def __init__(self, url: str, *, ffmpeg: str = "ffmpeg", passphrase: str = "") -> None:
        self.url = url
        self._ffmpeg = ffmpeg
        self._passphrase = passphrase
        self._listener = srt_mode(url) == "listener"
        self._proc: asyncio.subprocess.Process | None = None
        self._closing = False
        self._errors: deque[str] = deque(maxlen=_STDERR_LINES)

    def __repr__(self) -> str:
        return f"SrtSource({redact_url(self.url)!r})"

    async def chunks(self) -> AsyncIterator[SourceItem]:
        self._closing = False
        while True:
            got_audio = False
            async for item in self._one_connection():
                got_audio = got_audio or isinstance(item, bytes)
                yield item
            if self._closing:
                return
            if not (self._listener and got_audio):
                raise SourceError(self._ended_message())
            # The caller left: listen again at once, nothing failed.
            yield SourceEvent("idle", "srt-disconnect",
                              f"the encoder left; listening again on {redact_url(self.url)}")

    async def _one_connection(self) -> AsyncIterator[SourceItem]:
        proc = self._proc = await self._spawn()
        assert proc.stdout is not None and proc.stderr is not None
        self._errors = deque(maxlen=_STDERR_LINES)
        events: asyncio.Queue[SourceEvent] = asyncio.Queue()
        # Drained concurrently so a chatty ffmpeg never blocks on a full stderr pipe.
        drain = asyncio.create_task(self._keep_tail(proc.stderr, self._errors, events))
        if self._listener:
            yield SourceEvent("idle", "srt-waiting",
                              f"waiting for an encoder to call {redact_url(self.url)}")
        pacer = Pacer(lead_s=LIVE_LEAD_S)
        read: asyncio.Task[bytes] | None = None
        event: asyncio.Task[SourceEvent] | None = None
        try:
            while True:
                read = read or asyncio.ensure_future(proc.stdout.readexactly(CHUNK_BYTES))
                event = event or asyncio.ensure_future(events.get())
                await asyncio.wait({read, event}, return_when=asyncio.FIRST_COMPLETED)
                if event.done():
                    yield event.result()
                    event = None
                if not read.done():
                    continue
                try:
                    chunk = read.result()
                except asyncio.IncompleteReadError as end:
                    chunk = end.partial[: len(end.partial) // 2 * 2]
                    if chunk:
                        await pacer.wait(len(chunk) // 2)
                        yield chunk
                    break
                read = None
                await pacer.wait(len(chunk) // 2)
                yield chunk
            with contextlib.suppress(TimeoutError):
                await wait_for(proc.wait(), _EXIT_WAIT_S)
                await wait_for(drain, _EXIT_WAIT_S)
            while not events.empty():
                yield events.get_nowait()
        finally:
            for task in (read, event, drain):
                if task is not None:
                    task.cancel()
            await asyncio.wait({t for t in (read, event, drain) if t is not None},
                               timeout=_EXIT_WAIT_S)
            await self._stop(proc)

    async def aclose(self) -> None:
        self._closing = True
        if self._proc is not None:
            await self._stop(self._proc)

    async def _spawn(self) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                *ffmpeg_argv(self._ffmpeg, with_passphrase(self.url, self._passphrase)),
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

    def _mask(self, text: str) -> str:
        secret = with_passphrase(self.url, self._passphrase)
        text = text.replace(secret, redact_url(self.url)).replace(self.url, redact_url(self.url))
        if self._passphrase:
            text = text.replace(self._passphrase, "***")
        return text

    async def _keep_tail(self, stderr: asyncio.StreamReader, errors: deque[str],
                         events: asyncio.Queue[SourceEvent]) -> None:
        while True:
            try:
                line = await stderr.readline()
            except ValueError:  # a line longer than the stream's limit: not worth keeping
                continue
            if not line:
                return
            text = self._mask(line.decode(errors="replace").strip())
            if self._listener and any(mark in text for mark in _BAD_SECRET):
                # libsrt logs a refused caller several times; one event per rejection line.
                if "processConnectRequest" in text:
                    events.put_nowait(SourceEvent(
                        "refused", "srt-bad-passphrase",
                        f"a caller of {redact_url(self.url)} was refused: wrong passphrase"))
                continue
            if text:
                errors.append(text)

    def _ended_message(self) -> str:
        proc = self._proc
        returncode = None if proc is None else proc.returncode
        status = "still running" if returncode is None else f"exit {returncode}"
        said = " | ".join(self._errors) or "no error output"
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
            await wait_for(proc.wait(), _EXIT_WAIT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
