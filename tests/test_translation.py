"""Translation: glossary, prompt, routing and config rules; the embedded backends for
real (Apertium, Bergamot); the translation host against a real redis-server; and the
openai-chat backend against a local server that speaks the chat-completions schema."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil
import pytest

from orchestrator.config import ConfigError, parse_event
from tests.translation_jobs import enqueue_talk, final_job, published, reference_sentences
from tests.waiting import eventually
from translation.backends import BackendSettings, Routes, build, concrete
from translation.backends.base import BackendError, TranslationRequest
from translation.backends.openai_chat import OpenAIChatOptions, OpenAIChatTranslator
from translation.backends.prompt import ReplyError, build_messages, parse_reply
from translation.glossary import Glossary, GlossaryTerm
from translation.host import MAX_INTERRUPTS, TranslationHost, TranslationHostOptions
from translation.jobs import GROUP, JobQueue
from workers.bus import JOBS_KEY, RedisBus, job_from_json
from workers.events import CaptionSegment, StreamOptions, TranslationJob

GLOSSARY = Glossary([
    GlossaryTerm("Babelcast", keep=True),
    GlossaryTerm("keynote", {"es": "plenaria", "fr": "plénière", "pt": "palestra principal"}),
])


# ---- glossary, prompt, routing (pure) ------------------------------------------
@pytest.mark.unit
def test_glossary_protects_terms_and_restores_the_configured_text() -> None:
    p = GLOSSARY.protect("Keynote: the Babelcast keynote starts.", "pt")
    assert "Babelcast" not in p.text and "eynote" not in p.text
    text, missing = p.restore(p.text)
    assert text == "Palestra principal: the Babelcast palestra principal starts."
    assert missing == 0
    # A term with no rule for the language is left to the translator.
    assert GLOSSARY.protect("The keynote.", "de").text == "The keynote."
    # A placeholder the engine dropped is counted, not invented.
    assert p.restore("nothing left")[1] == 3


@pytest.mark.unit
def test_glossary_matches_whole_words_only() -> None:
    g = Glossary([GlossaryTerm("Ray", keep=True)])
    assert g.protect("Rayleigh scattering and array", "es").replacements == ()
    assert g.protect("Ray runs the actors", "es").replacements == ("Ray",)


@pytest.mark.unit
def test_prompt_carries_context_glossary_and_every_sentence() -> None:
    reqs = [TranslationRequest("The keynote is about Babelcast.", "en", "fr",
                               ("Welcome everyone.",)),
            TranslationRequest("It starts now.", "en", "fr")]
    system, user = build_messages(reqs, GLOSSARY)
    assert system["role"] == "system" and user["role"] == "user"
    assert "English" in system["content"] and "French" in system["content"]
    assert "exactly 2" in system["content"]
    assert '"keynote": translate as "plénière"' in user["content"]
    assert '"Babelcast": keep as is' in user["content"]
    assert "[1] context: Welcome everyone." in user["content"]
    assert "[2] sentence: It starts now." in user["content"]


@pytest.mark.unit
def test_parse_reply_accepts_fenced_json_and_rejects_a_misaligned_answer() -> None:
    assert parse_reply('```json\n{"translations": ["a", " b "]}\n```', 2) == ["a", "b"]
    with pytest.raises(ReplyError, match="returned 1 translations for 2"):
        parse_reply('{"translations": ["a"]}', 2)
    with pytest.raises(ReplyError):
        parse_reply("Sure! Here you go: a, b", 2)


@pytest.mark.unit
def test_routes_pick_exact_pair_then_wildcards_then_default() -> None:
    r = Routes(default="embedded", pairs={"en-de": "openai-chat", "*-fr": "vllm",
                                          "es-*": "apertium"})
    assert r.kind_for("en", "de") == "openai-chat"
    assert r.kind_for("en", "fr") == "vllm"
    assert r.kind_for("es", "en") == "apertium"
    assert r.backend_for("en", "pt") == "bergamot"
    assert r.backend_for("en", "es") == "apertium"
    assert concrete("embedded", "auto", "es") is None
    with pytest.raises(BackendError, match="en→ja"):
        r.backend_for("en", "ja")


def _event(extra: str, targets: str = "[pt, es]", language: str = "en") -> str:
    return f"""event: t
streams:
  - id: a
    source: push
    language: {language}
    targets: {targets}
{extra}"""


@pytest.mark.unit
def test_a_pair_no_backend_supports_fails_validation_with_file_line_and_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse_event(_event("", targets="[pt, de]"), filename="ev.yaml")
    msg = str(err.value)
    assert msg.startswith("ev.yaml:6: streams[0].targets[1]: no translation backend for en→de")
    assert "openai-chat or vllm" in msg
    # Routing the pair to an LLM backend makes it valid.
    cfg = parse_event(_event("translation:\n  routes: {en-de: openai-chat}\n  openai: "
                             "{url: 'http://127.0.0.1:9/v1', model: m}", targets="[pt, de]"))
    assert cfg.translation.routing.backend_for("en", "de") == "openai-chat"


@pytest.mark.unit
def test_translation_config_errors_name_the_key() -> None:
    cases = {
        "translation:\n  routes: {en-de: openai-chat}": "translation.openai: backend "
                                                        "openai-chat is routed",
        "translation:\n  routes: {english-de: vllm}": "translation.routes: route keys",
        "glossary:\n  - term: Babelcast": "glossary[0]: glossary term 'Babelcast' needs",
        "glossary:\n  - {term: x, translations: {french: y}}": "glossary[0].translations",
    }
    for extra, expected in cases.items():
        with pytest.raises(ConfigError, match=re.escape(expected)):
            parse_event(_event(extra))
    with pytest.raises(ConfigError, match="auto"):
        parse_event(_event("", language="auto"))


# ---- the embedded backends, for real --------------------------------------------
@pytest.mark.integration
async def test_embedded_backends_translate_with_the_glossary() -> None:
    apertium = build("apertium", BackendSettings())
    bergamot = build("bergamot", BackendSettings())
    await apertium.start()
    await bergamot.start()
    try:
        text = "The keynote about Babelcast starts at ten."
        es, fr = await apertium.translate(
            [TranslationRequest(text, "en", "es"), TranslationRequest(text, "en", "fr")],
            GLOSSARY)
        (pt,) = await bergamot.translate([TranslationRequest(text, "en", "pt")], GLOSSARY)
        assert isinstance(es, str) and isinstance(fr, str) and isinstance(pt, str)
        assert "plenaria" in es and "Babelcast" in es and "diez" in es
        assert "plénière" in fr and "Babelcast" in fr and "dix" in fr  # through es
        assert "palestra principal" in pt and "Babelcast" in pt and "dez" in pt
        back = await apertium.translate([TranslationRequest("Le chat est noir.", "fr", "en")],
                                        Glossary())
        assert back == ["The cat is black."]
        assert apertium.stats.glossary_misses == 0 and bergamot.stats.glossary_misses == 0
    finally:
        await apertium.aclose()
        await bergamot.aclose()


@pytest.mark.integration
async def test_a_batch_of_many_sentences_stays_aligned() -> None:
    apertium = build("apertium", BackendSettings())
    await apertium.start()
    sentences = reference_sentences()
    batch = await apertium.translate([TranslationRequest(s, "en", "es") for s in sentences],
                                     Glossary())
    one_by_one = [(await apertium.translate([TranslationRequest(s, "en", "es")], Glossary()))[0]
                  for s in sentences[:3]]
    assert batch[:3] == one_by_one
    assert all(isinstance(b, str) and b for b in batch)
    assert apertium.stats.calls == 4


# ---- the host, against a real redis-server ------------------------------------------
@pytest.fixture
async def host_factory(redis_url: str) -> AsyncIterator[Any]:
    hosts: list[TranslationHost] = []

    async def make(translator_id: str = "t0", **kw: Any) -> TranslationHost:
        opts = TranslationHostOptions(translator_id=translator_id, redis_url=redis_url,
                                      glossary=GLOSSARY.terms, **kw)
        host = TranslationHost(opts)
        await host.start()
        hosts.append(host)
        return host

    yield make
    for h in hosts:
        await h.stop()


@pytest.mark.integration
async def test_finals_reach_every_target_once_in_source_order(
        bus: RedisBus, host_factory: Any) -> None:
    jobs = await enqueue_talk(bus, "talk", ("es", "pt", "fr"))
    await bus.redis.xadd(JOBS_KEY, {"d": b"{not json"})  # a broken job blocks nothing
    host = await host_factory()

    async def all_out() -> bool:
        counts = [len(await published(bus, "talk", lang)) for lang in ("es", "pt", "fr")]
        return counts == [len(jobs)] * 3

    await eventually(all_out, 60, "every job translated into es, pt and fr")
    for lang in ("es", "pt", "fr"):
        segs = await published(bus, "talk", lang)
        assert [s.seq for s in segs] == list(range(1, len(jobs) + 1))
        assert [s.segment_id for s in segs] == [j.segment_id for j in jobs]
        for seg, job in zip(segs, jobs, strict=True):
            assert seg.is_final and seg.error is None and seg.source_lang == "en"
            assert seg.text and seg.text != job.text and seg.lines
            assert max(len(line) for line in seg.lines) <= 42
            assert (seg.audio_start_s, seg.audio_end_s) == (job.audio_start_s, job.audio_end_s)
    assert host.counters["undecodable"] == 1
    summary = await bus.redis.xpending(JOBS_KEY, GROUP)
    assert summary["pending"] == 0, "every job, the broken one too, is acked"


@pytest.mark.integration
async def test_a_restarted_translator_takes_its_own_pending_jobs_first(
        bus: RedisBus, host_factory: Any, redis_url: str) -> None:
    jobs = await enqueue_talk(bus, "talk", ("es",))
    # A translator named t0 read the jobs and died before publishing or acking.
    dead = JobQueue(bus.redis, "t0")
    await dead.ensure_group()
    assert len(await dead.read(100, 100)) == len(jobs)
    # Its replacement (same consumer name, as a restarted Ray actor has) must not wait
    # for the claim timeout: it reads its own pending list first.
    await host_factory("t0", claim_idle_s=3600)

    async def done() -> bool:
        return len(await published(bus, "talk", "es")) == len(jobs)

    await eventually(done, 30, "the restarted translator to finish its pending jobs")


@pytest.mark.integration
async def test_a_job_pending_with_a_dead_translator_is_claimed_and_published_once(
        bus: RedisBus, host_factory: Any) -> None:
    jobs = await enqueue_talk(bus, "talk", ("es", "pt"))
    dead = JobQueue(bus.redis, "gone")
    await dead.ensure_group()
    taken = await dead.read(3, 100)
    # The dead one had already published one translation of its first job.
    first = next(j for j in jobs if j.segment_id == 1)
    host = await host_factory("alive", claim_idle_s=0.5, claim_every_s=0.2)
    await host.process(taken[:1])  # what "gone" published before it died, not acked

    async def done() -> bool:
        counts = [len(await published(bus, "talk", lang)) for lang in ("es", "pt")]
        return min(counts) >= len(jobs)

    await eventually(done, 30, "all jobs translated, the dead translator's included")
    await asyncio.sleep(1.0)  # let a duplicate, if any, arrive
    for lang in ("es", "pt"):
        ids = [s.segment_id for s in await published(bus, "talk", lang)]
        assert sorted(ids) == [j.segment_id for j in jobs], f"{lang}: each exactly once"
    assert host.counters["claimed"] == 3
    assert host.counters["duplicates_skipped"] >= 2  # job 1 again, both languages
    assert first.segment_id in ids


# ---- openai-chat: a contract test against a local chat-completions server -------------
@dataclass
class ChatServer:
    """Speaks the chat-completions schema; "translates" by tagging each sentence with
    the target language. Scripted failures: HTTP statuses to answer first, a wrong
    number of translations for batches, or a delay."""

    fail_with: list[int] = field(default_factory=list)
    misalign_batches: bool = False
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.fail_with:
            return self.fail_with.pop(0), {"error": {"message": "scripted failure"}}
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        target = re.search(r"into (\w+)", system)
        sentences = re.findall(r"^\[\d+\] sentence: (.*)$", user, re.MULTILINE)
        out = [f"<{target.group(1) if target else '?'}> {s}" for s in sentences]
        if self.misalign_batches and len(out) > 1:
            out = out[:-1]
        content = json.dumps({"translations": out})
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": content}}]}


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    state = ChatServer()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/chat/completions", self.path
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(body)
            state.headers.append(dict(self.headers))
            time.sleep(state.delay_s)
            status, reply = state.answer(body)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # A client that timed out before a delayed answer is part of the script.
            if not isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


async def _chat(server: ChatServer, monkeypatch: pytest.MonkeyPatch,
                **kw: Any) -> OpenAIChatTranslator:
    monkeypatch.setenv("BABELCAST_TEST_KEY", "sk-test-123")
    t = OpenAIChatTranslator(OpenAIChatOptions(url=server.url, model="mt-model",
                                               api_key_env="BABELCAST_TEST_KEY", **kw))
    t.retry_backoff_s = 0.05
    await t.start()
    return t


@pytest.mark.integration
async def test_openai_chat_contract_batches_one_pair_per_request(
        chat_server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    t = await _chat(chat_server, monkeypatch)
    reqs = [TranslationRequest(f"Sentence {i} about the keynote.", "en", "fr", ("Before.",))
            for i in range(5)] + [TranslationRequest("Hello.", "en", "de")]
    out = await t.translate(reqs, GLOSSARY)
    await t.aclose()
    assert out[:5] == [f"<French> Sentence {i} about the keynote." for i in range(5)]
    assert out[5] == "<German> Hello."
    assert len(chat_server.requests) == 2  # one per language pair
    body = next(b for b in chat_server.requests if "French" in b["messages"][0]["content"])
    assert body["model"] == "mt-model" and body["temperature"] == 0.0
    assert body["max_tokens"] > sum(len(r.text) for r in reqs[:5])
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert '"keynote": translate as "plénière"' in body["messages"][1]["content"]
    assert "context: Before." in body["messages"][1]["content"]
    assert all(h["Authorization"] == "Bearer sk-test-123" for h in chat_server.headers)
    assert t.stats.prompt_chars > t.stats.chars_in  # context and instructions cost too


@pytest.mark.integration
async def test_openai_chat_contract_retries_a_5xx(
        chat_server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    chat_server.fail_with = [503, 500]
    t = await _chat(chat_server, monkeypatch, max_retries=2)
    assert await t.translate([TranslationRequest("Hi.", "en", "es")], Glossary()) == [
        "<Spanish> Hi."]
    assert len(chat_server.requests) == 3
    await t.aclose()


@pytest.mark.integration
async def test_openai_chat_contract_gives_up_with_an_error_per_sentence(
        chat_server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    chat_server.fail_with = [400]
    t = await _chat(chat_server, monkeypatch)
    (out,) = await t.translate([TranslationRequest("Hi.", "en", "es")], Glossary())
    assert isinstance(out, BackendError) and "HTTP 400" in str(out)
    assert len(chat_server.requests) == 1  # a refusal is not retried
    await t.aclose()


@pytest.mark.integration
async def test_openai_chat_contract_splits_a_misaligned_batch(
        chat_server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    chat_server.misalign_batches = True
    t = await _chat(chat_server, monkeypatch)
    reqs = [TranslationRequest(f"S{i}.", "en", "es") for i in range(3)]
    assert await t.translate(reqs, Glossary()) == [f"<Spanish> S{i}." for i in range(3)]
    assert len(chat_server.requests) == 4  # the batch, then each sentence alone
    await t.aclose()


@pytest.mark.integration
async def test_a_failing_backend_publishes_error_markers_and_other_languages_go_on(
        bus: RedisBus, host_factory: Any, chat_server: ChatServer) -> None:
    chat_server.delay_s = 3.0  # slower than the host's batch timeout (its own is longer)
    await host_factory(
        routes=Routes(pairs={"en-de": "openai-chat"}),
        backends=BackendSettings(openai=OpenAIChatOptions(url=chat_server.url, model="m",
                                                          timeout_s=10.0, max_retries=0)),
        job_timeout_s=2.0)
    job = final_job("talk", 1, "The keynote starts now.", ("de", "es"))
    await bus.enqueue_job(job)

    async def both() -> bool:
        return bool(await published(bus, "talk", "de")) and bool(
            await published(bus, "talk", "es"))

    await eventually(both, 30, "a publication in de and es")
    (de,) = await published(bus, "talk", "de")
    (es,) = await published(bus, "talk", "es")
    assert de.is_final and de.text == "" and de.error is not None
    assert de.error == "openai-chat: BackendTimeout"  # a slow backend, told from a broken one
    assert es.error is None and "plenaria" in es.text


class ApertiumKiller:
    """SIGKILLs this process's Apertium children as they start (the first `times` of
    them, or all): what Ray does to a dying actor's child processes before the actor
    itself exits, and what the OOM killer may do to one. A thread polls every 2 ms."""

    def __init__(self, times: int | None = None) -> None:
        self.times, self.pids = times, set[int]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.002):
            if self.times is not None and self.killed >= self.times:
                return
            for child in me.children():
                if child.pid in self.pids:  # killed, not yet reaped: still listed
                    continue
                try:
                    if any(a.endswith("/apertium") or a == "apertium" for a in child.cmdline()):
                        child.send_signal(signal.SIGKILL)
                        self.pids.add(child.pid)
                except psutil.Error:  # it ended meanwhile
                    pass

    @property
    def killed(self) -> int:
        return len(self.pids)

    def __enter__(self) -> ApertiumKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.integration
async def test_a_backend_process_killed_under_a_batch_is_tried_again_not_published_failed(
        bus: RedisBus, host_factory: Any) -> None:
    # Seen for real: a translator killed by ray.kill published a final as failed
    # ("apertium eng-spa exited -9") in the 10 ms between Ray killing its children and
    # the actor itself, and the survivor's try was then a duplicate (tests/
    # test_translation_ray.py, 1 run in 6).
    host = await host_factory()
    await host.warm(["apertium"])
    with ApertiumKiller(times=1) as killer:
        await bus.enqueue_job(final_job("talk", 1, "The keynote starts now.", ("es",)))
        await eventually(lambda: _published_any(bus, "es"), 30, "a publication in es")
    (es,) = await published(bus, "talk", "es")
    assert killer.killed == 1
    assert es.error is None and "plenaria" in es.text, es.error
    assert host.counters["interrupted_retries"] == 1


@pytest.mark.integration
async def test_a_backend_process_killed_every_time_is_published_failed_after_its_tries(
        bus: RedisBus, host_factory: Any) -> None:
    host = await host_factory()
    await host.warm(["apertium", "bergamot"])
    with ApertiumKiller() as killer:
        await bus.enqueue_job(final_job("talk", 1, "The keynote starts now.", ("es", "pt")))
        await eventually(lambda: _published_any(bus, "es"), 30, "a publication in es")
    (es,) = await published(bus, "talk", "es")
    (pt,) = await published(bus, "talk", "pt")
    assert es.is_final and es.text == "" and es.error == "apertium: BackendInterrupted"
    assert pt.error is None and pt.text  # the batch's other language, published with it
    assert host.counters["interrupted_retries"] == MAX_INTERRUPTS
    assert killer.killed == MAX_INTERRUPTS + 1


async def _published_any(bus: RedisBus, lang: str) -> bool:
    return bool(await published(bus, "talk", lang))


@pytest.mark.integration
async def test_live_tail_jobs_publish_non_finals_that_never_follow_the_final(
        bus: RedisBus, host_factory: Any) -> None:
    host = await host_factory(max_tail_age_s=5.0)
    final = final_job("talk", 7, "The keynote starts now.", ("es",))
    tail = replace(final, text="The keynote starts", is_final=False)
    stale = replace(tail, source_emit_time=time.time() - 60)
    await bus.enqueue_job(stale)  # older than max_tail_age_s: skipped
    await bus.enqueue_job(tail)
    await bus.enqueue_job(final)

    async def final_out() -> bool:
        return any(s.is_final for s in await published(bus, "talk", "es"))

    await eventually(final_out, 30, "the final translation")
    await bus.enqueue_job(replace(tail, source_emit_time=time.time()))  # late: dropped
    await eventually(lambda: _counter(host, "duplicates_skipped", 1), 10, "the late tail")
    segs = await published(bus, "talk", "es")
    assert [(s.is_final, s.revision) for s in segs] == [(False, 1), (True, 2)]
    assert all(s.segment_id == 7 for s in segs)
    assert segs[0].stable_prefix_len == 0 and segs[1].stable_prefix_len == len(segs[1].text)
    assert host.counters["stale_tail_jobs"] == 1


async def _counter(host: TranslationHost, name: str, at_least: float) -> bool:
    return host.counters[name] >= at_least


# ---- the ASR side's enqueueing --------------------------------------------------------
def _seg(segment_id: int, text: str, final: bool, emit: float) -> CaptionSegment:
    return CaptionSegment(stream="talk", lang="en", segment_id=segment_id, seq=segment_id,
                          revision=1, is_final=final, text=text, stable_prefix_len=0,
                          lines=(text,), audio_start_s=0.0, audio_end_s=1.0,
                          audio_end_wall=emit - 1, emit_time=emit)


async def _jobs(bus: RedisBus) -> list[TranslationJob]:
    return [job_from_json(f[b"d"]) for _, f in await bus.redis.xrange(JOBS_KEY)]


@pytest.mark.integration
async def test_asr_side_enqueues_finals_with_context_and_tails_at_most_every_n_s(
        bus: RedisBus) -> None:
    from types import SimpleNamespace

    from workers.asr import _StreamRunner

    opts = StreamOptions(stream_id="talk", name="talk", source="push", language="en",
                         targets=("es", "pt"), context_sentences=2)
    # A stand-in host: what a runner reads of it here (the bus, its actor id).
    host = SimpleNamespace(bus=bus, options=SimpleNamespace(actor_id="t"))
    runner = _StreamRunner(host, opts)  # type: ignore[arg-type]
    for i, text in enumerate(["One.", "Two.", "", "Three."], 1):
        await runner._enqueue_translation(_seg(i, "partial", False, 100.0 + i))
        await runner._enqueue_translation(_seg(i, text, True, 100.5 + i))
    jobs = await _jobs(bus)
    assert [j.text for j in jobs] == ["One.", "Two.", "Three."]  # no partials, no empties
    assert [j.context for j in jobs] == [(), ("One.",), ("One.", "Two.")]
    assert all(j.targets == ("es", "pt") and j.is_final for j in jobs)

    await bus.redis.delete(JOBS_KEY)
    tail_runner = _StreamRunner(host,  # type: ignore[arg-type]
                                replace(opts, partials_every_s=2.0))
    for t in (0.0, 1.0, 2.5, 3.0, 4.6):
        await tail_runner._enqueue_translation(_seg(1, f"words at {t}", False, 1000 + t))
    assert [j.text for j in await _jobs(bus) if not j.is_final] == [
        "words at 0.0", "words at 2.5", "words at 4.6"]


@pytest.mark.unit
async def test_vllm_backend_imports_without_vllm_and_says_what_it_needs() -> None:
    import importlib.util

    from translation.backends.vllm_chat import VllmChatOptions, VllmChatTranslator

    t = VllmChatTranslator(VllmChatOptions(model="/models/some-instruct-model"))
    assert t.uses_context and t.batch_size == 16  # the shared prompt/batching path
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(BackendError, match="needs the vllm package"):
            await t.start()
    (out,) = await t.translate([TranslationRequest("Hi.", "en", "fr")], Glossary())
    assert isinstance(out, BackendError) and "not started" in str(out)
