"""The event glossary: terms with a forced translation per language, or kept as is.

Two ways to apply it, one per kind of backend:
- LLM backends get the terms that occur in a sentence as prompt lines
  (`Glossary.prompt_lines`).
- Sentence engines (Bergamot, Apertium) cannot be told; the glossary protects each
  term with a placeholder token that engines pass through untouched, and puts the
  configured target text back afterwards (`Glossary.protect`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# Placeholders look like an unknown proper noun: Bergamot and Apertium both copy such
# a token through unchanged (checked for both, including Apertium's es pivot).
_PLACEHOLDER = "ZQX{}"
_PLACEHOLDER_RE = re.compile(r"ZQX(\d+)")


@dataclass(frozen=True, slots=True)
class GlossaryTerm:
    """`term` in any source sentence becomes `translations[lang]` in language `lang`;
    where no translation is given for a language, `keep` leaves the term as it is."""

    term: str
    translations: Mapping[str, str] = field(default_factory=dict)
    keep: bool = False
    case_sensitive: bool = False

    def target_text(self, lang: str) -> str | None:
        if lang in self.translations:
            return self.translations[lang]
        return self.term if self.keep else None


@dataclass(frozen=True, slots=True)
class Protected:
    text: str
    """The sentence with glossary terms replaced by placeholders."""
    replacements: tuple[str, ...]
    """Target text for placeholder i."""

    def restore(self, translated: str) -> tuple[str, int]:
        """(text with placeholders replaced, how many placeholders went missing)."""
        found: set[int] = set()

        def sub(m: re.Match[str]) -> str:
            i = int(m.group(1))
            if i >= len(self.replacements):
                return m.group(0)
            found.add(i)
            value = self.replacements[i]
            # A term that opened the sentence opens the translation too.
            if m.start() == 0 and value[:1].islower():
                value = value[:1].upper() + value[1:]
            return value

        out = _PLACEHOLDER_RE.sub(sub, translated)
        return out, len(self.replacements) - len(found)


class Glossary:
    def __init__(self, terms: list[GlossaryTerm] | tuple[GlossaryTerm, ...] = ()) -> None:
        # Longest first, so "machine translation" wins over "machine".
        self.terms = tuple(sorted(terms, key=lambda t: len(t.term), reverse=True))
        self._patterns = [
            re.compile(r"(?<!\w)" + re.escape(t.term) + r"(?!\w)",
                       0 if t.case_sensitive else re.IGNORECASE)
            for t in self.terms
        ]

    def __bool__(self) -> bool:
        return bool(self.terms)

    def matches(self, text: str, lang: str) -> list[tuple[GlossaryTerm, str]]:
        """Terms of `text` that have a target text in `lang`: [(term, target text)]."""
        out: list[tuple[GlossaryTerm, str]] = []
        for term, pattern in zip(self.terms, self._patterns, strict=True):
            target = term.target_text(lang)
            if target is not None and pattern.search(text):
                out.append((term, target))
        return out

    def protect(self, text: str, lang: str) -> Protected:
        replacements: list[str] = []
        for term, pattern in zip(self.terms, self._patterns, strict=True):
            target = term.target_text(lang)
            if target is None:
                continue

            def sub(_m: re.Match[str], target: str = target) -> str:
                replacements.append(target)
                return _PLACEHOLDER.format(len(replacements) - 1)

            text = pattern.sub(sub, text)
        return Protected(text, tuple(replacements))

    def prompt_lines(self, text: str, lang: str) -> list[str]:
        """Glossary instructions for an LLM, only for the terms this sentence contains."""
        lines: list[str] = []
        for term, target in self.matches(text, lang):
            if target == term.term:
                lines.append(f'- "{term.term}": keep as is, do not translate')
            else:
                lines.append(f'- "{term.term}": translate as "{target}"')
        return lines

