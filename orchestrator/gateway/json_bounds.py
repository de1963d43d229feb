"""JSON from clients, parsed only when it is shallow.

Python's `json` recurses once per nesting level: 3 KB of `[` raised RecursionError in the
realtime handler (the socket dropped with 1006 and ~65 traceback lines went to the log
each time). Every socket and body that takes JSON from a client checks the nesting first:
`[`/`{` counted outside strings, refused past `MAX_JSON_DEPTH`. No client event needs more
than a few levels.

The count costs two `str.count` calls on the common message (a realtime append is 87 KB of
base64 with no bracket in it); only a message with more brackets than the bound is scanned
token by token, with one regular expression that steps over strings whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 32
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class JsonTooDeep(ValueError):
    """Nested deeper than the bound; the message says the bound, never the content."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels")
        self.limit = limit


def nesting_over(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects in `text` nest deeper than `limit` (strings are skipped;
    an unterminated string counts its brackets, which can only refuse invalid JSON)."""
    if isinstance(text, bytes):
        if text.count(b"[") + text.count(b"{") <= limit:
            return False
        # Brackets, quotes and backslashes are ASCII; UTF-8's other bytes map to
        # characters that match none of them.
        text = text.decode("latin-1")
    elif text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for m in _TOKENS.finditer(text):
        first = text[m.start()]
        if first in "[{":
            depth += 1
            if depth > limit:
                return True
        elif first in "]}":
            depth -= 1
    return False


def loads(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads`, refusing nesting past `limit` with JsonTooDeep (a ValueError)."""
    if nesting_over(text, limit):
        raise JsonTooDeep(limit)
    return json.loads(text)
