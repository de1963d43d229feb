"""The YouTube Live caption sink against a local HTTP server that checks YouTube's
documented rules: body = (UTC time line `YYYY-MM-DDTHH:MM:SS.mmm`, text line with <br>)
pairs, text/plain, `seq` one more per new POST and the same on a retry."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp import web
from redis.asyncio import Redis

from orchestrator.outputs.config import OutputsConfig, YoutubeSinkConfig, start_outputs
from orchestrator.outputs.runner import youtube_state_key
from orchestrator.outputs.youtube import YoutubeCaptionSink, YoutubeConfigError, YoutubeOptions
from orchestrator.redis_server import free_port
from tests.outputs_support import caption
from tests.waiting import eventually
from workers.bus import RedisBus
from workers.events import StreamOptions

integration = pytest.mark.integration
unit = pytest.mark.unit

WAIT_S = 10.0
SECRET = "cid=s3cr3t-stream-key-0123"
TIME_LINE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}$")


@dataclass
class Received:
    seq: int
    content_type: str
    body: str
    captions: list[tuple[dt.datetime, str]]


@dataclass
class FakeYoutube:
    """Answers POSTs with the scripted statuses (then 200), recording what it got."""

    statuses: list[int] = field(default_factory=list)
    got: list[Received] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    hold: asyncio.Event | None = None
    problems: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        query = parse_qs(urlsplit(str(request.url)).query)
        if query.get("cid") != ["s3cr3t-stream-key-0123"]:
            self.problems.append("the ingestion URL's own parameters were not kept")
        lines = body.split("\n")
        if lines[-1] != "" or len(lines) % 2 != 1:
            self.problems.append(f"body is not (time, text) line pairs: {body!r}")
        captions = []
        for time_line, text in zip(lines[:-1:2], lines[1::2], strict=True):
            if not TIME_LINE.match(time_line):
                self.problems.append(f"bad time line {time_line!r}")
                continue
            at = dt.datetime.strptime(time_line, "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=dt.UTC)
            captions.append((at, text))
        if self.hold is not None:
            await self.hold.wait()
        async with self.arrived:
            self.got.append(Received(int(query["seq"][0]), request.content_type, body,
                                     captions))
            self.arrived.notify_all()
        status = self.statuses.pop(0) if self.statuses else 200
        return web.Response(status=status, text="2024-01-01T00:00:00.000\n")

    async def wait_for(self, n: int) -> list[Received]:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.got) >= n), WAIT_S)
        return list(self.got)


async def serve(fake: FakeYoutube, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/closedcaption", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def youtube() -> AsyncIterator[tuple[FakeYoutube, str]]:
    fake = FakeYoutube()
    port = free_port()
    runner = await serve(fake, port)
    yield fake, f"http://127.0.0.1:{port}/closedcaption?{SECRET}"
    await runner.cleanup()


def options(url: str, **kw: object) -> YoutubeOptions:
    return YoutubeOptions(stream="hall", lang="en", url=url, url_env="YT_HALL",
                          retry_initial_s=0.01, retry_max_s=0.05, **kw)  # type: ignore[arg-type]


@integration
async def test_posts_follow_the_documented_body_and_seq_rules_through_a_5xx(
    youtube: tuple[FakeYoutube, str], caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = youtube
    fake.statuses = [200, 503, 500, 200]  # the second POST fails twice, then goes through
    sink = YoutubeCaptionSink(options(url), first_seq=7)
    await sink.start()
    wall = 1_700_000_000.25
    long_text = ("This final is far too long for two lines of thirty-two characters, "
                 "so it is posted as two timed captions.")
    finals = [
        caption(2, 1, "Good morning, everyone.", 10.0, 12.0, wall=wall),
        caption(4, 2, "Welcome to the main hall.", 12.5, 14.0, wall=wall + 2.0),
        caption(6, 3, long_text, 14.0, 20.0, wall=wall + 8.0),
    ]
    caplog.set_level(logging.DEBUG)
    try:
        sink.offer(caption(1, 1, "Good", 10.0, 10.5, final=False))  # interims: not posted
        sink.offer(finals[0])
        got = await fake.wait_for(1)
        sink.offer(finals[1])
        sink.offer(finals[1])  # the same final again: posted once
        got = await fake.wait_for(4)
        sink.offer(finals[2])
        got = await fake.wait_for(5)
        await sink.aclose(drain_s=WAIT_S)  # until the last response has been handled
    finally:
        await sink.aclose()

    assert not fake.problems, fake.problems
    assert [r.seq for r in got] == [7, 8, 8, 8, 9], "one more per new POST, same on retry"
    assert got[1].body == got[2].body == got[3].body
    assert all(r.content_type == "text/plain" for r in got)
    assert [r.captions[0][1] for r in got[:2]] == ["Good morning, everyone.",
                                                   "Welcome to the main hall."]
    # The time line is when the speech was captured: the final's audio start, in UTC.
    assert got[0].captions[0][0].timestamp() == pytest.approx(wall - 2.0, abs=0.001)
    assert got[1].captions[0][0].timestamp() == pytest.approx(wall + 2.0 - 1.5, abs=0.001)
    (t1, text1), (t2, text2) = got[4].captions
    assert t1.timestamp() == pytest.approx(wall + 8.0 - 6.0, abs=0.001) and t1 < t2
    assert "<br>" in text1 and "\n" not in text1
    for text in (text1, text2):
        assert all(len(line) <= 32 for line in text.split("<br>"))
    assert " ".join(f"{text1} {text2}".replace("<br>", " ").split()) == long_text
    assert (sink.posted, sink.retries, sink.rejected, sink.dropped) == (3, 2, 0, 0)
    assert all(SECRET not in r.getMessage() and "s3cr3t" not in r.getMessage()
               for r in caplog.records)


@integration
async def test_a_4xx_is_not_retried_and_the_next_post_moves_on(
    youtube: tuple[FakeYoutube, str], caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = youtube
    fake.statuses = [403]
    sink = YoutubeCaptionSink(options(url))
    await sink.start()
    try:
        sink.offer(caption(1, 1, "Refused.", 0.0, 1.0))
        await fake.wait_for(1)
        sink.offer(caption(2, 2, "Accepted.", 1.0, 2.0))
        got = await fake.wait_for(2)
        await sink.aclose(drain_s=WAIT_S)
    finally:
        await sink.aclose()
    assert [r.seq for r in got] == [1, 2]
    assert (sink.posted, sink.rejected, sink.retries) == (1, 1, 0)
    refusal = [r.getMessage() for r in caplog.records if "HTTP 403" in r.getMessage()]
    assert refusal and "$YT_HALL" in refusal[0] and "s3cr3t" not in refusal[0]


@integration
async def test_network_errors_are_retried_with_the_same_seq_until_youtube_answers() -> None:
    port = free_port()  # nothing listens yet
    url = f"http://127.0.0.1:{port}/closedcaption?{SECRET}"
    sink = YoutubeCaptionSink(options(url))
    await sink.start()
    fake = FakeYoutube()
    runner = None
    try:
        sink.offer(caption(1, 1, "Are you there?", 0.0, 1.0))

        async def retried() -> bool:
            return sink.retries >= 2

        await eventually(retried, WAIT_S, "the sink to retry")
        runner = await serve(fake, port)
        got = await fake.wait_for(1)
        await sink.aclose(drain_s=WAIT_S)
    finally:
        await sink.aclose()
        if runner is not None:
            await runner.cleanup()
    assert [r.seq for r in got] == [1]
    assert sink.posted == 1


@integration
async def test_backlog_is_bounded_and_drops_the_oldest_finals(
    youtube: tuple[FakeYoutube, str]
) -> None:
    fake, url = youtube
    fake.hold = asyncio.Event()  # YouTube hangs: finals pile up
    sink = YoutubeCaptionSink(options(url, max_backlog=3, batch=10))
    await sink.start()
    try:
        sink.offer(caption(1, 1, "First.", 0.0, 1.0))

        async def taken() -> bool:  # the sender has taken the first one
            return sink.backlog == 0

        await eventually(taken, WAIT_S, "the sender to take the first final")
        for i in range(2, 8):
            sink.offer(caption(i, i, f"Final {i}.", float(i), i + 1.0))
        assert sink.backlog == 3 and sink.dropped == 3
        fake.hold.set()
        got = await fake.wait_for(2)
    finally:
        await sink.aclose()
    texts = [[c[1] for c in r.captions] for r in got]
    assert texts == [["First."], ["Final 5.", "Final 6.", "Final 7."]]
    assert [r.seq for r in got] == [1, 2]


@integration
async def test_runner_posts_published_finals_and_keeps_seq_across_restarts(
    redis_url: str, bus: RedisBus, youtube: tuple[FakeYoutube, str],
    caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = youtube
    caplog.set_level(logging.DEBUG)
    cfg = OutputsConfig.model_validate({
        "archive": {"dir": None},
        "youtube": [{"stream": "hall", "lang": "fr", "url_env": "YT_HALL_FR"}],
    })
    streams = [StreamOptions(stream_id="hall", name="Hall", source="push", language="en",
                             targets=("fr",))]
    env = {"YT_HALL_FR": url}
    await bus.publish_caption(caption(1, 1, "Avant le début.", 0.0, 1.0, lang="fr"))
    runner = await start_outputs(redis_url, streams, cfg, environ=env)
    try:
        await bus.publish_caption(caption(2, 2, "Bonjour.", 1.0, 2.0, lang="fr"))
        await bus.publish_caption(caption(3, 3, "Hello.", 1.0, 2.0, lang="en"))  # not posted
        await bus.publish_caption(caption(4, 3, "Bienvenue.", 2.0, 3.0, lang="fr"))
        got = await fake.wait_for(2)
    finally:
        await runner.aclose()
    # A sink starts at the live edge: the final published before it is not posted late.
    assert [(r.seq, r.captions[0][1]) for r in got] == [(1, "Bonjour."), (2, "Bienvenue.")]

    redis = Redis.from_url(redis_url)
    try:
        assert await redis.hget(youtube_state_key("hall", "fr"), "seq") == b"2"
    finally:
        await redis.aclose()
    runner = await start_outputs(redis_url, streams, cfg, environ=env)
    try:
        await bus.publish_caption(caption(5, 4, "Suite.", 3.0, 4.0, lang="fr"))
        got = await fake.wait_for(3)
    finally:
        await runner.aclose()
    assert got[2].seq == 3, "seq goes on after a restart"
    assert not fake.problems
    assert all("s3cr3t" not in r.getMessage() for r in caplog.records)


@unit
def test_missing_or_bad_url_is_reported_by_variable_name_only() -> None:
    from orchestrator.outputs.config import outputs_options

    cfg = OutputsConfig(youtube=[YoutubeSinkConfig(stream="hall", lang="en", url_env="YT_A"),
                                 YoutubeSinkConfig(stream="hall", lang="fr", url_env="YT_B")])
    opts, problems = outputs_options(cfg, {"YT_B": "rtmp://s3cr3t"})
    assert opts.youtube == ()
    assert "YT_A is not set" in problems[0]
    assert "$YT_B is not an http(s) URL" in problems[1] and "s3cr3t" not in problems[1]
    with pytest.raises(YoutubeConfigError) as err:
        YoutubeOptions(stream="hall", lang="en", url="ftp://s3cr3t")
    assert "s3cr3t" not in str(err.value)
    assert "s3cr3t" not in repr(YoutubeOptions(stream="h", lang="en", url=f"http://x/?{SECRET}"))


@unit
def test_youtube_sinks_must_name_a_stream_and_language_of_the_event() -> None:
    from types import SimpleNamespace

    from orchestrator.outputs.config import outputs_problems

    cfg = OutputsConfig.model_validate({"youtube": [
        {"stream": "hall", "lang": "fr", "url_env": "YT_1"},
        {"stream": "hall", "lang": "de", "url_env": "YT_2"},
        {"stream": "annex", "lang": "en", "url_env": "YT_3"},
        {"stream": "hall", "lang": "fr", "url_env": "YT_4"},
    ]})
    streams = [SimpleNamespace(id="hall", language="en", targets=["fr"])]
    problems = outputs_problems(cfg, streams)
    assert [(loc, msg) for loc, msg, _ in problems] == [
        (("youtube", 1, "lang"), "stream 'hall' has captions in en, fr, not 'de'"),
        (("youtube", 2, "stream"), "no stream 'annex' in this event (streams: hall)"),
        (("youtube", 3), "a second youtube sink for hall/fr (first: youtube[0])"),
    ]
    with pytest.raises(ValueError, match="not an environment variable name"):
        YoutubeSinkConfig(stream="hall", lang="en", url_env="https://upload.youtube.com/x")
