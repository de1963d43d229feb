"""YAML alias bombs in event files (issue 36): refused before anything expands them, with
the file, line and key; anchors and merge keys used for shared defaults still work.
`POST /v1/admin/apply` runs the same parser (tests/test_hostile_clients.py sends it one)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import yaml_bounds
from orchestrator.config import ConfigError, parse_event

pytestmark = pytest.mark.unit

HEAD = "event: x\nstreams: [{id: a, source: push, language: en}]\n"


def bomb(levels: int = 8, fan: int = 9) -> str:
    text = HEAD + 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for name in "bcdefghijklmnop"[: levels - 1]:
        text += f"{name}: &{name} [{','.join([f'*{prev}'] * fan)}]\n"
        prev = name
    return text


def refusal(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_event(text, filename="event.yaml")
    assert len(info.value.errors) == 1, info.value.errors
    return str(info.value.errors[0])


def test_a_400_byte_alias_bomb_is_refused_at_once_with_its_line() -> None:
    text = bomb()
    assert len(text) <= 400
    t0 = time.perf_counter()
    message = refusal(text)
    took = time.perf_counter() - t0
    assert took < 1.0, f"{took:.2f} s"
    assert message.startswith("event.yaml:"), message
    line = int(message.split(":")[1])
    assert "*" in text.splitlines()[line - 1]  # the line of an alias
    assert "alias bomb" in message


def test_babelcast_validate_refuses_the_bomb_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(f"{path}:") and "alias" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_merge_keys_for_shared_defaults_still_validate() -> None:
    streams = "\n".join(f"  - {{<<: *room, id: r{i}}}" for i in range(299))
    text = ("event: x\nengine: {actors: 10, streams_per_actor: 30}\nstreams:\n"
            "  - &room {id: r, source: push, language: en}\n" + streams + "\n")
    cfg = parse_event(text)  # 299 aliases, each overriding a merged key
    assert len(cfg.streams) == 300


def test_the_bound_is_where_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine levels of nine expand to ~4.3e8 values: refused. The same shape small
    enough to stay under the bound is read (and fails validation on its own terms)."""
    small = bomb(levels=4, fan=4)  # 9 * 4**3 = 576 values
    monkeypatch.setattr(yaml_bounds, "MAX_NODES", 1_000)
    with pytest.raises(ConfigError) as info:
        parse_event(small, filename="event.yaml")
    assert all("unknown key" in str(i) for i in info.value.errors)
    monkeypatch.setattr(yaml_bounds, "MAX_NODES", 500)
    assert "past 500 values" in refusal(small)


def test_a_recursive_alias_and_deep_nesting_are_refused() -> None:
    assert "recursive alias" in refusal(HEAD + "a: &a [1, *a]\n")
    deep = refusal("[" * 10_000)
    assert "nested deeper than 64 levels" in deep and "RecursionError" not in deep


def test_too_many_aliases_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yaml_bounds, "MAX_ALIASES", 3)
    text = HEAD + "a: &a 1\nb: [*a, *a, *a, *a]\n"
    message = refusal(text)
    assert "more than 3 YAML aliases" in message and message.startswith("event.yaml:4: b[3]")
