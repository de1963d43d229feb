"""The Grafana dashboards: committed as `dashboards/build.py` writes them, every query
names metrics the code exports with labels they carry (and parses, by `promtool`),
every dashboard filters by room and language, and Grafana's provisioning finds them."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from orchestrator.metric_catalog import series_labels
from tests.test_metrics_promql import problems

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def _build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build()
NAMES = tuple(BUILD.DASHBOARDS)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARDS / f"{name}.json").read_text(encoding="utf-8"))
    return data


def panels(name: str) -> list[dict[str, Any]]:
    return [p for p in load(name)["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every panel query."""
    return [(name, p["title"], t["expr"]) for name in NAMES for p in panels(name)
            for t in p["targets"]]


def test_the_committed_json_is_what_the_script_writes() -> None:
    assert NAMES == ("fleet", "room", "translation", "delivery")
    for name, build in BUILD.DASHBOARDS.items():
        assert (DASHBOARDS / f"{name}.json").read_text(encoding="utf-8") == BUILD.render(build), (
            f"dashboards/{name}.json is stale: run python dashboards/build.py")


def test_every_query_names_exported_metrics_with_their_labels() -> None:
    found = {f"{d} / {title}: {p}" for d, title, expr in queries() for p in problems(expr)}
    assert not found, "\n".join(sorted(found))
    assert len(queries()) >= 40


def test_every_query_parses(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run scripts/setup.sh (Debian package prometheus)")

    def concrete(expr: str) -> str:
        for var, value in (("$__rate_interval", "1m"), ("$__range", "1h"),
                           ("$stream", ".*"), ("$lang", ".*")):
            expr = expr.replace(var, value)
        return expr

    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{n}", "expr": concrete(expr)}
        for n, (_, _, expr) in enumerate(queries())]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_filters_by_room_and_language() -> None:
    for name in NAMES:
        variables = {v["name"]: v for v in load(name)["templating"]["list"]}
        assert {"datasource", "stream", "lang"} <= set(variables), name
        for var in ("stream", "lang"):
            v = variables[var]
            assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", v["query"]["query"])
            assert m, v["query"]
            known = series_labels(m.group(1))
            assert known is not None and m.group(2) in known[1], v["query"]
    # A query over per-room series follows the room picked, unless it adds up whole
    # actors (an actor's real-time factor counts all its rooms).
    for d, title, expr in queries():
        per_room = [n for n in re.findall(r"\b(?:ray_)?babelcast_\w+", expr)
                    if (k := series_labels(n)) and "stream" in k[0].labels]
        if per_room and "by (actor)" not in expr:
            assert 'stream=~"$stream"' in expr, f"{d} / {title} ignores the stream variable"


def test_every_panel_has_a_unit_and_the_headline_ones_thresholds() -> None:
    for name in NAMES:
        for p in panels(name):
            assert p["fieldConfig"]["defaults"]["unit"], f"{name} / {p['title']}"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all(t["datasource"] == p["datasource"] for t in p["targets"])
        with_thresholds = [p["title"] for p in panels(name)
                           if len(p["fieldConfig"]["defaults"]["thresholds"]["steps"]) > 1]
        assert len(with_thresholds) >= 3, name
    fleet = {p["title"]: p for p in panels("fleet")}
    latency = fleet["Speech → final, p95"]["fieldConfig"]["defaults"]
    assert latency["unit"] == "s" and latency["thresholds"]["steps"][-1]["value"] == 5


def test_panels_do_not_overlap() -> None:
    for name in NAMES:
        cells: set[tuple[int, int]] = set()
        for p in load(name)["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, (name, p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, (name, p["title"])
            cells |= mine
        ids = [p["id"] for p in load(name)["panels"]]
        assert len(ids) == len(set(ids))


def test_grafana_provisioning_loads_these_files_from_prometheus() -> None:
    (ds,) = yaml.safe_load((PROVISIONING / "datasources" / "babelcast.yml").read_text())[
        "datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090"
    for name in NAMES:
        var = next(v for v in load(name)["templating"]["list"] if v["name"] == "datasource")
        assert var["current"]["value"] == ds["uid"]
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "babelcast.yml").read_text())[
        "providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert (ROOT / "deploy" / next(h for h, c in mounts.items()
                                   if c == provider["options"]["path"])).resolve() == DASHBOARDS
    assert (ROOT / "deploy" / next(h for h, c in mounts.items()
                                   if c == "/etc/grafana/provisioning")).resolve() == PROVISIONING
    env = compose["services"]["grafana"]["environment"]
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/fleet.json"
    uids = [load(name)["uid"] for name in NAMES]
    assert len(set(uids)) == len(uids)
