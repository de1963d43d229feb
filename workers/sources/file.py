"""A local audio file played at real time, once or in a loop (demos, rehearsals, tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Executor
from urllib.parse import unquote, urlsplit

import av
from av.container import InputContainer

from workers.sources.base import AudioSource, SourceError
from workers.sources.pyav import NoAudioError, Pacer, PyAVDecoder, describe_av_error


def local_path(path_or_url: str) -> str:
    """The filesystem path of a plain path or a file:// URL."""
    if path_or_url.lower().startswith("file:"):
        return unquote(urlsplit(path_or_url).path)
    return path_or_url


class FileSource(AudioSource):
    """Any file PyAV decodes, paced at real time; `loop` restarts it at its end, seamlessly.

    Every failure is about the file itself (missing, unreadable, not audio) and
    retrying will not fix it, except an I/O error while reading, which may.

    Resumable: `position()` is where the audio yielded last ends in the file (within
    the current pass when looping); a retry after a read error, and a restarted
    ingest actor that calls `resume_at()`, go on from there instead of the start.
    """

    resumable = True

    def __init__(self, path: str, *, loop: bool = False, executor: Executor | None = None) -> None:
        self.url = path
        self._path = local_path(path)
        self._decoder = PyAVDecoder(self._open, executor=executor, repeat=loop)

    def _open(self) -> InputContainer:
        return av.open(self._path, "r")

    def position(self) -> int:
        return self._decoder.position

    def resume_at(self, samples: int) -> None:
        if samples < 0:
            raise ValueError(f"a file position is never negative (got {samples})")
        self._decoder.start = self._decoder.position = samples

    async def chunks(self) -> AsyncIterator[bytes]:
        where = f"file source {self._path!r}"
        # A retry (a read error) goes on where the audio stopped, not at the start.
        self._decoder.start = self._decoder.position
        # One pacer across loop restarts: the reopen is seamless, so is the timing.
        pacer = Pacer()
        opened = False
        try:
            async for chunk in self._decoder.chunks():
                opened = True
                await pacer.wait(len(chunk) // 2)
                yield chunk
        except NoAudioError as exc:
            raise SourceError(
                f"{where} {exc}; check that it is an audio or video file with sound",
                retryable=False,
            ) from None
        except (av.FFmpegError, OSError) as exc:
            raise SourceError(
                f"{where} could not be read: {describe_av_error(exc)}; "
                "check that the file exists, is readable and is an audio file",
                retryable=opened and not isinstance(exc, av.InvalidDataError),
            ) from exc

    async def aclose(self) -> None:
        await self._decoder.aclose()
