"""The prompt shared by the LLM backends (`openai-chat` and `vllm`), and its parsing.

One prompt translates a batch of sentences of one language pair, possibly from
several streams: each sentence travels with its own context (the previous
sentences of its stream) and the glossary terms it contains. The model answers
with a JSON object holding one translation per sentence, in order.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from translation.backends.base import BackendError, TranslationRequest
from translation.glossary import Glossary

LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "it": "Italian",
    "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch",
    "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "th": "Thai",
    "tr": "Turkish", "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}


def language_name(code: str) -> str:
    if code == "auto":
        return "the speaker's language"
    return LANGUAGE_NAMES.get(code, code)


SYSTEM = (
    "You translate live captions of spoken talks. Translate each numbered sentence "
    "from {source} into {target}, faithfully and naturally, as subtitles. The context "
    "lines are earlier sentences of the same talk, only to resolve references; never "
    "translate or repeat them. Keep names, numbers and technical terms correct. "
    "Follow the glossary exactly where it applies.\n"
    'Answer with JSON only: {{"translations": ["...", "..."]}} holding exactly {n} '
    "strings, one per numbered sentence, in order."
)


@dataclass(frozen=True, slots=True)
class PromptBatch:
    """One chat request: the requests it covers (indices into the caller's list)."""

    indices: tuple[int, ...]
    messages: tuple[dict[str, str], ...]

    @property
    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


def build_messages(requests: list[TranslationRequest],
                   glossary: Glossary) -> list[dict[str, str]]:
    """Chat messages for requests that all share one (source, target) pair."""
    source, target = requests[0].source, requests[0].target
    parts: list[str] = []
    terms: list[str] = []
    for n, r in enumerate(requests, 1):
        if r.context:
            parts.append(f"[{n}] context: " + " ".join(r.context))
        parts.append(f"[{n}] sentence: {r.text}")
        for line in glossary.prompt_lines(r.text, target):
            if line not in terms:
                terms.append(line)
    user = "\n".join(parts)
    if terms:
        user = "Glossary:\n" + "\n".join(terms) + "\n\n" + user
    system = SYSTEM.format(source=language_name(source), target=language_name(target),
                           n=len(requests))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def plan_batches(requests: list[TranslationRequest], glossary: Glossary,
                 max_batch: int) -> list[PromptBatch]:
    """Group by language pair, then split into prompts of at most `max_batch` sentences."""
    by_pair: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        by_pair[(r.source, r.target)].append(i)
    out: list[PromptBatch] = []
    for idx in by_pair.values():
        for k in range(0, len(idx), max(1, max_batch)):
            chunk = tuple(idx[k:k + max_batch])
            out.append(PromptBatch(chunk, tuple(build_messages(
                [requests[i] for i in chunk], glossary))))
    return out


class ReplyError(BackendError):
    """The model answered, but not with one translation per sentence."""


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.MULTILINE)


def parse_reply(content: str, n: int) -> list[str]:
    """The n translations of a model's answer; BackendError if it is not usable."""
    text = _FENCE.sub("", content.strip()).strip()
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ReplyError("the model's answer holds no JSON object")
    try:
        data: Any = json.loads(text[start:end + 1])
    except json.JSONDecodeError as exc:
        raise ReplyError(f"the model's answer is not valid JSON: {exc.msg}") from None
    items = data.get("translations") if isinstance(data, dict) else None
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise ReplyError('the model\'s answer has no "translations" list of strings')
    if len(items) != n:
        raise ReplyError(f"the model returned {len(items)} translations for {n} sentences")
    return [t.strip() for t in items]
