"""The three floors of DESIGN.md ("Layout"): imports only point down.

The sources are parsed with `ast`, never imported: the rules must hold for code
that is not even importable here (no GPU, no vllm), and for imports hidden in
functions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("workers", "translation", "orchestrator")

# Line breaking is pure text shaping that translations need for their target language's
# display lines; the rest of workers/captions (the segmenter) stays out of reach.
TRANSLATION_MAY_IMPORT_FROM_WORKERS = ("workers.events", "workers.bus",
                                       "workers.captions.linebreak", "workers.aio")
RAY_ALLOWED = ("orchestrator/runtime.py", "orchestrator/ray_actors.py",
               "orchestrator/ray_metrics.py")
VLLM_ALLOWED = ("workers/engines/vllm/*.py", "translation/backends/vllm*.py")
# vLLM loads these by qualified name in its engine-core process (scheduler_cls,
# worker_cls): they subclass vLLM's classes, so they import vllm at the top. Nothing in
# the project imports them (checked below), so vllm stays out of every other process.
VLLM_PLUGINS = ("workers/engines/vllm/reanchor/scheduler.py",
                "workers/engines/vllm/reanchor/worker.py")


@dataclass(frozen=True, slots=True)
class Import:
    path: str  # relative to the repository root, with forward slashes
    line: int
    module: str  # absolute dotted name, relative imports resolved
    lazy: bool  # inside a function body, or only for type checkers

    def where(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _package_of(rel: str) -> list[str]:
    parts = rel.removesuffix(".py").split("/")
    return parts[:-1]


def _is_type_checking_guard(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_in(source: str, rel: str) -> list[Import]:
    """Every import in `source` (the file at `rel`), at any depth."""
    found: list[Import] = []
    package = _package_of(rel)

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(rel, child.lineno, alias.name, lazy))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    up = child.level - 1
                    base = package[: len(package) - up] if up <= len(package) else []
                    prefix = ".".join([*base, child.module] if child.module else base)
                else:
                    prefix = child.module or ""
                for alias in child.names:
                    # `from workers import bus` imports the module workers.bus.
                    name = prefix if alias.name == "*" else f"{prefix}.{alias.name}"
                    found.append(Import(rel, child.lineno, name, lazy))
            elif isinstance(child, ast.Call) and (target := _dynamic_import_target(child)):
                found.append(Import(rel, child.lineno, target, lazy))
            if _is_type_checking_guard(child):
                assert isinstance(child, ast.If)
                for stmt in child.body:
                    visit_stmt(stmt, lazy=True)
                for stmt in child.orelse:
                    visit_stmt(stmt, lazy=lazy)
            else:
                visit(child, child_lazy)

    def visit_stmt(stmt: ast.stmt, lazy: bool) -> None:
        wrapper = ast.Module(body=[stmt], type_ignores=[])
        visit(wrapper, lazy)

    visit(parse(source, rel), lazy=False)
    return found


def parse(source: str, rel: str) -> ast.Module:
    """ast.parse, once more on CPython 3.11's spurious "AST constructor recursion depth
    mismatch" SystemError (python/cpython#106905, fixed in later releases): the AST
    builder's depth counter is shared with other threads of the process (Ray's, the
    suite's event loops), and a full-suite run here hit it once in 800 tests. The
    second parse is a fresh count; a real syntax problem raises SyntaxError, not this."""
    try:
        return ast.parse(source, filename=rel)
    except SystemError as exc:
        if "recursion depth mismatch" not in str(exc):
            raise
        return ast.parse(source, filename=rel)


def _dynamic_import_target(call: ast.Call) -> str | None:
    """`importlib.import_module("x")` and `__import__("x")` count as imports."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in {"import_module", "__import__"} or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _top(module: str) -> str:
    return module.split(".")[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def project_imports() -> Iterator[Import]:
    for floor in FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield from imports_in(path.read_text(encoding="utf-8"), rel)


def report(offenders: list[Import], rule: str) -> str:
    return rule + ":\n  " + "\n  ".join(i.where() for i in offenders)


# -- the rules, as functions over a list of imports (tested on samples below) --


def workers_upward_imports(imports: list[Import]) -> list[Import]:
    return [
        i
        for i in imports
        if i.path.startswith("workers/") and _top(i.module) in {"translation", "orchestrator"}
    ]


def translation_disallowed_imports(imports: list[Import]) -> list[Import]:
    bad: list[Import] = []
    for i in imports:
        if not i.path.startswith("translation/"):
            continue
        if _top(i.module) == "orchestrator":
            bad.append(i)
        elif _top(i.module) == "workers" and not any(
            _within(i.module, allowed) for allowed in TRANSLATION_MAY_IMPORT_FROM_WORKERS
        ):
            bad.append(i)
    return bad


def ray_imports_outside_runtime(imports: list[Import]) -> list[Import]:
    return [i for i in imports if _top(i.module) == "ray" and i.path not in RAY_ALLOWED]


def disallowed_vllm_imports(imports: list[Import]) -> list[Import]:
    bad: list[Import] = []
    for i in imports:
        if _top(i.module) != "vllm":
            continue
        if i.path in VLLM_PLUGINS:
            continue
        allowed_file = any(fnmatch(i.path, pattern) for pattern in VLLM_ALLOWED)
        if not (allowed_file and i.lazy):
            bad.append(i)
    return bad


def plugin_imports(imports: list[Import]) -> list[Import]:
    """Imports of the vLLM plugin modules (only vLLM may load them, by name)."""
    plugins = {p.removesuffix(".py").replace("/", ".") for p in VLLM_PLUGINS}
    return [i for i in imports
            if any(i.module == p or i.module.startswith(p + ".") for p in plugins)
            and i.path not in VLLM_PLUGINS and not i.path.startswith("tests/")]


WAIT_FOR_ALLOWED = ("workers/aio.py",)


def asyncio_wait_for_uses(source: str, rel: str) -> list[str]:
    """`file:line` of each `asyncio.wait_for` (attribute or imported name) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if (isinstance(node, ast.Attribute) and node.attr == "wait_for"
                and isinstance(node.value, ast.Name) and node.value.id == "asyncio") or (
                isinstance(node, ast.ImportFrom) and node.module == "asyncio"
                and any(a.name == "wait_for" for a in node.names)):
            found.append(f"{rel}:{node.lineno}")
    return found


# -- the project ---------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = list(project_imports())
    assert any(i.path.startswith("workers/") for i in found), "no workers/ source was parsed"
    return found


def test_workers_import_neither_translation_nor_orchestrator(imports: list[Import]) -> None:
    bad = workers_upward_imports(imports)
    assert not bad, report(bad, "workers/ (bottom floor) must not import upward")


def test_translation_imports_only_workers_events_bus_linebreak_and_aio(
        imports: list[Import]) -> None:
    bad = translation_disallowed_imports(imports)
    assert not bad, report(
        bad,
        "translation/ may import from workers only workers.events, workers.bus, "
        "workers.captions.linebreak and workers.aio, and nothing from orchestrator",
    )


def test_no_product_code_uses_asyncio_wait_for() -> None:
    bad = [use for floor in FLOORS for path in sorted((ROOT / floor).rglob("*.py"))
           if (rel := path.relative_to(ROOT).as_posix()) not in WAIT_FOR_ALLOWED
           for use in asyncio_wait_for_uses(path.read_text(encoding="utf-8"), rel)]
    assert not bad, ("asyncio.wait_for can lose a cancel on Python 3.11 (see workers/aio.py); "
                     "use workers.aio.wait_for:\n  " + "\n  ".join(bad))


def test_only_the_orchestrator_runtime_imports_ray(imports: list[Import]) -> None:
    bad = ray_imports_outside_runtime(imports)
    assert not bad, report(bad, "only orchestrator/runtime.py, ray_actors.py and ray_metrics.py "
                                 "may import ray")


def test_vllm_is_imported_only_lazily_by_the_vllm_engine_and_backend(
    imports: list[Import],
) -> None:
    bad = disallowed_vllm_imports(imports)
    assert not bad, report(
        bad,
        "vllm may be imported only inside functions of workers/engines/vllm/ "
        "or translation/backends/vllm*.py",
    )


def test_nothing_imports_the_vllm_plugin_modules(imports: list[Import]) -> None:
    bad = plugin_imports(imports)
    assert not bad, report(bad, "the vLLM plugin modules are loaded by vLLM only, by name")


# -- the checker itself: it must see the imports that break the rules ----------


def test_checker_resolves_relative_imports() -> None:
    source = "from ..bus import RedisBus\nfrom . import base\nfrom .. import events\n"
    modules = [i.module for i in imports_in(source, "workers/engines/embedded.py")]
    assert modules == ["workers.bus.RedisBus", "workers.engines.base", "workers.events"]


def test_checker_finds_upward_imports_in_functions_and_relative_form() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    from orchestrator.config import EventConfig\n"
        "from ...translation import host\n"
    )
    bad = workers_upward_imports(imports_in(source, "workers/captions/x.py"))
    assert [(i.line, i.module) for i in bad] == [
        (3, "orchestrator.config.EventConfig"),
        (4, "translation.host"),
    ]


def test_checker_allows_translation_only_events_and_bus_from_workers() -> None:
    source = (
        "from workers.events import CaptionSegment\n"
        "from workers import bus\n"
        "import workers.bus\n"
        "from workers.captions.segmenter import Segmenter\n"
        "from workers import asr\n"
        "from orchestrator import metrics\n"
        "from workers.captions.linebreak import break_lines\n"
    )
    bad = translation_disallowed_imports(imports_in(source, "translation/host.py"))
    assert [i.line for i in bad] == [4, 5, 6]


def test_checker_finds_ray_anywhere_but_the_runtime() -> None:
    source = "def start():\n    import ray\n    from ray.util import metrics\n"
    assert len(ray_imports_outside_runtime(imports_in(source, "workers/asr.py"))) == 2
    assert ray_imports_outside_runtime(imports_in(source, "orchestrator/runtime.py")) == []
    dynamic = "import importlib\nray = importlib.import_module('ray')\n"
    assert len(ray_imports_outside_runtime(imports_in(dynamic, "orchestrator/cli.py"))) == 1


def test_checker_allows_vllm_only_lazily_in_the_vllm_modules() -> None:
    lazy = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm import AsyncLLM\n"
        "class VllmVoxtralEngine:\n"
        "    async def start(self):\n"
        "        from vllm.v1.engine.async_llm import AsyncLLM\n"
    )
    eager = "import vllm\n"
    assert disallowed_vllm_imports(imports_in(lazy, "workers/engines/vllm/engine.py")) == []
    assert disallowed_vllm_imports(imports_in(lazy, "translation/backends/vllm.py")) == []
    assert len(disallowed_vllm_imports(imports_in(eager, "workers/engines/vllm/engine.py"))) == 1
    assert len(disallowed_vllm_imports(imports_in(lazy, "workers/engines/embedded.py"))) == 2
    assert len(disallowed_vllm_imports(imports_in(lazy, "orchestrator/runtime.py"))) == 2
    plugin = "workers/engines/vllm/reanchor/worker.py"
    assert disallowed_vllm_imports(imports_in(eager, plugin)) == []
    user = "from workers.engines.vllm.reanchor.worker import ReanchorWorker\n"
    assert len(plugin_imports(imports_in(user, "workers/engines/vllm/engine.py"))) == 1


def test_checker_reports_file_and_line() -> None:
    bad = workers_upward_imports(imports_in("\n\nimport orchestrator\n", "workers/asr.py"))
    message = report(bad, "rule")
    assert "workers/asr.py:3 imports orchestrator" in message


def test_checker_finds_asyncio_wait_for_in_any_form() -> None:
    source = ("import asyncio\n"
              "from asyncio import wait_for, sleep\n"
              "from workers.aio import wait_for as ok\n"
              "async def f(x):\n"
              "    await asyncio.wait_for(x, 1)\n"
              "    await ok(x, 1)\n")
    assert asyncio_wait_for_uses(source, "workers/asr.py") == ["workers/asr.py:2",
                                                              "workers/asr.py:5"]
