"""deploy/: the Prometheus configuration and alert rules pass `promtool` (config and
rule checks, and the rules' unit tests, which fire "speech but no captions" on a
synthetic room), the rules name only exported metrics, and the compose file that
brings up Redis, Prometheus and Grafana is well formed. The compose file cannot be run
here (no Docker engine): its YAML and the paths it mounts are what is checked."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_metrics_promql import problems

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rules" / "babelcast.rules.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run scripts/setup.sh (Debian package prometheus)")
    return subprocess.run(["promtool", *args], cwd=PROM, capture_output=True, text=True,
                          timeout=60)


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    # promtool wants the gateway's token file, which an operator writes (never committed).
    shutil.copytree(PROM, tmp_path / "prometheus")
    (tmp_path / "prometheus" / "secrets" / "babelcast-scrape-token").write_text("t" * 32)
    result = promtool("check", "config", str(tmp_path / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_the_gateway_is_scraped_with_a_token_from_a_file_that_is_not_committed() -> None:
    job = {j["job_name"]: j for j in yaml.safe_load(
        (PROM / "prometheus.yml").read_text())["scrape_configs"]}["babelcast"]
    assert job["authorization"] == {"type": "Bearer",
                                    "credentials_file": "secrets/babelcast-scrape-token"}
    ignored = subprocess.run(["git", "check-ignore", "-q",
                              "deploy/prometheus/secrets/babelcast-scrape-token"], cwd=ROOT)
    assert ignored.returncode == 0, "the token file must be ignored by git"


def test_config_scrapes_the_gateway_and_rays_service_discovery_file() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["babelcast"]["metrics_path"] == "/metrics"
    assert jobs["ray"]["file_sd_configs"][0]["files"] == [
        "/tmp/ray/prom_metrics_service_discovery.json"]


def test_alert_rules_are_valid() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rule_unit_tests_pass() -> None:
    """Includes: room-b speaks with no caption and fires RoomSpeechWithoutCaptions,
    captioned room-a and silent room-c do not."""
    result = promtool("test", "rules", "tests/babelcast.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def test_alerts_cover_what_operators_asked_for_and_name_exported_metrics() -> None:
    names = {r["alert"] for r in rules()}
    assert {"RoomSpeechWithoutCaptions", "FinalCaptionLatencyHigh", "TranslationLagHigh",
            "ActorDown", "StreamUnplaced"} <= names
    for r in rules():
        assert problems(r["expr"]) == [], r["alert"]
        assert r["labels"]["severity"] in {"critical", "warning"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_every_alert_has_a_unit_test() -> None:
    cases = yaml.safe_load((PROM / "tests" / "babelcast.rules.test.yml").read_text())
    tested = {a["alertname"] for t in cases["tests"] for a in t.get("alert_rule_test", [])}
    assert {r["alert"] for r in rules()} <= tested


def test_compose_brings_up_redis_prometheus_and_grafana_with_our_files() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "prometheus", "grafana"}
    for name, svc in services.items():
        assert ":" in svc["image"] and not svc["image"].endswith(":latest"), name
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith((".", "/")):
                if host.startswith("."):
                    assert (ROOT / "deploy" / host).exists(), f"{name}: {host} is missing"
            else:
                assert host in compose["volumes"], f"{name}: volume {host} is not declared"
    prom = services["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    # Ray's service-discovery file, and the session folders its entries may link to.
    assert "/tmp/ray:/tmp/ray:ro" in prom["volumes"]
