"""YouTube Live caption ingestion: POST finals to a live stream's caption URL.

YouTube's "Closed Captions over HTTP for YouTube Live Streams" format: the
body of a POST is one or more captions, each a UTC time line
`YYYY-MM-DDTHH:MM:SS.mmm` followed by a line of UTF-8 text in which `<br>`
breaks lines; content type text/plain. Every POST carries a `seq` query
parameter that grows by one per POST of new caption data and stays the same
when a POST is retried.

The time of a caption is the wall-clock time its speech was captured (from the
caption's audio times and the capture time of its audio end), so YouTube lines
it up with the video. A final longer than the profile's lines becomes several
captions of one POST, timed across its speech.

The ingestion URL is a secret (it holds the stream key): it is read from an
environment variable and appears in no log line, exception message or repr.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit, urlunsplit

import httpx

from orchestrator import metrics
from orchestrator.outputs.cues import FinalFilter, final_cues
from workers.aio import wait_for
from workers.captions.linebreak import YOUTUBE, LineProfile
from workers.events import CaptionSegment

log = logging.getLogger(__name__)


class YoutubeConfigError(ValueError):
    """A sink that cannot start; the message names the env variable, never the URL."""


@dataclass(frozen=True, slots=True)
class YoutubeOptions:
    stream: str
    lang: str
    url: str = field(repr=False)
    url_env: str = ""  # where the URL came from, for messages
    profile: LineProfile = field(default=YOUTUBE)
    max_backlog: int = 64
    batch: int = 10  # finals per POST at most, when catching up
    timeout_s: float = 10.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    give_up_s: float = 120.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            where = f"${self.url_env}" if self.url_env else "the ingestion URL"
            raise YoutubeConfigError(
                f"youtube sink {self.stream}/{self.lang}: {where} is not an http(s) URL; "
                "copy the ingestion URL from YouTube Studio (Live > Stream settings > "
                "closed captions > POST captions to URL)")
        if self.max_backlog < 1 or self.batch < 1:
            raise YoutubeConfigError("max_backlog and batch must be at least 1")


def utc_stamp(epoch_s: float) -> str:
    """`YYYY-MM-DDTHH:MM:SS.mmm` in UTC, as YouTube's caption time lines want it."""
    moment = dt.datetime.fromtimestamp(epoch_s, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def youtube_entries(seg: CaptionSegment, profile: LineProfile) -> list[tuple[float, str]]:
    """(capture time, text with <br>) for each screen of a final."""
    # Wall time of audio second t, anchored on the capture time of the caption's end.
    def wall(t: float) -> float:
        return seg.audio_end_wall - (seg.audio_end_s - t)

    return [(wall(c.start_s), "<br>".join(c.lines)) for c in final_cues(seg, profile)]


def youtube_body(entries: list[tuple[float, str]]) -> str:
    return "".join(f"{utc_stamp(at)}\n{text}\n" for at, text in entries)


def with_seq(url: str, seq: int) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "seq"]
    query.append(("seq", str(seq)))
    return urlunsplit(parts._replace(query=urlencode(query)))


class _RedactUrl(logging.Filter):
    """Masks the ingestion URL's secret parts (path, query values) in httpx's log lines:
    httpx logs every request's full URL at INFO."""

    def __init__(self, url: str) -> None:
        super().__init__()
        parts = urlsplit(url)
        values = [v for _, v in parse_qsl(parts.query) if len(v) >= 4]
        pieces = {p for v in values for p in (v, quote(v, safe=""), quote_plus(v))}
        if len(parts.path) > 1:
            pieces.add(parts.path)
        # Longest first, so a piece that contains another is masked whole.
        self._pieces = sorted(pieces, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = message
        for piece in self._pieces:
            masked = masked.replace(piece, "***")
        if masked != message:
            record.msg, record.args = masked, None
        return True


@dataclass(slots=True)
class _Post:
    body: str
    finals: int


Sleep = Callable[[float], Awaitable[None]]
OnPosted = Callable[[int], Awaitable[None]]


class YoutubeCaptionSink:
    """Sends finals of one (stream, lang) to YouTube, in order, one POST at a time.

    `offer` never blocks: finals wait in a bounded backlog; when it is full the
    oldest is dropped and counted (on a live stream a caption minutes late is
    worth less than the current one). A POST that fails with a network error,
    a 5xx, 408 or 429 is retried with the same `seq` and growing delays, for
    at most `give_up_s`; any other 4xx is not retried. `on_posted(seq)` is
    awaited after each POST is done with, so the counter can survive a restart.
    """

    def __init__(self, options: YoutubeOptions, *, first_seq: int = 1,
                 client: httpx.AsyncClient | None = None, on_posted: OnPosted | None = None,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.options = options
        self.next_seq = first_seq
        self._client = client
        self._own_client = client is None
        self._on_posted = on_posted
        self._sleep = sleep
        self._filter = FinalFilter()
        self._backlog: deque[CaptionSegment] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued or being posted
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._redact = _RedactUrl(options.url)
        self.posted = 0
        self.retries = 0
        self.rejected = 0
        self.expired = 0
        self.dropped = 0
        labels = {"stream": options.stream, "lang": options.lang}
        self._m_posts = metrics.YOUTUBE_POSTS
        self._m_backlog = metrics.YOUTUBE_BACKLOG.labels(**labels)
        self._labels = labels

    def __repr__(self) -> str:
        return f"YoutubeCaptionSink({self.options.stream!r}, {self.options.lang!r})"

    @property
    def name(self) -> str:
        return f"youtube sink {self.options.stream}/{self.options.lang}"

    async def start(self) -> None:
        logging.getLogger("httpx").addFilter(self._redact)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.options.timeout_s)
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def aclose(self, drain_s: float = 0.0) -> None:
        """Stop; with `drain_s`, first give the backlog that long to go out."""
        if drain_s > 0 and self._task is not None:
            with contextlib.suppress(TimeoutError):
                await wait_for(self._idle.wait(), drain_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None
        logging.getLogger("httpx").removeFilter(self._redact)

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def offer(self, seg: CaptionSegment) -> None:
        if not self._filter.accept(seg):
            return
        if len(self._backlog) >= self.options.max_backlog:
            self._backlog.popleft()
            self.dropped += 1
            self._m_posts.labels(**self._labels, result="dropped").inc()
            log.warning("%s: backlog full (%d finals); dropped the oldest", self.name,
                        self.options.max_backlog)
        self._backlog.append(seg)
        self._m_backlog.set(len(self._backlog))
        self._idle.clear()
        self._ready.set()

    async def _run(self) -> None:
        while True:
            while not self._backlog:
                self._ready.clear()
                self._idle.set()
                await self._ready.wait()
            segs = [self._backlog.popleft()
                    for _ in range(min(self.options.batch, len(self._backlog)))]
            self._m_backlog.set(len(self._backlog))
            entries = [e for seg in segs for e in youtube_entries(seg, self.options.profile)]
            seq = self.next_seq
            self.next_seq += 1
            try:
                await self._send(seq, _Post(youtube_body(entries), len(segs)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not stop the sink for the whole event
                metrics.OUTPUT_ERRORS.labels(output="youtube").inc()
                log.error("%s: caption POST failed unexpectedly (%s)", self.name,
                          type(exc).__name__)
            if self._on_posted is not None:
                try:
                    await self._on_posted(seq)
                except Exception as exc:  # the counter's store is a convenience
                    log.warning("%s: could not record seq %d (%s)", self.name, seq,
                                type(exc).__name__)

    async def _send(self, seq: int, post: _Post) -> None:
        assert self._client is not None
        url = with_seq(self.options.url, seq)
        started = time.monotonic()
        attempt = 0
        while True:
            reason: str
            try:
                resp = await self._client.post(
                    url, content=post.body.encode("utf-8"),
                    headers={"Content-Type": "text/plain; charset=utf-8"})
            except httpx.HTTPError as exc:
                reason = type(exc).__name__
            else:
                if resp.is_success:
                    self.posted += 1
                    self._m_posts.labels(**self._labels, result="ok").inc()
                    return
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    self.rejected += 1
                    self._m_posts.labels(**self._labels, result="rejected").inc()
                    log.error("%s: YouTube refused a caption POST with HTTP %d; check the "
                              "ingestion URL in $%s (it changes with each live stream)",
                              self.name, resp.status_code, self.options.url_env or "?")
                    return
                reason = f"HTTP {resp.status_code}"
            if time.monotonic() - started >= self.options.give_up_s:
                self.expired += post.finals
                self._m_posts.labels(**self._labels, result="expired").inc()
                log.error("%s: gave up a caption POST after %.0f s of failures (%s)",
                          self.name, self.options.give_up_s, reason)
                return
            delay = min(self.options.retry_max_s, self.options.retry_initial_s * 2 ** attempt)
            delay *= 0.8 + 0.4 * random.random()  # no lockstep between many sinks
            attempt += 1
            self.retries += 1
            self._m_posts.labels(**self._labels, result="retried").inc()
            log.warning("%s: caption POST failed (%s); retry %d in %.1f s", self.name,
                        reason, attempt, delay)
            await self._sleep(delay)
