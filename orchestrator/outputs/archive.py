"""WebVTT and SRT archives of a stream's finals, written as the event runs.

Per stream and language the writer keeps `{dir}/{stream}/{lang}.vtt` and
`{lang}.srt`. Each final is appended to each file in one `write` and then
`fsync`ed, so after a crash (of the process, or of the machine once fsync has
returned) the files hold every final up to the last one written. A torn tail
that a power loss may leave is cut off when the writer opens the files again.

The WebVTT file is the writer's memory: cue identifiers are
`SEQ-SEGMENT-PAGE`, so a restarted writer knows the last caption seq it holds
(the runner resumes reading Redis after it) and which segments it already has
(a repeated translation final is not archived twice). An SRT file that lost a
cue in a crash is rebuilt from the WebVTT one.

Translations may arrive slightly out of segment order; they are appended as
they come (a crash must not lose them) and the files are rewritten sorted by
time when the writer closes. Cue text is never logged.
"""

from __future__ import annotations

import datetime as dt
import html
import itertools
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

import srt
import webvtt

from orchestrator.outputs.cues import Cue, FinalFilter, final_cues
from workers.captions.linebreak import WEB, LineProfile
from workers.events import CaptionSegment

log = logging.getLogger(__name__)

VTT_HEADER = "WEBVTT\n"
_CUE_ID = re.compile(r"^(\d+)-(\d+)-(\d+)$")


class ArchiveError(RuntimeError):
    pass


def cue_id(cue: Cue) -> str:
    return f"{cue.seq}-{cue.segment_id}-{cue.page}"


def _vtt_text(line: str) -> str:
    # WebVTT cue text is markup: "&", "<" and ">" must be escaped (this also breaks up
    # any "-->" in the text, which would otherwise end the cue).
    return html.escape(line, quote=False)


def vtt_block(cue: Cue) -> str:
    """One cue as a WebVTT block: a blank line, identifier, timings, text lines."""
    caption = webvtt.Caption(
        start=str(webvtt.models.Timestamp.from_seconds(round(cue.start_s, 3))),
        end=str(webvtt.models.Timestamp.from_seconds(round(cue.end_s, 3))),
        text=[_vtt_text(line) for line in cue.lines],
        identifier=cue_id(cue),
    )
    content = webvtt.WebVTT(captions=[caption]).content
    if not content.startswith(VTT_HEADER):  # pragma: no cover - a webvtt-py change
        raise ArchiveError("webvtt-py wrote an unexpected header")
    return content[len(VTT_HEADER):].rstrip("\n") + "\n"


def srt_block(index: int, cue: Cue) -> str:
    block: str = srt.Subtitle(
        index=index,
        start=dt.timedelta(milliseconds=round(cue.start_s * 1000)),
        end=dt.timedelta(milliseconds=round(cue.end_s * 1000)),
        content=cue.text,
    ).to_srt()
    return block


def build_vtt(cues: Iterable[Cue]) -> str:
    return VTT_HEADER + "".join(vtt_block(c) for c in cues)


def build_srt(cues: Iterable[Cue]) -> str:
    return "".join(srt_block(i, c) for i, c in enumerate(cues, start=1))


def sort_key(cue: Cue) -> tuple[float, int, int]:
    return (cue.start_s, cue.seq, cue.page)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: a reader (or a crash) sees the old file or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _complete_prefix(text: str) -> str:
    """`text` (a WebVTT file this module wrote) without a torn last block."""
    if not text.startswith(VTT_HEADER):
        raise ArchiveError("not a WebVTT file written by Babelcast (no WEBVTT header)")
    keep = len(VTT_HEADER)
    pos = keep
    while pos < len(text):
        if text[pos] != "\n":
            break
        nxt = text.find("\n\n", pos + 1)
        end = len(text) if nxt == -1 else nxt + 1
        block = text[pos + 1 : end]
        lines = block.split("\n")
        # identifier, timings, at least one text line, and the block's closing newline
        if not (block.endswith("\n") and len(lines) >= 4 and _CUE_ID.match(lines[0])
                and "-->" in lines[1]):
            break
        keep = pos = end
    return text[:keep]


def _cues_of_vtt(text: str) -> list[Cue]:
    cues: list[Cue] = []
    for caption in webvtt.from_string(text).captions:
        m = _CUE_ID.match(caption.identifier or "")
        if m is None:
            continue
        cues.append(Cue(
            seq=int(m.group(1)), segment_id=int(m.group(2)), page=int(m.group(3)),
            start_s=caption.start_time.in_milliseconds() / 1000,
            end_s=caption.end_time.in_milliseconds() / 1000,
            lines=tuple(html.unescape(line) for line in caption.lines),
        ))
    return cues


class ArchiveWriter:
    """Appends the finals of one (stream, lang) to a WebVTT and an SRT file.

    Plain blocking file I/O: call it from a worker thread (`asyncio.to_thread`).
    """

    def __init__(self, directory: Path, stream: str, lang: str,
                 profile: LineProfile = WEB) -> None:
        self.stream = stream
        self.lang = lang
        self.profile = profile
        self.folder = Path(directory) / stream
        self.vtt_path = self.folder / f"{lang}.vtt"
        self.srt_path = self.folder / f"{lang}.srt"
        self._filter = FinalFilter()
        self._vtt_fd: int | None = None
        self._srt_fd: int | None = None
        self._srt_count = 0
        self._last_start = 0.0
        self._unsorted = False
        self.last_seq = 0
        self.cues_written = 0

    def __repr__(self) -> str:
        return f"ArchiveWriter({self.stream!r}, {self.lang!r}, {str(self.folder)!r})"

    # ---- lifecycle -----------------------------------------------------------
    def open(self) -> int:
        """Create or recover the files; returns the last caption seq they hold (0: none)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArchiveError(f"cannot create archive folder {self.folder}: {exc.strerror}"
                               ) from None
        cues = self._recover()
        for cue in cues:
            self._filter.mark(cue.segment_id)
        self.last_seq = max((c.seq for c in cues), default=0)
        self._last_start = max((c.start_s for c in cues), default=0.0)
        self._unsorted = any(sort_key(a) > sort_key(b) for a, b in itertools.pairwise(cues))
        self._srt_count = len(cues)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._vtt_fd = os.open(self.vtt_path, flags, 0o644)
        self._srt_fd = os.open(self.srt_path, flags, 0o644)
        _fsync_dir(self.folder)
        return self.last_seq

    def _recover(self) -> list[Cue]:
        if not self.vtt_path.exists() or self.vtt_path.stat().st_size == 0:
            write_atomically(self.vtt_path, VTT_HEADER)
            write_atomically(self.srt_path, "")
            return []
        text = self.vtt_path.read_text(encoding="utf-8", errors="replace")
        try:
            kept = _complete_prefix(text)
        except ArchiveError as exc:
            raise ArchiveError(f"{self.vtt_path}: {exc}; move it away to start a new "
                               "archive") from None
        if kept != text:
            log.warning("archive %s: cut %d bytes of an incomplete last cue (crash?)",
                        self.vtt_path, len(text) - len(kept))
            write_atomically(self.vtt_path, kept)
        cues = _cues_of_vtt(kept)
        if self._srt_cue_count() != len(cues):
            log.warning("archive %s: rebuilt from %s (it missed cues after a crash)",
                        self.srt_path, self.vtt_path.name)
            write_atomically(self.srt_path, build_srt(cues))
        return cues

    def _srt_cue_count(self) -> int | None:
        if not self.srt_path.exists():
            return None
        try:
            text = self.srt_path.read_text(encoding="utf-8")
            return len(list(srt.parse(text)))
        except (srt.SRTParseError, UnicodeDecodeError, ValueError):
            return None

    def close(self) -> None:
        """Close the files; out-of-order cues are put in time order first."""
        for fd in (self._vtt_fd, self._srt_fd):
            if fd is not None:
                os.close(fd)
        self._vtt_fd = self._srt_fd = None
        if self._unsorted:
            self.sort()

    def sort(self) -> None:
        """Rewrite both files in time order (atomically each)."""
        cues = sorted(_cues_of_vtt(self.vtt_path.read_text(encoding="utf-8")), key=sort_key)
        write_atomically(self.vtt_path, build_vtt(cues))
        write_atomically(self.srt_path, build_srt(cues))
        self._unsorted = False

    def rotate(self) -> None:
        """Keep the current files under a dated name and start new ones (the stream's
        captions started over, e.g. a new event reusing the archive folder)."""
        self.close()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        for path in (self.vtt_path, self.srt_path):
            if path.exists():
                path.rename(path.with_name(f"{self.lang}.until-{stamp}{path.suffix}"))
        self._filter = FinalFilter()
        self.open()

    # ---- writing -------------------------------------------------------------
    def write(self, seg: CaptionSegment) -> int:
        """Archive `seg` if it is a new final; returns the number of cues written."""
        if self._vtt_fd is None or self._srt_fd is None:
            raise ArchiveError(f"{self!r} is not open")
        if seg.seq <= self.last_seq:
            return 0
        self.last_seq = seg.seq
        if not self._filter.accept(seg):
            return 0
        cues = final_cues(seg, self.profile)
        if not cues:
            return 0
        if cues[0].start_s < self._last_start:
            self._unsorted = True
        self._last_start = max(self._last_start, cues[0].start_s)
        # The WebVTT file first: it is what recovery trusts.
        _write_all(self._vtt_fd, "".join(vtt_block(c) for c in cues))
        first = self._srt_count + 1
        _write_all(self._srt_fd, "".join(srt_block(first + i, c) for i, c in enumerate(cues)))
        self._srt_count += len(cues)
        self.cues_written += len(cues)
        return len(cues)


def _write_all(fd: int, text: str) -> None:
    data = text.encode("utf-8")
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.fsync(fd)
