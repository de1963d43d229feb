"""Every alert rule has a runbook entry in docs/operations.md, and every entry a rule.

An entry is a `### AlertName` heading under "## Alerts: the runbook" with the four parts an
operator reads at night: what fires it, what it means, what to check, what to do. The
negative controls add a rule and strip a part, and the check must say so.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "babelcast.rules.yml"
PAGE = ROOT / "docs" / "operations.md"
PARTS = ("**Fires**", "**Means**", "**Check**", "**Do**")


def alerts(rules_text: str) -> list[str]:
    doc = yaml.safe_load(rules_text)
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def entries(page_text: str) -> dict[str, str]:
    runbook = page_text.split("## Alerts: the runbook", 1)[1]
    runbook = re.split(r"^## ", runbook, flags=re.M)[0]
    return dict(re.findall(r"^### `?(\w+)`?\n(.*?)(?=^### |\Z)", runbook, re.S | re.M))


def problems(rules_text: str, page_text: str) -> list[str]:
    names, book = alerts(rules_text), entries(page_text)
    out = [f"{n}: no runbook entry in docs/operations.md" for n in names if n not in book]
    out += [f"{n}: a runbook entry without a rule" for n in book if n not in names]
    out += [f"{n}: its entry lacks {part}" for n, body in book.items() for part in PARTS
            if part not in body]
    return out


def test_every_alert_rule_has_a_runbook_entry_with_all_four_parts() -> None:
    rules, page = RULES.read_text(), PAGE.read_text()
    assert len(alerts(rules)) >= 10
    assert problems(rules, page) == []


def test_a_new_rule_or_a_missing_part_is_caught() -> None:
    rules, page = RULES.read_text(), PAGE.read_text()
    doc = yaml.safe_load(rules)
    doc["groups"][0]["rules"].append({"alert": "BrandNewAlert", "expr": "vector(1)"})
    assert problems(yaml.safe_dump(doc), page) == [
        "BrandNewAlert: no runbook entry in docs/operations.md"]
    stripped = page.replace("- **Do**: follow the alert beside it.", "- follow it.", 1)
    assert problems(rules, stripped) == ["RoomSpeechWithoutCaptions: its entry lacks **Do**"]


def test_the_rules_point_at_runbook_pages_that_exist() -> None:
    for page in set(re.findall(r"runbook: (docs/[\w/.-]+\.md)", RULES.read_text())):
        assert (ROOT / page).is_file(), page
