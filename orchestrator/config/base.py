"""What every section of the event file shares: strict models, and errors that name the key."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

Loc = tuple[str | int, ...]

_LANG = re.compile(r"^[a-z]{2}$")


def _fail(message: str) -> PydanticCustomError:
    # A custom error keeps the operator's message verbatim; a ValueError would be prefixed
    # with "Value error, ". The message goes through the context so braces are not templates.
    return PydanticCustomError("babelcast_config", "{reason}", {"reason": message})


def _raise_at(title: str, problems: list[tuple[Loc, str, object]]) -> None:
    # A ValidationError raised inside a validator keeps its own locations (prefixed by the
    # caller's), which lets a model-level rule point at the exact key that is wrong.
    if problems:
        details = [InitErrorDetails(type=_fail(msg), loc=loc, input=value)
                   for loc, msg, value in problems]
        raise ValidationError.from_exception_data(title, details)


def _check_lang(value: object, allow_auto: bool) -> str:
    if isinstance(value, bool):
        # YAML 1.1 reads an unquoted `no` (Norwegian) as false.
        raise _fail("got a YAML boolean; quote language codes, e.g. 'no'")
    if not isinstance(value, str) or not (_LANG.match(value) or (allow_auto and value == "auto")):
        expected = "'auto' or a" if allow_auto else "a"
        raise _fail(f"expected {expected} 2-letter ISO-639-1 code such as 'en', got {value!r}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
