"""Break caption text into display lines, following subtitle norms.

Lines are at most `width` characters; the display shows the last `max_lines`
lines (captions scroll up). Among the possible break points of a line the
breaker prefers one after punctuation and avoids one that leaves a "weak" word
(article, preposition, conjunction, possessive, subject pronoun, auxiliary) at
the end of the line, so "the | house" becomes "| the house" when a break nearly
as long exists. Punctuation that French sets off with a space ("Vraiment ?",
« guillemets ») stays with its word, so no line starts with "?" or ends with "«".

Each output has its own profile (`PROFILES`, `get_profile`): `web` for overlays
and players, `cea608` for 608-style 32-column outputs, `youtube` for YouTube
Live caption ingestion. Archives and sinks that must show a whole text use
`pages`, which cuts it into screens of at most `max_lines` lines.
"""

from __future__ import annotations

from dataclasses import dataclass

_WEAK = {
    "en": {
        # articles, determiners, possessives
        "a", "an", "the", "this", "these", "those", "my", "your", "his", "her", "its", "our",
        "their", "no", "every", "each",
        # prepositions
        "of", "to", "in", "on", "at", "by", "for", "with", "from", "into", "onto", "upon",
        "about", "than", "via",
        # conjunctions and relatives
        "and", "or", "but", "nor", "as", "if", "that", "because", "while", "although",
        "whether", "who", "whose", "which",
        # subject pronouns and auxiliaries: keep them with their verb
        "i", "we", "they", "he", "she", "will", "would", "can", "could", "should", "shall",
        "must", "might", "not", "very",
        # titles: keep them with the name
        "mr.", "mrs.", "ms.", "dr.", "prof.", "st.",
    },
    "fr": {
        # articles, déterminants, possessifs
        "le", "la", "les", "l'", "un", "une", "des", "du", "de", "d'", "au", "aux", "ce", "cet",
        "cette", "ces", "mon", "ma", "mes", "ton", "ta", "tes", "son", "sa", "ses", "notre",
        "nos", "votre", "vos", "leur", "leurs", "chaque", "quelques",
        # prépositions
        "à", "a", "en", "dans", "sur", "sous", "par", "pour", "avec", "sans", "chez", "vers",
        "entre", "selon", "depuis", "pendant", "contre",
        # conjonctions et relatifs
        "et", "ou", "mais", "que", "qu'", "qui", "dont", "où", "si", "comme", "quand",
        "lorsque", "puisque", "car",
        # pronoms sujets et clitiques: gardés avec leur verbe
        "ne", "n'", "se", "s'", "je", "j'", "tu", "il", "elle", "on", "nous", "vous", "ils",
        "elles", "y", "me", "m'", "te", "t'", "lui",
        # titres
        "m.", "mme", "mlle", "dr", "pr",
    },
}
_PUNCT_END = (",", ";", ":", ".", "!", "?", "…", "—")
# A token made only of these belongs to the word before it ("Vraiment ?", "50 %", "»").
_GLUE_BACK = frozenset("?!:;%»…")
# And this one to the word after it ("« Bonjour").
_GLUE_FORWARD = frozenset("«")


@dataclass(frozen=True, slots=True)
class LineProfile:
    """How one output lays captions out: `width` characters × `max_lines` lines.

    `max_cps` is a reading-speed hint (characters per second) for outputs that
    choose how long a cue stays up; None: no hint.
    """

    name: str
    width: int
    max_lines: int
    max_cps: float | None = None


WEB = LineProfile("web", 42, 2, 17.0)
CEA608 = LineProfile("cea608", 32, 2)
# YouTube re-wraps ingested caption lines that are wider than its caption box, which is
# narrow on phones; 32 columns (the 608 width YouTube's own renderer was built for) keeps
# our line breaks intact there.
YOUTUBE = LineProfile("youtube", 32, 2, 17.0)

PROFILES: dict[str, LineProfile] = {p.name: p for p in (WEB, CEA608, YOUTUBE)}


def get_profile(name: str) -> LineProfile:
    """The profile called `name`; a ValueError that lists the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown line-breaking profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def _weak(word: str, lang: str) -> bool:
    words = _WEAK.get(lang.split("-")[0].lower(), _WEAK["en"])
    return word.lower() in words


def _units(text: str, width: int) -> list[str]:
    """Words, with spaced punctuation glued to its word (when the pair fits a line)."""
    units: list[str] = []
    glue_next = False
    for token in text.split():
        if glue_next and len(units[-1]) + 1 + len(token) <= width:
            units[-1] = f"{units[-1]} {token}"
        elif (units and set(token) <= _GLUE_BACK
              and len(units[-1]) + 1 + len(token) <= width):
            units[-1] = f"{units[-1]} {token}"
        else:
            units.append(token)
        glue_next = set(token) <= _GLUE_FORWARD
    return units


def _last_word(unit: str) -> str:
    return unit.rsplit(" ", 1)[-1]


def wrap(text: str, width: int = 42, lang: str = "en") -> list[str]:
    """All lines of `text`, each ≤ width (a single longer word is cut)."""
    words = _units(text, width)
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
            last = _last_word(words[j - 1])
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


def pages(text: str, profile: LineProfile = WEB, lang: str = "en") -> list[tuple[str, ...]]:
    """All of `text` as successive screens of at most `max_lines` lines each, for
    outputs that show every word once (archives, HLS, YouTube) instead of scrolling."""
    lines = wrap(text, profile.width, lang)
    n = profile.max_lines
    return [tuple(lines[k : k + n]) for k in range(0, len(lines), n)]


def rules() -> dict[str, object]:
    """The breaking rules as plain data, for the browser overlay's copy of `wrap`."""
    return {
        "weak": {lang: sorted(words) for lang, words in _WEAK.items()},
        "punctEnd": list(_PUNCT_END),
        "glueBack": "".join(sorted(_GLUE_BACK)),
        "glueForward": "".join(sorted(_GLUE_FORWARD)),
    }
