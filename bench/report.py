"""Shared output of the benchmarks: one JSON object, or aligned key: value lines."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
