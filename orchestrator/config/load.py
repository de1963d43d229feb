"""Event YAML → `EventConfig`, every problem a `ConfigIssue` naming file, line and key.

YAML syntax, unknown keys, bad values and cross-field rules all become a `ConfigError`
whose issues an operator can fix without reading a traceback.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from orchestrator import yaml_bounds
from orchestrator.config.base import Loc
from orchestrator.config.event import EventConfig


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    file: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}"


class ConfigError(Exception):
    def __init__(self, errors: list[ConfigIssue]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def _index_lines(node: yaml.Node, path: Loc, lines: dict[Loc, int],
                 dups: list[tuple[Loc, int]]) -> None:
    """Map key paths to 1-based lines: the key node for mapping keys, the item for lists."""
    if len(path) > 64:  # a recursive alias (`&a [*a]`) would otherwise never end
        return
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            sub = (*path, key_node.value)
            if sub in lines and key_node.value != "<<":
                dups.append((sub, key_node.start_mark.line + 1))
            lines[sub] = key_node.start_mark.line + 1  # the last duplicate is the one kept
            _index_lines(value_node, sub, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _index_lines(item, (*path, i), lines, dups)


def _display_key(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out or "<top level>"


def _line_for(loc: Loc, lines: dict[Loc, int]) -> int | None:
    # A missing key has no line of its own: point at the nearest parent that exists.
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc)


def _allowed_keys(parent: Loc) -> list[str]:
    """Keys the model at `parent` accepts, found by walking the field annotations."""
    model: type[BaseModel] | None = EventConfig
    for part in parent:
        if isinstance(part, str) and model is not None:
            field = model.model_fields.get(part)
            hints = (field.annotation, *typing.get_args(field.annotation)) if field else ()
            model = next((h for h in hints if isinstance(h, type) and issubclass(h, BaseModel)),
                         None)
    return list(model.model_fields) if model else []


def _message(err: Any) -> str:
    loc: Loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"unknown key {loc[-1]!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if err["type"] == "missing":
        return "required key is missing"
    return str(err["msg"])


def parse_event(text: str, *, filename: str = "<string>",
                base_dir: Path | None = None) -> EventConfig:
    """Parse and validate event YAML; relative file sources resolve against `base_dir`."""
    loader: yaml.SafeLoader | None = None
    try:
        # The constructor already reads: a control character fails here (found by fuzzing).
        # Composed under a budget of aliases and expanded size before anything walks it.
        root, loader = yaml_bounds.compose(text)
        lines: dict[Loc, int] = {}
        dups: list[tuple[Loc, int]] = []
        if root is not None:
            # Before construction: merge keys (`<<: *defaults`) rewrite the nodes in place,
            # after which a merged key and its override read as a duplicate.
            lines[()] = root.start_mark.line + 1
            _index_lines(root, (), lines, dups)
        data = loader.construct_document(root) if root is not None else None
    except yaml_bounds.AliasRefused as e:
        raise ConfigError([ConfigIssue(filename, e.line, _display_key(e.path) if e.path
                                       else "<yaml>", e.message)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        parts = (getattr(e, "context", None), getattr(e, "problem", None))
        problem = "; ".join(p for p in parts if p) or str(e)
        raise ConfigError([ConfigIssue(filename, line, "<yaml>", problem)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if root is None:
        raise ConfigError([ConfigIssue(filename, None, "<top level>", "file is empty; expected "
                                       "a mapping with at least 'event' and 'streams'")])
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError([ConfigIssue(filename, root.start_mark.line + 1, "<top level>",
                                       f"expected a mapping of keys, got a {kind}")])
    # YAML silently keeps the last of two equal keys; an operator almost never means that.
    issues = [ConfigIssue(filename, ln, _display_key(loc), "duplicate key; the earlier one "
                          "would be ignored") for loc, ln in dups]
    try:
        config = EventConfig.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as e:
        issues += [ConfigIssue(filename, _line_for(tuple(err["loc"]), lines),
                               _display_key(tuple(err["loc"])), _message(err))
                   for err in e.errors(include_url=False)]
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: (i.line or 0, i.key)))
    return config


def load_event(path: str | os.PathLike[str]) -> EventConfig:
    """Read and validate an event YAML file; raises ConfigError with file:line: key: message."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([ConfigIssue(str(p), None, "<file>", f"cannot read: {e}")]) from None
    return parse_event(text, filename=str(p), base_dir=p.parent.resolve())
