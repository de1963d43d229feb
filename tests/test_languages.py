"""Other languages on the multilingual model, real human speech, whole system.

`babelcast run` (local Ray, Whisper base, the embedded translators) captions a French
room (`language: fr`, translated to Spanish through Apertium) and a Spanish room
(`language: es`, translated to English), each ~25 s of held-out speech: Debian's Asterisk
prompt recordings (`tests.speech.prompts_talk`, CC-BY-SA-3.0, not committed). An Italian
recording goes through the engine with `language: auto`. WER per language is measured by
`bench.languages`; the bound here only says the speech was recognised as that language.
"""

from __future__ import annotations

import asyncio
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jiwer
import pytest
import websockets

from orchestrator.redis_server import LocalRedisServer, free_port
from tests.speech import Talk, normalize_any, prompts_talk
from tests.test_pipeline import Event, start_event, stop_event
from workers.engines.base import SessionOptions
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine
from workers.events import SAMPLE_RATE, AudioChunk

pytestmark = pytest.mark.integration

RECOGNISED_WER = 0.5
"""Far above Whisper base's WER on these recordings (bench.languages) and far below what a
wrong language or a wrong decode gives (~1.0): only says "recognised as this language"."""
ROOMS = {"fr": "es", "es": "en"}  # spoken language → translation target


def write_wav(path: Path, pcm: bytes) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(bytes(SAMPLE_RATE) + pcm)  # 0.5 s of silence first
    return path


@pytest.fixture(scope="module")
def talks() -> dict[str, Talk]:
    return {lang: prompts_talk(lang, 25.0) for lang in (*ROOMS, "it")}


@pytest.fixture(scope="module")
def event(redis_server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory,
          talks: dict[str, Talk]) -> Iterator[Event]:
    tmp = tmp_path_factory.mktemp("languages")
    port = free_port()
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/5"
    streams = "\n".join(
        f'  - {{id: room-{lang}, source: "{write_wav(tmp / f"{lang}.wav", talks[lang].pcm)}", '
        f"language: {lang}, targets: [{target}]}}" for lang, target in ROOMS.items())
    cfg = tmp / "event.yaml"
    cfg.write_text(f"""
event: languages test
redis: {{url: "{redis_url}"}}
engine: {{kind: embedded, model: whisper-base, actors: 1, streams_per_actor: 2}}
streams:
{streams}
gateway: {{host: 127.0.0.1, port: {port}, workers: 1}}  # about languages: one is enough
auth: {{admin_token_env: LANGUAGES_ADMIN_TOKEN, viewers: public}}
""")
    # Captions are public here (tests/test_auth.py covers viewer tokens).
    ev = start_event(cfg, port, {"LANGUAGES_ADMIN_TOKEN": "languages-admin-token-0123456789"})
    yield ev
    stop_event(ev)


async def read_until(event: Event, stream: str, lang: str, done: Any,
                     timeout_s: float) -> list[dict[str, Any]]:
    """Publications of (stream, lang) from the first, until `done(messages)`."""
    out: list[dict[str, Any]] = []
    url = f"{event.ws}/v1/streams/{stream}/captions?lang={lang}&since=0"
    async with websockets.connect(url) as ws:
        async with asyncio.timeout(timeout_s):
            while not done(out):
                try:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 5.0))
                except TimeoutError:
                    continue
                if msg.get("type") == "caption":
                    out.append(msg)
    return out


def source_finished(talk: Talk) -> Any:
    """Done when a final covers the talk's last second of speech. Not "the last message is
    such a final": after it the engine may show tentative words on the trailing audio and
    then withdraw them (a `withdraw` message, not a caption), and nothing comes after
    that, so such a reader waited out its 150 s (seen in 2 of 3 whole-suite runs on
    2026-12-02, never alone)."""
    end_s = 0.5 + talk.seconds - 1.5
    return lambda msgs: any(m["is_final"] and m["text"] and m["audio_end_s"] >= end_s
                            for m in msgs)


@pytest.fixture(scope="module")
def captions(event: Event, talks: dict[str, Talk]) -> dict[str, Any]:
    async def collect() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for lang, target in ROOMS.items():
            stream = f"room-{lang}"
            source = await read_until(event, stream, lang, source_finished(talks[lang]), 150)
            want = {m["segment_id"] for m in source if m["is_final"] and m["text"]}
            translated = await read_until(
                event, stream, target,
                lambda msgs, want=want: want <= {m["segment_id"] for m in msgs
                                                 if m["is_final"]}, 60)
            out[lang] = {"source": source, "translated": translated}
        return out

    return asyncio.run(collect())


@pytest.mark.parametrize("lang", list(ROOMS))
def test_speech_in_another_language_is_captioned_in_that_language(
        captions: dict[str, Any], talks: dict[str, Talk], lang: str) -> None:
    source = captions[lang]["source"]
    finals = [m for m in source if m["is_final"] and m["text"]]
    assert len(finals) >= 2
    assert all(m["lang"] == lang for m in source)
    wer = jiwer.wer(normalize_any(talks[lang].text),
                    normalize_any(" ".join(m["text"] for m in finals)))
    assert wer < RECOGNISED_WER, f"{lang}: WER {wer:.3f}"
    seen: set[int] = set()
    for m in source:
        assert m["segment_id"] not in seen, "a final was revised"
        if m["is_final"]:
            seen.add(m["segment_id"])


@pytest.mark.parametrize("lang", list(ROOMS))
def test_each_final_is_translated_once_into_the_target(
        captions: dict[str, Any], lang: str) -> None:
    target = ROOMS[lang]
    source = {m["segment_id"]: m for m in captions[lang]["source"] if m["is_final"] and m["text"]}
    finals = [m for m in captions[lang]["translated"] if m["is_final"]]
    assert sorted(m["segment_id"] for m in finals) == sorted(source)
    for m in finals:
        assert m["lang"] == target and m["source_lang"] == lang and m["error"] is None
        assert m["text"]
    # Translated, not copied: most finals read differently. Not every one: a final that
    # is all words the translator does not know (a misheard "acliando dijitos", seen in
    # a suite run) comes back as it went in, which is Apertium's way with unknown words.
    changed = sum(m["text"] != source[m["segment_id"]]["text"] for m in finals)
    assert changed > len(finals) / 2, f"only {changed} of {len(finals)} finals translated"


def test_language_auto_detects_italian_and_captions_it(talks: dict[str, Talk]) -> None:
    async def run() -> tuple[set[str], str]:
        engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(cpu_threads=2))
        await engine.start()
        session = engine.open_session(SessionOptions("it", "auto"))
        pcm = talks["it"].pcm + bytes(2 * SAMPLE_RATE)
        languages: set[str] = set()
        words: list[str] = []

        async def feed() -> None:
            step = SAMPLE_RATE // 10
            for i in range(0, len(pcm), step * 2):
                await session.push(AudioChunk("it", i // 2, pcm[i : i + step * 2], 0.0))
                await asyncio.sleep(0.02)  # ~5x real time: the audio decides, not the clock
            await session.end_input()

        async def consume() -> None:
            async for delta in session:
                if delta.language:
                    languages.add(delta.language)
                words.extend(w.text for w in delta.committed)

        await asyncio.wait_for(asyncio.gather(feed(), consume()), 180)
        await engine.aclose()
        return languages, "".join(words)

    languages, text = asyncio.run(run())
    assert languages == {"it"}
    wer = jiwer.wer(normalize_any(talks["it"].text), normalize_any(text))
    assert wer < RECOGNISED_WER, f"it: WER {wer:.3f}"
