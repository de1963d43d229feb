"""Real parts end to end: `babelcast run` (local Ray, the embedded tiny.en engine, a
translator) captions two rooms while a real Prometheus server (the Debian binary)
scrapes the gateway (with the event's scrape token, from the file the config names) and
Ray's metrics agents with deploy/prometheus/prometheus.yml (its targets and intervals
adapted) and evaluates the real alert rules. The tests query Prometheus' HTTP API as
Grafana does.

Ray exports actor metrics every `RAY_metrics_report_interval_ms` (10 s by default);
the event runs with 1 s so that the series appear within seconds.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.metric_catalog import series_labels
from orchestrator.redis_server import LocalRedisServer, free_port
from tests.event_support import Event, start_event, stop_event
from tests.speech import AUDIO
from tests.test_dashboards import queries

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = "/usr/bin/prometheus"
SERIES_TIMEOUT_S = 90.0
TOKENS = {"LIVE_ADMIN": "live-admin-token-0123456789",
          "LIVE_SCRAPE": "live-scrape-token-0123456789"}


@dataclass
class Live:
    event: Event
    prom: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def until(self, expr: str, ok: Callable[[list[dict[str, Any]]], bool], what: str,
              timeout_s: float = SERIES_TIMEOUT_S) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}: {expr} = {result}\n"
                            f"{self.event.log.read_text()[-2000:]}")
            time.sleep(0.5)


def prometheus_config(gateway_port: int, sd_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml pointed at this event, scraping every second."""
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ROOT / "deploy/prometheus" / f) for f in cfg["rule_files"]]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["babelcast"]["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
    jobs["ray"]["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
    return cfg


@pytest.fixture(scope="module")
def live(redis_server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Live]:
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail("prometheus is missing: run scripts/setup.sh (Debian package prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    # Ray's own folder, short (its socket paths must fit) and ours alone, so that the
    # service-discovery file Prometheus reads lists this event's Ray only.
    ray_tmp = Path(tempfile.mkdtemp(prefix="bc", dir="/tmp"))
    port = free_port()
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/3"
    subprocess.run(["redis-cli", "-u", redis_url, "flushdb"], check=False,
                   capture_output=True, timeout=10)
    cfg = tmp / "event.yaml"
    cfg.write_text(f"""
event: metrics test
redis: {{url: "{redis_url}"}}
engine: {{kind: embedded, model: tiny.en, actors: 1, streams_per_actor: 2, cpu_threads: 2}}
streams:
  - {{id: room-a, source: "{AUDIO / 'room-a.flac'}", language: en, loop: true, targets: [pt]}}
  - {{id: room-b, source: "{AUDIO / 'room-b.flac'}", language: en, loop: true}}
gateway: {{host: 127.0.0.1, port: {port}}}
auth: {{admin_token_env: LIVE_ADMIN, scrape_token_env: LIVE_SCRAPE, viewers: public}}
""")
    prom_port = free_port()
    prom_cfg = tmp / "prometheus.yml"
    sd_file = ray_tmp / "ray" / "prom_metrics_service_discovery.json"
    prom_cfg.write_text(yaml.safe_dump(prometheus_config(port, sd_file)))
    # The scrape token where deploy/prometheus/prometheus.yml reads it (beside the file).
    (tmp / "secrets").mkdir()
    (tmp / "secrets" / "babelcast-scrape-token").write_text(TOKENS["LIVE_SCRAPE"])
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
    env = {"RAY_TMPDIR": str(ray_tmp), "RAY_metrics_report_interval_ms": "1000", **TOKENS}
    event: Event | None = None
    try:
        event = start_event(cfg, port, env)
        base = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if prom.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()}")
            time.sleep(0.2)
        yield Live(event, base)
    finally:
        if event is not None:
            stop_event(event)
            # `babelcast run` takes its Ray's targets back when it stops.
            assert event.proc.returncode == 0 and not sd_file.exists()
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_prometheus_scrapes_the_gateway_and_every_ray_node(live: Live) -> None:
    up = live.until("up", lambda r: {x["metric"]["job"] for x in r if x["value"][1] == "1"}
                    == {"babelcast", "ray"}, "both jobs up")
    assert all(x["value"][1] == "1" for x in up)


def test_captions_published_move_and_the_latency_histogram_fills(live: Live) -> None:
    published = "sum by (stream) (ray_babelcast_captions_published_total)"
    first = live.until(published, lambda r: {x["metric"]["stream"] for x in r
                                             if float(x["value"][1]) > 0} == {"room-a", "room-b"},
                       "captions from both rooms")
    before = {x["metric"]["stream"]: float(x["value"][1]) for x in first}
    live.until(published, lambda r: all(float(x["value"][1]) > before[x["metric"]["stream"]]
                                         for x in r) and len(r) == 2, "more captions")
    finals = 'sum by (stream) (ray_babelcast_caption_latency_seconds_count{kind="final"})'
    live.until(finals, lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r),
               "final latencies from both rooms")
    p95 = live.value('histogram_quantile(0.95, sum by (le) '
                     '(ray_babelcast_caption_latency_seconds_bucket{kind="final"}))')
    assert p95 is not None and 0 < p95 < 30 and not math.isnan(p95)


def test_every_series_prometheus_holds_is_a_catalog_metric(live: Live) -> None:
    names_q = 'count by (__name__) ({__name__=~"(ray_)?babelcast_.+"})'
    want = {"ray_babelcast_captions_published_total", "ray_babelcast_asr_stream_active",
            "ray_babelcast_source_audio_seconds_total", "ray_babelcast_translations_total",
            "babelcast_streams_placed", "babelcast_actor_up"}
    result = live.until(names_q, lambda r: want <= {x["metric"]["__name__"] for x in r},
                        "the headline series")
    names = {x["metric"]["__name__"] for x in result}
    assert all(series_labels(n) is not None for n in names), sorted(
        n for n in names if series_labels(n) is None)


def test_every_counter_a_dashboard_queries_exists_at_zero_from_the_start(live: Live) -> None:
    # These come from events that may never happen in a demo (a gap, a rollover, a rut
    # recovery, a session error); each room's series must exist anyway.
    for name in ("audio_gaps_total", "rollovers_total", "rut_recoveries_total",
                 "session_errors_total", "source_gaps_total"):
        live.until(f"count by (stream) (ray_babelcast_{name})", lambda r: len(r) == 2,
                   f"{name} for both rooms")


NOT_IN_THIS_EVENT = {
    "babelcast_archive_cues_total": "no archive output configured",
    "babelcast_youtube_backlog_finals": "no YouTube output configured",
    "babelcast_youtube_posts_total": "no YouTube output configured",
    "babelcast_push_audio_frames_total": "no push stream (labelled by stream)",
    "babelcast_push_bad_frames_total": "no push stream (labelled by stream)",
    "ray_babelcast_engine_reanchor_rotation_failures_total": "vllm re-anchoring only",
    "babelcast_engine_replacements_total": "an engine that can be replaced (vllm) only",
}
"""Queried metrics whose series cannot exist in this event: the feature is not in it."""


def queried_metrics() -> set[str]:
    """Every metric name a dashboard panel or an alert rule queries."""
    exprs = [expr for _, _, expr in queries()]
    groups = yaml.safe_load((ROOT / "deploy/prometheus/rules/babelcast.rules.yml")
                            .read_text())["groups"]
    exprs += [r["expr"] for g in groups for r in g["rules"]]
    found = {n for e in exprs for n in re.findall(r"\b((?:ray_)?babelcast_[a-z0-9_]+)", e)}
    # A histogram is queried through its series; it exists when its _count does.
    return {re.sub(r"_(bucket|sum)$", "_count", n) for n in found}


def test_every_metric_a_panel_or_alert_queries_exists_on_a_fresh_event(live: Live) -> None:
    """On a healthy event with nothing gone wrong, every series a panel or an alert
    reads is there (at 0 when nothing happened): a missing one reads "No data" and a
    rate() alert misses its first increment (issue 36: five source and stall counters)."""
    wanted = queried_metrics() - set(NOT_IN_THIS_EVENT)
    assert len(wanted) >= 35
    names_q = 'count by (__name__) ({__name__=~"(ray_)?babelcast_.+"})'

    def present(result: list[dict[str, Any]]) -> set[str]:
        return {x["metric"]["__name__"] for x in result}

    try:
        live.until(names_q, lambda r: wanted <= present(r), "every queried metric",
                   timeout_s=SERIES_TIMEOUT_S)
    except pytest.fail.Exception:
        missing = sorted(wanted - present(live.query(names_q)))
        pytest.fail(f"queried but never exported on a fresh event: {missing}")
    # Per room where the metric is per room: both rooms' series exist.
    for name in ("ray_babelcast_audio_stalls_total", "ray_babelcast_audio_gap_fill_seconds_total",
                 "ray_babelcast_late_audio_dropped_seconds_total",
                 "ray_babelcast_source_reconnects_total", "ray_babelcast_source_refused_total",
                 "ray_babelcast_caption_lag_seconds"):
        live.until(f"count by (stream) ({name})", lambda r: len(r) == 2,
                   f"{name} for both rooms")


def test_each_room_is_one_stream_on_one_actor_within_budget(live: Live) -> None:
    active = live.until("count by (stream) (ray_babelcast_asr_stream_active == 1)",
                        lambda r: len(r) == 2, "both rooms running")
    assert {x["metric"]["stream"]: x["value"][1] for x in active} == {"room-a": "1",
                                                                       "room-b": "1"}
    assert live.value("sum(babelcast_streams_placed)") == 2
    assert live.value('babelcast_streams_budget{actor="asr-0"}') == 2
    assert live.value("babelcast_streams_unplaced") == 0
    # The supervisor checks every actor each 5 s.
    up = live.until("babelcast_actor_up == 1", lambda r: len(r) == 3, "three actors up")
    assert {(x["metric"]["actor"], x["metric"]["role"]) for x in up} == {
        ("asr-0", "asr"), ("ingest-0", "ingest"), ("translator-0", "translator")}
    audio = live.until("sum by (stream) (ray_babelcast_source_audio_seconds_total)",
                       lambda r: len(r) == 2 and all(float(x["value"][1]) > 2 for x in r),
                       "audio read from both sources")
    assert audio
    live.until("sum(ray_babelcast_engine_busy_seconds_total)",
               lambda r: bool(r) and float(r[0]["value"][1]) > 0, "engine load")


def test_translations_report_their_lag_per_language(live: Live) -> None:
    live.until('sum by (lang, backend) (ray_babelcast_translation_lag_seconds_count)',
               lambda r: any(x["metric"]["lang"] == "pt" and float(x["value"][1]) > 0
                             for x in r), "a pt translation's lag")
    jobs = live.until("max by (state) (ray_babelcast_translation_queue_jobs)",
                      lambda r: len(r) == 2, "the queue figures")
    assert {x["metric"]["state"] for x in jobs} == {"waiting", "pending"}


def test_every_dashboard_query_runs_and_the_rules_evaluate(live: Live) -> None:
    live.until("sum(ray_babelcast_captions_published_total)", bool, "actor metrics")
    for _, _, expr in queries():
        for var, value in (("$__rate_interval", "15s"), ("$__range", "5m"),
                           ("$stream", ".*"), ("$lang", ".*")):
            expr = expr.replace(var, value)
        live.query(expr)  # asserts that Prometheus evaluated it
    fleet = {t: e for d, t, e in queries() if d == "fleet"}
    assert live.query(fleet["Speech without caption"].replace("$stream", ".*"))
    groups = httpx.get(f"{live.prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 9
    for rule in rules:
        assert rule["health"] in {"ok", "unknown"}, (rule["name"], rule.get("lastError"))
    # Both rooms are captioned: nothing fires that says otherwise.
    firing = {a["labels"]["alertname"]
              for a in httpx.get(f"{live.prom}/api/v1/alerts", timeout=10).json()["data"]
              ["alerts"]}
    assert not firing & {"RoomSpeechWithoutCaptions", "StreamUnplaced", "ActorDown",
                         "GatewayDown", "RayMetricsDown"}


def test_babelcast_status_prints_the_headline_figures(live: Live) -> None:
    live.until('sum(ray_babelcast_translations_total{lang="pt"})', bool, "a translation")
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "status", "--url", live.event.base,
         "--token", TOKENS["LIVE_ADMIN"]],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for room in ("room-a", "room-b"):
        line = next(x for x in lines if x.startswith(f"{room} "))
        assert "captioning" in line and "asr-0" in line, line
    assert any(x.split()[:2] == ["room-a", "pt"] for x in lines)
    assert any(x.startswith("asr-0 ") and "2/2 streams" in x for x in lines)
    assert any(x.startswith("translator-0 ") for x in lines)
