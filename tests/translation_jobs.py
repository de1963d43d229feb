"""Helpers for translation tests: finals of the reference talk as jobs, and reading back
what the translators published."""

from __future__ import annotations

import time

from tests.speech import AUDIO, REFERENCE_FILES
from workers.bus import RedisBus, captions_key
from workers.events import CaptionSegment, TranslationJob


def reference_sentences() -> list[str]:
    """The reference talk's utterances (one per line of its transcripts), written as
    sentences the way captions show them."""
    out: list[str] = []
    for name in REFERENCE_FILES:
        for line in (AUDIO / f"{name}.txt").read_text().splitlines():
            words = line.split()
            if words:
                text = " ".join(words)
                out.append(text[0].upper() + text[1:] + ".")
    return out


def final_job(stream: str, segment_id: int, text: str, targets: tuple[str, ...],
              context: tuple[str, ...] = (), source_lang: str = "en") -> TranslationJob:
    now = time.time()
    return TranslationJob(
        stream=stream, segment_id=segment_id, seq=segment_id, text=text,
        source_lang=source_lang, targets=targets, context=context,
        audio_start_s=float(segment_id), audio_end_s=segment_id + 0.9,
        audio_end_wall=now - 1.0, source_emit_time=now,
    )


async def enqueue_talk(bus: RedisBus, stream: str, targets: tuple[str, ...],
                       copies: int = 1) -> list[TranslationJob]:
    """The reference sentences as final jobs (repeated `copies` times, new segment ids)."""
    jobs: list[TranslationJob] = []
    sentences = reference_sentences() * copies
    for i, text in enumerate(sentences, 1):
        job = final_job(stream, i, text, targets, tuple(sentences[max(0, i - 4):i - 1]))
        await bus.enqueue_job(job)
        jobs.append(job)
    return jobs


async def published(bus: RedisBus, stream: str, lang: str) -> list[CaptionSegment]:
    """Every publication on (stream, lang), oldest first."""
    out: list[CaptionSegment] = []
    since = 0
    while True:
        batch = await bus.captions_after(stream, lang, since)
        if not batch:
            return out
        out += batch
        since = batch[-1].seq


async def count_published(bus: RedisBus, stream: str, lang: str) -> int:
    return int(await bus.redis.xlen(captions_key(stream, lang)))
