"""The key reference in docs/configuration.md, generated from the event schema
(`orchestrator.config.EventConfig`, the root model `parse_event` validates).

    python -m orchestrator.config_doc            # rewrite the reference between the markers
    python -m orchestrator.config_doc --check    # exit 1 when the page and the schema differ

The reference lists every key of an event file in the order the models declare them, with
its type and bounds, default, an example value and the field's own description; the prose
around the markers is written by hand. The example is the field's `examples[0]` where the
model gives one, else the entry in SAMPLES below, else the default. A key whose default
shows nothing (required, null, empty) and that has no example stops the generator, as does
a field without a description: a new key cannot reach the page without both.
tests/test_config_doc.py fails when the page and the schema disagree.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.config import EventConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
COMMAND = "python -m orchestrator.config_doc"

# Examples for keys whose default shows nothing, taken from the README and examples/.
SAMPLES: dict[str, Any] = {
    "event": "My conference",
    "redis.url": "redis://10.0.0.5:6379/0",
    "redis.data_dir": "/var/lib/babelcast/redis",
    "ray.address": "auto",
    "ray.num_cpus": 8,
    "engine.url": "ws://asr-host:8000/v1/realtime",
    "engine.token_env": "ASR_PUBLISH_TOKEN",
    "engine.max_session_s": 3600,
    "engine.session.budget_s": 600,
    "engine.session.shed_after_s": 20,
    "engine.vllm.max_num_batched_tokens": 16384,
    "engine.vllm.rollover_headroom": 2,
    "streams[].id": "hall-a",
    "streams[].name": "Hall A",
    "streams[].source": "rtmp://0.0.0.0:1935/live",
    "streams[].targets": ["fr", "pt"],
    "streams[].key_env": "HALL_A_KEY",
    "streams[].tls.cert": "certs/fullchain.pem",
    "streams[].tls.key": "certs/privkey.pem",
    "gateway.allowed_origins": ["https://player.example.org"],
    "gateway.limits.trusted_proxies": ["10.0.0.0/24"],
    "auth.admin_token_env": "BABELCAST_ADMIN_TOKEN",
    "auth.scrape_token_env": "BABELCAST_SCRAPE_TOKEN",
    "auth.publish_token_env": {"hall-a": "HALL_A_PUBLISH_TOKEN"},
    "auth.signing_key_env": "BABELCAST_SIGNING_KEY",
    "translation.routes": {"*-de": "openai-chat", "en-pt": "bergamot"},
    "translation.partials_every_s": 2,
    "translation.openai.url": "http://mt-gpu:8000/v1",
    "translation.openai.model": "Qwen/Qwen2.5-7B-Instruct",
    "translation.openai.api_key_env": "MT_KEY",
    "translation.vllm.model": "Qwen/Qwen2.5-7B-Instruct",
    "glossary[].term": "keynote",
    "glossary[].keep": True,
    "glossary[].translations": {"fr": "plénière", "es": "ponencia principal"},
    "outputs.youtube[].stream": "hall-a",
    "outputs.youtube[].lang": "en",
    "outputs.youtube[].url_env": "YT_HALL_A_CAPTIONS",
}

START = (f"<!-- config-reference:start (`{COMMAND}` writes this from the event schema, "
         "root model orchestrator.config.EventConfig; do not edit) -->")
END = "<!-- config-reference:end -->"


@dataclass(frozen=True)
class Key:
    path: str  # "engine.vllm.max_model_len", "streams[].id"
    field: FieldInfo
    section: tuple[str, type[BaseModel]] | None  # the section this key opens, if any

    @property
    def example(self) -> Any:
        if self.field.examples:
            return self.field.examples[0]
        if self.path in SAMPLES:
            return SAMPLES[self.path]
        return default_of(self.field)


def default_of(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def _model_in(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """(model, "" or "[]") when `annotation` is a section: a model, optional or in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        inner = _model_in(args[0])
        return (inner[0], "[]") if inner and not inner[1] else None
    if origin in (typing.Union, types.UnionType):
        found = [m for a in args if a is not type(None) and (m := _model_in(a))]
        return found[0] if len(found) == 1 else None
    return None


def keys(root: type[BaseModel] = EventConfig, prefix: str = "") -> Iterator[Key]:
    """Every key under `root`, depth first in declaration order; sections before their keys."""
    for name, field in root.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        section = _model_in(field.annotation)
        opened = (path + section[1], section[0]) if section else None
        yield Key(path, field, opened)
        if opened:
            yield from keys(opened[1], opened[0])


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    raise ValueError(f"no name for the type {annotation!r}; teach config_doc.type_name")


def bounds(field: FieldInfo) -> str:
    marks = {at.Ge: "≥", at.Gt: ">", at.Le: "≤", at.Lt: "<"}
    out = []
    for m in field.metadata:
        for kind, sign in marks.items():
            if isinstance(m, kind):
                out.append(f"{sign} {getattr(m, kind.__name__.lower())}")
        if isinstance(m, at.MinLen):
            out.append(f"length ≥ {m.min_length}")
        if isinstance(m, at.MaxLen):
            out.append(f"length ≤ {m.max_length}")
    return ", ".join(out)


def value(v: Any, top_level: bool = False) -> str:
    """A value as it would be written in the event file (YAML flow style)."""
    if v is PydanticUndefined:
        return "required"
    if isinstance(v, BaseModel):
        return "all defaults"
    text = yaml.safe_dump(v, default_flow_style=True, allow_unicode=True, width=1_000)
    text = text.removesuffix("\n...\n").strip()
    if top_level and text.startswith("{"):
        text = text[1:-1]  # `engine: {actors: 2}`, as the line is written in a file
    return f"`{text}`"


def nested(path: str, v: Any) -> Any:
    """`v` placed at `path` in an event file: `streams[].id` -> {"streams": [{"id": v}]}."""
    for part in reversed(path.split(".")):
        v = {part.removesuffix("[]"): [v] if part.endswith("[]") else v}
    return v


def _shows_nothing(v: Any) -> bool:
    return v is PydanticUndefined or v is None or v in ("", [], {})


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(key: Key) -> str:
    name = key.path.rsplit(".", 1)[-1]
    field = key.field
    if not field.description:
        raise ValueError(f"{key.path}: the field has no description; give it one")
    default = default_of(field)
    if key.section:
        kind = "list of sections" if key.section[0].endswith("[]") else "section"
        title = key.section[0]
        return (f"| `{name}` | {kind}, see [`{title}`](#{anchor(title)}) | "
                f"{value(default)} | see below | {_cell(field.description)} |")
    if _shows_nothing(key.example):
        raise ValueError(f"{key.path}: no example (its default shows nothing); give the "
                         "Field examples=[...] or add it to config_doc.SAMPLES")
    kind = type_name(field.annotation)
    if b := bounds(field):
        kind += f"; {b}"
    return (f"| `{name}` | {_cell(kind)} | {value(default)} "
            f"| {value(nested(key.path, key.example), top_level=True)} "
            f"| {_cell(field.description)} |")


HEADER = "| key | type | default | example | description |\n|---|---|---|---|---|"


def reference(root: type[BaseModel] = EventConfig) -> str:
    """The reference: one heading and table per section, sections in declaration order."""
    sections: dict[str, tuple[type[BaseModel], list[Key]]] = {"": (root, [])}
    for key in keys(root):
        parent = key.path.rsplit(".", 1)[0] if "." in key.path else ""
        sections[parent][1].append(key)
        if key.section:
            sections[key.section[0]] = (key.section[1], [])
    out = []
    for path, (model, rows) in sections.items():
        out.append(f"### `{path}`\n" if path else "### Top level\n")
        doc = model.__doc__ if path else None
        if doc and doc is not BaseModel.__doc__:
            out.append(" ".join(doc.split()) + "\n")
        out.append(HEADER + "\n" + "\n".join(row(k) for k in rows) + "\n")
    return "\n".join(out)


def rendered(text: str, root: type[BaseModel] = EventConfig) -> str:
    """`text` with the reference between its markers made again from the schema."""
    if START not in text or END not in text:
        raise ValueError(f"no config-reference markers; the page needs {START} and {END}")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{START}\n\n{reference(root)}\n{END}{tail}"


def check(root: type[BaseModel] = EventConfig, page: Path | None = None) -> bool:
    """True when `page` (default: docs/configuration.md) holds what the schema renders."""
    text = (page or PAGE).read_text(encoding="utf-8")
    return rendered(text, root) == text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the page differs from the schema; write nothing")
    a = ap.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    if a.check:
        if rendered(text) == text:
            return 0
        print(f"{PAGE.name} differs from the event schema: run `{COMMAND}` and commit the "
              "page", file=sys.stderr)
        return 1
    PAGE.write_text(rendered(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
