"""Break caption text into display lines, following subtitle norms.

Lines are at most `width` characters; the display shows the last `max_lines`
lines (captions scroll up). Among the possible break points of a line the
breaker prefers one after punctuation and avoids one that leaves a "weak" word
(article, preposition, conjunction, possessive) at the end of the line, so
"the | house" becomes "| the house" when a break nearly as long exists.
"""

from __future__ import annotations

from dataclasses import dataclass

_WEAK = {
    "en": {
        "a", "an", "the", "of", "to", "in", "on", "at", "by", "for", "with", "from", "and",
        "or", "but", "nor", "as", "if", "that", "my", "your", "his", "her", "its", "our",
        "their", "this", "these", "those", "mr.", "mrs.", "ms.", "dr.", "not", "very",
    },
    "fr": {
        "le", "la", "les", "l'", "un", "une", "des", "du", "de", "d'", "au", "aux", "à", "a",
        "et", "ou", "mais", "que", "qu'", "qui", "en", "dans", "sur", "par", "pour", "avec",
        "sans", "ce", "cet", "cette", "ces", "mon", "ma", "mes", "ton", "ta", "tes", "son",
        "sa", "ses", "notre", "votre", "leur", "leurs", "ne", "se", "je", "tu", "il", "elle",
        "nous", "vous", "ils", "elles", "m.", "mme",
    },
}
_PUNCT_END = (",", ";", ":", ".", "!", "?", "…", "—")


@dataclass(frozen=True, slots=True)
class LineProfile:
    name: str
    width: int
    max_lines: int
    max_cps: float | None = None


WEB = LineProfile("web", 42, 2, 17.0)
CEA608 = LineProfile("cea608", 32, 2)


def _weak(word: str, lang: str) -> bool:
    words = _WEAK.get(lang.split("-")[0], _WEAK["en"])
    return word.lower() in words


def wrap(text: str, width: int = 42, lang: str = "en") -> list[str]:
    """All lines of `text`, each ≤ width (a single longer word is cut)."""
    words = text.split()
    lines: list[str] = []
    i = 0
    while i < len(words):
        # Candidate ends j (exclusive): words[i:j] fits on one line.
        length = 0
        candidates: list[int] = []
        for j in range(i, len(words)):
            length += len(words[j]) + (1 if j > i else 0)
            if length > width:
                break
            candidates.append(j + 1)
        if not candidates:  # one word longer than a line
            word = words[i]
            lines.append(word[:width])
            rest = word[width:]
            if rest:
                words[i] = rest
            else:
                i += 1
            continue
        if candidates[-1] == len(words):
            lines.append(" ".join(words[i:]))
            break
        best = candidates[-1]
        best_score = float("-inf")
        full = len(" ".join(words[i : candidates[-1]]))
        for j in candidates:
            line_len = len(" ".join(words[i:j]))
            if line_len < 0.6 * full:
                continue
            last = words[j - 1]
            score = line_len / width
            if last.endswith(_PUNCT_END):
                score += 0.5
            if _weak(last, lang):
                score -= 1.0
            if score > best_score:
                best, best_score = j, score
        lines.append(" ".join(words[i:best]))
        i = best
    return lines


def break_lines(text: str, profile: LineProfile = WEB, lang: str = "en") -> tuple[str, ...]:
    """The lines a display shows: the last `max_lines` lines of the wrapped text."""
    lines = wrap(text, profile.width, lang)
    return tuple(lines[-profile.max_lines :])
