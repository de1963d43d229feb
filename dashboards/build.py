"""Writes the Grafana dashboards of this folder: `python dashboards/build.py`.

The JSON is committed, so Grafana's provisioning (deploy/grafana/) loads it without
running code; tests/test_dashboards.py checks that the files match this script and
that every query names catalog metrics (orchestrator/metric_catalog.py) with their
labels. Metric names here are the ones Prometheus stores: actor-side metrics carry
Ray's `ray_` prefix (`MetricSpec.exposed`).

Four dashboards: fleet (is every room captioned, how late, how loaded), room (one
room in detail), translation (queue, lag, cost, errors), delivery (clients,
messages, drops, outputs). Each has `stream` and `lang` variables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
S = 'stream=~"$stream"'
L = 'lang=~"$lang"'

# Service levels, the same as deploy/prometheus/rules/babelcast.rules.yml.
FINAL_SLO_S = 5
TRANSLATION_SLO_S = 3


def steps(*pairs: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in pairs]}


OK = ("green", None)


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


def panel(kind: str, title: str, targets: list[dict[str, Any]], *, unit: str = "short",
          thresholds: dict[str, Any] | None = None, w: int = 12, h: int = 8,
          description: str = "", decimals: int | None = None, minimum: float | None = None,
          maximum: float | None = None, mappings: list[dict[str, Any]] | None = None,
          options: dict[str, Any] | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit,
                                "thresholds": thresholds or steps(OK)}
    if decimals is not None:
        defaults["decimals"] = decimals
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if mappings:
        defaults["mappings"] = mappings
    if kind == "timeseries":
        defaults["custom"] = {"thresholdsStyle": {"mode": "line" if thresholds else "off"},
                              "lineWidth": 1, "fillOpacity": 10, "spanNulls": True}
    opts = options or {}
    if kind == "stat":
        opts = {"colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                **opts}
    if kind == "bargauge":
        opts = {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                **opts}
    refs = "ABCDEFGH"
    return {"type": kind, "title": title, "description": description, "datasource": DS,
            "targets": [{**t, "refId": refs[i]} for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": opts,
            "gridPos": {"w": w, "h": h}}


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


def p95(metric: str, by: str, selector: str, q: float = 0.95) -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[{RI}])))")


def variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, q: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "definition": q, "query": {"query": q, "refId": name}, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}

    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {"text": "Prometheus (Babelcast)",
                                            "value": "babelcast-prometheus"}},
        # Every configured stream, placed or not: the orchestrator exports them all.
        query("stream", "Room", "label_values(babelcast_stream_unplaced, stream)"),
        query("lang", "Language", "label_values(ray_babelcast_translations_total, lang)"),
    ]


def dashboard(uid: str, title: str, description: str,
              panels: list[dict[str, Any]]) -> dict[str, Any]:
    x = y = row_h = 0
    laid: list[dict[str, Any]] = []
    for n, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p = {"id": n, **p, "gridPos": {"x": x, "y": y, "w": w, "h": h}}
        laid.append(p)
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return {
        "uid": uid, "title": title, "description": description, "tags": ["babelcast"],
        "editable": True, "graphTooltip": 1, "refresh": "10s", "schemaVersion": 39,
        "version": 1, "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["babelcast"], "asDropdown": False,
                   "includeVars": True, "keepTime": True, "title": "Babelcast"}],
        "templating": {"list": variables()},
        "panels": laid,
    }


# ---- the dashboards ------------------------------------------------------------------


def fleet() -> dict[str, Any]:
    up_map = [{"type": "value", "options": {"0": {"text": "DOWN", "color": "red"},
                                            "1": {"text": "up", "color": "green"}}}]
    return dashboard("babelcast-fleet", "Babelcast — fleet overview",
                     "Is every room captioned, how late, how loaded are the actors.", [
        row("Rooms"),
        panel("stat", "Last caption", [target(
            f"time() - max by (stream) (ray_babelcast_last_caption_timestamp_seconds{{{S}}})",
            "{{stream}}", instant=True)], unit="s", w=8, decimals=0,
            thresholds=steps(OK, ("orange", 15), ("red", 60)),
            description="Seconds since each room's last caption. A quiet room ages too: "
                        "read it with Speech without caption."),
        panel("stat", "Speech without caption", [target(
            f"max by (stream) (ray_babelcast_speech_without_caption_seconds{{{S}}})",
            "{{stream}}", instant=True)], unit="s", w=8, decimals=0,
            thresholds=steps(OK, ("orange", 10), ("red", 30)),
            description="Seconds of detected speech since the room's last caption: above 30 "
                        "the RoomSpeechWithoutCaptions alert fires."),
        panel("stat", "Unplaced streams", [target(
            "sum(babelcast_streams_unplaced)", "unplaced", instant=True)], w=4,
            thresholds=steps(OK, ("red", 1)), decimals=0),
        panel("stat", "Caption clients", [target(
            f"sum(babelcast_gateway_clients{{{S}}})", "clients", instant=True)], w=4, decimals=0,
            options={"colorMode": "none"}),
        panel("timeseries", "Speech → final, p95", [target(
            p95("ray_babelcast_caption_latency_seconds", "stream", f'kind="final",{S}'),
            "{{stream}}")], unit="s", thresholds=steps(OK, ("red", FINAL_SLO_S)),
            description=f"Last word spoken to its final caption published (SLO {FINAL_SLO_S} s)."),
        panel("timeseries", "Speech → partial, p95", [target(
            p95("ray_babelcast_caption_latency_seconds", "stream", f'kind="partial",{S}'),
            "{{stream}}")], unit="s", thresholds=steps(OK, ("orange", 2))),
        panel("timeseries", "Captions behind real time", [target(
            f"max by (stream) (ray_babelcast_caption_lag_seconds{{{S}}})", "{{stream}}")],
            unit="s", thresholds=steps(OK, ("orange", 5), ("red", 10)),
            description="Audio seconds from the oldest speech a room's session has not yet "
                        "recognised to the newest audio: above 10 for a minute the "
                        "CaptionsBehind alert fires (its actor carries more than it can)."),
        panel("timeseries", "Finals per minute", [target(
            f'sum by (stream) (rate(ray_babelcast_captions_published_total{{kind="final",{S}}}'
            f"[{RI}])) * 60", "{{stream}}")], unit="short"),
        panel("timeseries", "Translation lag p95 by language", [target(
            p95("ray_babelcast_translation_lag_seconds", "lang", f"{S},{L}"), "{{lang}}")],
            unit="s", thresholds=steps(OK, ("red", TRANSLATION_SLO_S))),
        row("Actors"),
        panel("bargauge", "Streams per ASR actor vs budget", [
            target("sum by (actor) (babelcast_streams_placed)", "{{actor}} placed",
                   instant=True),
            target("sum by (actor) (babelcast_streams_budget)", "{{actor}} budget",
                   instant=True)], w=8, decimals=0, minimum=0),
        panel("stat", "Actors", [target("max by (actor) (babelcast_actor_up)", "{{actor}}",
                                        instant=True)], w=8, mappings=up_map,
              thresholds=steps(("red", None), ("green", 1)),
              description="The supervisor's last check of each actor (every 5 s)."),
        panel("stat", "Streams running per actor", [target(
            "count by (actor) (ray_babelcast_asr_stream_active == 1)", "{{actor}}",
            instant=True)], w=8, decimals=0, options={"colorMode": "none"}),
        panel("timeseries", "Engine load", [target(
            f"sum by (actor) (rate(ray_babelcast_engine_busy_seconds_total[{RI}]))",
            "{{actor}}")], unit="percentunit", minimum=0, maximum=1,
            thresholds=steps(OK, ("orange", 0.8), ("red", 0.95)),
            description="Share of wall time the actor's engine decodes: near 100 % it "
                        "cannot keep up with more streams."),
        panel("timeseries", "Real-time factor", [target(
            f"sum by (actor) (rate(ray_babelcast_engine_busy_seconds_total[{RI}])) / "
            f"sum by (actor) (rate(ray_babelcast_asr_audio_seconds_total[{RI}]))",
            "{{actor}}")], unit="none", thresholds=steps(OK, ("orange", 0.5), ("red", 1)),
            description="Decode seconds per second of audio received: above 1 captions fall "
                        "behind."),
        panel("timeseries", "Mean engine step", [target(
            f"sum by (actor) (rate(ray_babelcast_engine_busy_seconds_total[{RI}])) / "
            f"sum by (actor) (rate(ray_babelcast_engine_steps_total[{RI}]))",
            "{{actor}}")], unit="s"),
        panel("timeseries", "Rollovers and session errors", [
            target(f"sum by (stream, reason) (increase(ray_babelcast_rollovers_total{{{S}}}"
                   f"[{RI}]))", "{{stream}} {{reason}}"),
            target(f"sum by (stream) (increase(ray_babelcast_session_errors_total{{{S}}}"
                   f"[{RI}]))", "{{stream}} session error")], unit="short"),
    ])


def room() -> dict[str, Any]:
    return dashboard("babelcast-room", "Babelcast — room",
                     "One room: captions, latency, sessions, audio, translations.", [
        row("Captions"),
        panel("timeseries", "Captions published per second", [target(
            f"sum by (stream, kind) (rate(ray_babelcast_captions_published_total{{{S}}}"
            f"[{RI}]))", "{{stream}} {{kind}}")], unit="cps"),
        panel("timeseries", "Speech → caption latency", [
            target(p95("ray_babelcast_caption_latency_seconds", "stream, kind", S),
                   "{{stream}} {{kind}} p95"),
            target(p95("ray_babelcast_caption_latency_seconds", "stream, kind", S, 0.5),
                   "{{stream}} {{kind}} p50")], unit="s",
            thresholds=steps(OK, ("red", FINAL_SLO_S))),
        panel("timeseries", "Speech without caption / text", [
            target(f"max by (stream) (ray_babelcast_speech_without_caption_seconds{{{S}}})",
                   "{{stream}} since last caption"),
            target(f"max by (stream) (ray_babelcast_voiced_without_text_seconds{{{S}}})",
                   "{{stream}} since engine text")], unit="s",
            thresholds=steps(OK, ("red", 30)),
            description="Speech seconds with nothing captioned; the engine's count restarts "
                        "at each rollover, the room's only at a caption."),
        panel("timeseries", "Behind real time and speech skipped", [
            target(f"max by (stream) (ray_babelcast_caption_lag_seconds{{{S}}})",
                   "{{stream}} behind"),
            target(f"sum by (stream, reason) (increase("
                   f"ray_babelcast_audio_skipped_seconds_total{{{S}}}[5m]))",
                   "{{stream}} skipped ({{reason}}), 5 min")], unit="s",
            thresholds=steps(OK, ("red", 10)),
            description="How far behind the room's captions are, and speech never captioned "
                        "because a policy skipped it (should stay 0)."),
        panel("timeseries", "Gateway delivery p95", [target(
            p95("babelcast_gateway_caption_delivery_seconds", "stream, kind", S),
            "{{stream}} {{kind}}")], unit="s"),
        row("Sessions and audio"),
        panel("timeseries", "Rollovers by reason", [target(
            f"sum by (stream, reason) (increase(ray_babelcast_rollovers_total{{{S}}}[5m]))",
            "{{stream}} {{reason}}")], unit="short", w=8),
        panel("timeseries", "Rut recoveries and session errors", [
            target(f"sum by (stream) (increase(ray_babelcast_rut_recoveries_total{{{S}}}[5m]))",
                   "{{stream}} rut recovered"),
            target(f"sum by (stream) (increase(ray_babelcast_session_errors_total{{{S}}}[5m]))",
                   "{{stream}} session errors")], unit="short", w=8),
        panel("timeseries", "Audio flow (seconds per second)", [
            target(f"sum by (stream) (rate(ray_babelcast_source_audio_seconds_total{{{S}}}"
                   f"[{RI}]))", "{{stream}} from source"),
            target(f"sum by (stream) (rate(ray_babelcast_asr_audio_seconds_total{{{S}}}"
                   f"[{RI}]))", "{{stream}} to engine"),
            target(f"sum by (stream) (rate(babelcast_push_audio_frames_total{{{S}}}[{RI}]))",
                   "{{stream}} pushed frames/s")], unit="none", w=8,
            thresholds=steps(("red", None), ("green", 0.9)),
            description="Real-time audio flows at 1 second per second."),
        panel("timeseries", "Audio gaps", [
            target(f"sum by (stream) (increase(ray_babelcast_audio_gaps_total{{{S}}}[5m]))",
                   "{{stream}} holes (ASR)"),
            target(f"sum by (stream, reason) (increase(ray_babelcast_source_gaps_total{{{S}}}"
                   f"[5m]))", "{{stream}} {{reason}} (source)"),
            target(f"sum by (stream) (increase(ray_babelcast_audio_gap_fill_seconds_total"
                   f"{{{S}}}[5m]))", "{{stream}} seconds filled")], unit="short", w=12),
        panel("timeseries", "Source reconnects and refused encoders", [
            target(f"sum by (stream) (increase(ray_babelcast_source_reconnects_total{{{S}}}"
                   f"[5m]))", "{{stream}} reconnects"),
            target(f"sum by (stream) (increase(ray_babelcast_source_refused_total{{{S}}}"
                   f"[5m]))", "{{stream}} refused (wrong key)")], unit="short", w=12,
            thresholds=steps(OK, ("red", 3))),
        panel("timeseries", "Stalls, filler and dropped audio", [
            target(f"sum by (stream) (increase(ray_babelcast_audio_stalls_total{{{S}}}[5m]))",
                   "{{stream}} stalls"),
            target(f"sum by (stream) (increase(ray_babelcast_audio_gap_fill_seconds_total"
                   f"{{{S}}}[5m]))", "{{stream}} filler s"),
            target(f"sum by (stream) (increase("
                   f"ray_babelcast_late_audio_dropped_seconds_total{{{S}}}[5m]))",
                   "{{stream}} real audio dropped s")], unit="short", w=12,
            thresholds=steps(OK, ("red", 0.5)),
            description="Per 5 minutes. Dropped is real audio that came after filler had "
                        "taken its time: it should stay 0."),
        panel("timeseries", "Source silent (filler only) and stall threshold", [
            target(f"max by (stream) (ray_babelcast_source_silent_seconds{{{S}}})",
                   "{{stream}} fed only filler"),
            target(f"max by (stream) (ray_babelcast_stall_threshold_seconds{{{S}}})",
                   "{{stream}} stall threshold")], unit="s", w=12,
            thresholds=steps(OK, ("red", 5)),
            description="Above 0 the room's source is lost (status: source lost). The "
                        "threshold rises for transports that deliver in bursts."),
        row("Translations"),
        panel("timeseries", "Translation lag p95 per language", [target(
            p95("ray_babelcast_translation_lag_seconds", "stream, lang", f"{S},{L}"),
            "{{stream}} → {{lang}}")], unit="s",
            thresholds=steps(OK, ("red", TRANSLATION_SLO_S))),
        panel("timeseries", "Translations per second", [target(
            f"sum by (stream, lang) (rate(ray_babelcast_translations_total{{{S},{L}}}"
            f"[{RI}]))", "{{stream}} → {{lang}}")], unit="cps"),
    ])


def translation() -> dict[str, Any]:
    return dashboard("babelcast-translation", "Babelcast — translation",
                     "The job queue, lag per language, cost and errors per backend.", [
        row("Queue"),
        panel("timeseries", "Jobs in the queue", [target(
            "max by (state) (ray_babelcast_translation_queue_jobs)", "{{state}}")],
            unit="short", thresholds=steps(OK, ("orange", 50))),
        panel("timeseries", "Oldest job", [target(
            "max(ray_babelcast_translation_queue_oldest_age_seconds)", "oldest")], unit="s",
            thresholds=steps(OK, ("orange", 10), ("red", 30))),
        row("Lag"),
        panel("timeseries", "Lag p95 per language", [target(
            p95("ray_babelcast_translation_lag_seconds", "lang", f"{S},{L}"), "{{lang}}")],
            unit="s", thresholds=steps(OK, ("red", TRANSLATION_SLO_S))),
        panel("timeseries", "Lag p50 per backend", [target(
            p95("ray_babelcast_translation_lag_seconds", "backend", f"{S},{L}", 0.5),
            "{{backend}}")], unit="s"),
        row("Throughput, cost and errors"),
        panel("timeseries", "Translations per second", [target(
            f"sum by (lang, backend) (rate(ray_babelcast_translations_total{{{S},{L}}}"
            f"[{RI}]))", "{{lang}} ({{backend}})")], unit="cps", w=8),
        panel("timeseries", "Characters per second by backend", [target(
            f"sum by (backend, kind) (rate(ray_babelcast_translation_chars_total[{RI}]))",
            "{{backend}} {{kind}}")], unit="short", w=8,
            description="source: what metered APIs bill; prompt: what was sent, context and "
                        "instructions included."),
        panel("stat", "Characters in the time range", [target(
            'sum by (backend) (increase(ray_babelcast_translation_chars_total{kind="source"}'
            '[$__range]))', "{{backend}}", instant=True)], unit="short", w=8,
            options={"colorMode": "none"}),
        panel("timeseries", "Errors by backend", [target(
            f"sum by (backend) (rate(ray_babelcast_translation_errors_total{{{S},{L}}}"
            f"[{RI}]))", "{{backend}}")], unit="cps", thresholds=steps(OK, ("red", 0.01))),
        panel("timeseries", "Requests by backend", [target(
            f"sum by (backend) (rate(ray_babelcast_translation_requests_total[{RI}]))",
            "{{backend}}")], unit="reqps"),
    ])


def delivery() -> dict[str, Any]:
    return dashboard("babelcast-delivery", "Babelcast — delivery",
                     "Caption clients, messages, slow-client drops and outputs.", [
        row("Clients"),
        panel("timeseries", "Clients connected", [target(
            f"sum by (stream, lang) (babelcast_gateway_clients{{{S},{L}}})",
            "{{stream}} {{lang}}")], unit="short", decimals=0),
        panel("timeseries", "Messages sent per second", [target(
            f"sum by (stream, lang) (rate(babelcast_gateway_messages_total{{{S},{L}}}"
            f"[{RI}]))", "{{stream}} {{lang}}")], unit="cps"),
        panel("timeseries", "Interims dropped for slow clients", [target(
            f"sum(rate(babelcast_gateway_slow_client_drops_total[{RI}]))", "all clients")],
            unit="cps",
            thresholds=steps(OK, ("orange", 0.1)),
            description="Finals are never dropped; interims are when a client reads slowly."),
        panel("timeseries", "Capture → send p95", [target(
            p95("babelcast_gateway_caption_delivery_seconds", "stream, kind", S),
            "{{stream}} {{kind}}")], unit="s", thresholds=steps(OK, ("red", FINAL_SLO_S))),
        row("Ingest and Redis"),
        panel("timeseries", "Push frames", [
            target(f"sum by (stream) (rate(babelcast_push_audio_frames_total{{{S}}}[{RI}]))",
                   "{{stream}} frames/s"),
            target(f"sum by (stream) (rate(babelcast_push_bad_frames_total{{{S}}}[{RI}]))",
                   "{{stream}} rejected/s")], unit="short", w=8),
        panel("timeseries", "Redis errors", [target(
            f"sum by (component) (increase(babelcast_redis_errors_total[{RI}]))",
            "{{component}}")], unit="short", w=8, thresholds=steps(OK, ("red", 1))),
        panel("timeseries", "Undecodable bus messages", [target(
            f"sum by (component) (increase(babelcast_undecodable_messages_total[{RI}]))",
            "{{component}}")], unit="short", w=8),
        row("Outputs"),
        panel("timeseries", "Archive cues per minute", [target(
            f"sum by (stream, lang) (rate(babelcast_archive_cues_total{{{S},{L}}}[{RI}])) * 60",
            "{{stream}} {{lang}}")], unit="short", w=8),
        panel("timeseries", "YouTube posts", [target(
            f"sum by (stream, lang, result) (rate(babelcast_youtube_posts_total{{{S},{L}}}"
            f"[{RI}]))", "{{stream}} {{lang}} {{result}}")], unit="reqps", w=8),
        panel("timeseries", "YouTube backlog and output errors", [
            target(f"sum by (stream, lang) (babelcast_youtube_backlog_finals{{{S},{L}}})",
                   "{{stream}} {{lang}} backlog"),
            target(f"sum by (output) (increase(babelcast_output_errors_total[{RI}]))",
                   "{{output}} errors")], unit="short", w=8),
    ])


DASHBOARDS = {"fleet": fleet, "room": room, "translation": translation, "delivery": delivery}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, build in DASHBOARDS.items():
        path = HERE / f"{name}.json"
        text = render(build)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/build.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
