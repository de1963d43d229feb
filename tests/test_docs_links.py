"""The README and docs/ link only to files and headings that exist, and name no module by a
path it has left (the vLLM engine moved to workers/engines/vllm/).

A newcomer follows the README's map to a page and a page's links to code and results: a
dead link there is a task not found. Anchors are GitHub's: the heading in lower case,
punctuation dropped, spaces as dashes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
OLD_PATHS = re.compile(r"workers/engines/(vllm_(voxtral|session|options|direct|checks|reanchor)"
                       r"|mps\.py)")


def slug(heading: str) -> str:
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def dead_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            out.append(f"{page.name}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            out.append(f"{page.name}: {target}: no such heading")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_reaches_a_file_and_heading_that_exist(page: Path) -> None:
    assert dead_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_names_a_module_by_its_old_path(page: Path) -> None:
    assert OLD_PATHS.findall(page.read_text(encoding="utf-8")) == []


def test_a_dead_link_or_heading_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Tokens and scopes\n")
    page.write_text("# Page\n[ok](other.md#tokens-and-scopes) [ok](#page) "
                    "[gone](missing.md) [bad](other.md#no-such) [web](https://x.org/a)\n")
    assert dead_links(page) == ["page.md: missing.md: no such file",
                                "page.md: other.md#no-such: no such heading"]
