"""docs/configuration.md is the event schema rendered (orchestrator/config_doc.py).

The page lists every key of the models `parse_event` validates, with type, default, example
and description; it fails here when a model changes and the page was not rendered again
(the negative controls change a model on purpose). Each example is written into a real
event file and must validate, and so must the event files the README and the page show.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field, create_model

from orchestrator import config_doc
from orchestrator.config import (
    ConfigError,
    EngineConfig,
    EventConfig,
    SessionConfig,
    parse_event,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_page_is_the_schema_rendered() -> None:
    assert config_doc.check(), ("docs/configuration.md differs from the event schema: run "
                                "python -m orchestrator.config_doc")


def _schema_keys(schema: dict[str, Any], node: dict[str, Any], prefix: str) -> list[str]:
    """Every key path in pydantic's JSON schema: a second reading of the models, apart from
    the generator's own walk."""
    def resolve(n: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in n:
            return resolve(schema["$defs"][n["$ref"].rsplit("/", 1)[-1]])
        options = [o for o in n.get("anyOf", []) if o.get("type") != "null"]
        return resolve(options[0]) if len(options) == 1 else n

    out = []
    for name, prop in resolve(node).get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        out.append(path)
        sub = resolve(prop)
        if "properties" in sub:
            out += _schema_keys(schema, sub, path)
        elif sub.get("type") == "array" and "properties" in resolve(sub.get("items", {})):
            out += _schema_keys(schema, resolve(sub["items"]), path + "[]")
    return out


def test_every_key_of_the_schema_has_a_row_on_the_page() -> None:
    schema = EventConfig.model_json_schema()
    expected = _schema_keys(schema, schema, "")
    assert [k.path for k in config_doc.keys()] == expected
    page = config_doc.PAGE.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### `?([^`\n]+)`?\n(.*?)(?=^##|\Z)", page, re.S | re.M))
    for path in expected:
        parent, _, name = path.rpartition(".")
        table = sections[parent or "Top level"]
        assert f"| `{name}` |" in table, f"{path} has no row under its section"


# ---- negative controls: the check fails when a model changes ----------------------------

def _with_session(session: type[BaseModel]) -> type[BaseModel]:
    """EventConfig whose engine.session is `session`, every description kept."""
    def like(model: type[BaseModel], name: str, new: type[BaseModel]) -> type[BaseModel]:
        field: Any = (new, Field(default_factory=new,
                                 description=model.model_fields[name].description))
        return create_model(model.__name__, __base__=model, __doc__=model.__doc__,
                            **{name: field})
    return like(EventConfig, "engine", like(EngineConfig, "session", session))


def _session(**fields: Any) -> type[BaseModel]:
    return create_model("SessionConfig", __base__=SessionConfig,
                        __doc__=SessionConfig.__doc__, **fields)


def test_an_added_field_in_a_section_makes_the_check_fail() -> None:
    added = _session(warmup_s=(
        float, Field(default=2.0, gt=0, description="seconds before the first caption")))
    assert config_doc.check(_with_session(SessionConfig))  # the control: same schema
    assert not config_doc.check(_with_session(added))
    assert "| `warmup_s` | number; > 0 | `2.0` |" in config_doc.reference(_with_session(added))


def test_a_renamed_field_or_a_changed_description_makes_the_check_fail() -> None:
    fields: dict[str, Any] = {
        ("margin_secs" if n == "margin_s" else n): (f.annotation, f)
        for n, f in SessionConfig.model_fields.items()}
    renamed = create_model("SessionConfig", __doc__=SessionConfig.__doc__, **fields)
    assert not config_doc.check(_with_session(renamed))
    assert "| `margin_secs` |" in config_doc.reference(_with_session(renamed))
    reworded = _session(margin_s=(
        float, Field(default=30.0, gt=0, description="something else")))
    assert not config_doc.check(_with_session(reworded))


def test_a_key_without_an_example_or_a_description_stops_the_generator() -> None:
    for extra in ((str | None, Field(default=None, description="a new secret's variable")),
                  (float, Field(default=1.0))):
        model = _session(new_key=extra)
        with pytest.raises(ValueError, match=re.escape("engine.session.new_key")):
            config_doc.reference(_with_session(model))


def test_the_command_writes_the_reference_and_its_check_fails_on_a_stale_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# hand-written\n\n{config_doc.START}\n{config_doc.END}\n\nmore prose\n")
    monkeypatch.setattr(config_doc, "PAGE", page)
    assert config_doc.main(["--check"]) == 1  # the reference is not there yet
    assert config_doc.main([]) == 0
    assert config_doc.main(["--check"]) == 0
    text = page.read_text()
    assert text.startswith("# hand-written\n") and text.endswith("\n\nmore prose\n")
    page.write_text(text.replace("| `margin_s` |", "| `margin` |"))
    assert config_doc.main(["--check"]) == 1
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        config_doc.main(["--check"])


# ---- the examples are real ---------------------------------------------------------------

BASE = {"event": "example", "streams": [{"id": "hall-a", "source": "push", "language": "en"}]}
AUTH = {"admin_token_env": "ADMIN", "signing_key_env": "SIGNING",
        "publish_token_env": {"hall-a": "PUBLISH"}}


def _context(path: str) -> dict[str, Any]:
    """What a key's example needs beside it to make a valid file (rules across keys)."""
    if path == "ray.address":
        return {"redis": {"url": "redis://10.0.0.5:6379/0"}}
    if path.startswith("engine.vllm"):
        return {"engine": {"kind": "vllm"}}
    if path in {f"engine.{k}" for k in ("url", "delay_s", "token_env", "max_session_s",
                                        "text_lag_s")}:
        return {"engine": {"kind": "realtime-ws", "url": "ws://asr-host:8000/v1/realtime"}}
    if path.startswith("streams[].tls"):
        return {"streams": [{"source": "rtmps://0.0.0.0:1936/live", "key_env": "KEY", "tls": {
            "cert": "certs/fullchain.pem", "key": "certs/privkey.pem"}}]}
    if path == "streams[].hls_start_segments":
        return {"streams": [{"source": "https://cdn.example/hall-a/index.m3u8"}]}
    if path.startswith(("streams[].source", "streams[].key_env")):
        return {"streams": [{"source": "rtmp://0.0.0.0:1935/live", "key_env": "KEY"}]}
    if path.startswith("auth"):
        return {"auth": AUTH}
    if path.startswith("glossary"):
        return {"glossary": [{"term": "keynote", "keep": True}]}
    if path.startswith("outputs.youtube"):
        return {"outputs": {"youtube": [{"stream": "hall-a", "lang": "en", "url_env": "YT"}]}}
    if path.startswith("translation.openai") or path == "translation.routes":
        return {"translation": {"openai": {"url": "http://mt:8000/v1", "model": "m"}}}
    if path.startswith("translation.vllm"):
        return {"translation": {"vllm": {"model": "m"}}}
    return {}


def _merge(into: Any, new: Any) -> Any:
    if isinstance(into, dict) and isinstance(new, dict):
        return {**into, **{k: _merge(into.get(k), v) for k, v in new.items()}}
    if isinstance(into, list) and isinstance(new, list) and into and new:
        return [_merge(into[0], new[0]), *into[1:]]
    return copy.deepcopy(new)


def test_every_example_on_the_page_validates_in_an_event_file(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    for name in ("fullchain.pem", "privkey.pem"):
        (tmp_path / "certs" / name).write_text("not read at validation\n")
    refused, checked = [], 0
    for key in config_doc.keys():
        if key.section:
            continue
        doc = _merge(_merge(BASE, _context(key.path)), config_doc.nested(key.path, key.example))
        try:
            parse_event(yaml.safe_dump(doc, allow_unicode=True), filename=f"<{key.path}>",
                        base_dir=tmp_path)
        except ConfigError as e:
            refused.append(str(e))
        checked += 1
    assert not refused, "\n".join(refused)
    assert checked > 100



def _yaml_under(page: Path, heading: str) -> str:
    part = page.read_text(encoding="utf-8").split(heading, 1)
    assert len(part) == 2, f"{page.name}: no heading {heading!r}"
    block = re.search(r"```yaml\n(.*?)```", part[1], re.S)
    assert block, f"{page.name}: no yaml block under {heading!r}"
    return block.group(1)


def test_the_fuller_event_file_on_the_page_validates() -> None:
    text = _yaml_under(config_doc.PAGE, "## A fuller event file")
    config = parse_event(text, filename="configuration.md", base_dir=ROOT)
    assert config.auth is not None and config.outputs.youtube


def test_the_readme_smallest_real_event_validates() -> None:
    text = _yaml_under(ROOT / "README.md", "## The smallest real event")
    config = parse_event(text, filename="README.md", base_dir=ROOT)
    stream = config.streams[0]
    assert config.auth is not None and stream.key_env and stream.targets == ["fr"]
    assert config.gateway.host == "0.0.0.0"  # tokens are needed: the file must have them
