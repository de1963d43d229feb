"""A PromQL reader that checks queries against the metric catalog, and its own tests.

Dashboards (tests/test_dashboards.py) and alert rules (tests/test_prometheus_rules.py)
run every query through `problems`: each series must be one the code exports (a
catalog metric as Prometheus stores it, `ray_` prefix included), each label in a
matcher must be one that series carries, and each `by (...)` label must be on every
series it aggregates. Syntax is checked by `promtool` in those tests; this reads
names only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from orchestrator.metric_catalog import TARGET_LABELS, series_labels

pytestmark = pytest.mark.unit

OTHER_SERIES = {"up": TARGET_LABELS}
"""Series Prometheus itself makes that alerts may use."""
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATORS = {"and", "or", "unless", "bool", "offset"}
FUNCTIONS = {
    "abs", "absent", "avg", "avg_over_time", "ceil", "clamp_max", "clamp_min", "count",
    "count_over_time", "delta", "deriv", "floor", "histogram_quantile", "increase", "irate",
    "label_replace", "label_values", "max", "max_over_time", "min", "min_over_time", "rate",
    "resets", "round", "scalar", "sort", "sort_desc", "sum", "sum_over_time", "time",
    "timestamp", "topk", "bottomk", "vector", "quantile", "changes", "last_over_time",
}

_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<punct>[(){},])
  | (?P<op>[-+*/%^=!~<>]+)
  | (?P<space>\s+)
""", re.VERBOSE)


@dataclass(frozen=True, slots=True)
class Tok:
    kind: str
    text: str


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    labels: tuple[str, ...]
    at: int  # token index


def tokens(expr: str) -> list[Tok]:
    # Range and subquery windows ([5m], [$__rate_interval], [1h:1m]) carry no names.
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "space":
            out.append(Tok(kind, m.group()))
    return out


def _close(toks: list[Tok], i: int, open_: str = "(", close: str = ")") -> int:
    """Index of the token closing the bracket at `i`."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j].text == open_:
            depth += 1
        elif toks[j].text == close:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced brackets")


def problems(expr: str) -> list[str]:
    """What is wrong with the names in `expr` (empty: nothing)."""
    toks = tokens(expr)
    found: list[str] = []
    selectors: list[Selector] = []
    groupings: list[tuple[str, tuple[str, ...], int, int]] = []  # keyword, labels, at, end
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1].text if i + 1 < len(toks) else ""
        if t.kind != "id":
            i += 1
            continue
        if t.text in GROUPING and nxt == "(":
            end = _close(toks, i + 1)
            labels = tuple(x.text for x in toks[i + 2:end] if x.kind == "id")
            groupings.append((t.text, labels, i, end))
            i = end + 1
        elif t.text in FUNCTIONS and nxt in GROUPING:  # `sum by (x) (...)`
            i += 1
        elif nxt == "(":
            if t.text not in FUNCTIONS:
                found.append(f"unknown function {t.text}()")
            i += 1
        elif t.text in OPERATORS:
            i += 1
        elif nxt == "{":
            end = _close(toks, i + 1, "{", "}")
            inner = toks[i + 2:end]
            labels = tuple(x.text for k, x in enumerate(inner)
                           if x.kind == "id" and (k + 1 < len(inner))
                           and inner[k + 1].kind == "op")
            selectors.append(Selector(t.text, labels, i))
            i = end + 1
        else:
            selectors.append(Selector(t.text, (), i))
            i += 1
    allowed: dict[int, tuple[str, ...]] = {}
    for s in selectors:
        known = series_labels(s.name)
        if known is None and s.name not in OTHER_SERIES:
            found.append(f"{s.name} is not a metric Babelcast exports "
                         "(orchestrator/metric_catalog.py; actor metrics are ray_babelcast_*)")
            continue
        labels = known[1] if known else OTHER_SERIES[s.name]
        allowed[s.at] = labels
        for label in s.labels:
            if label != "__name__" and label not in labels:
                found.append(f"{s.name} has no label {label!r} (it has {', '.join(labels)})")
    for keyword, labels, at, end in groupings:
        if keyword in ("by", "without"):
            # The series aggregated: `agg by (x) (args)`, or `agg (args) by (x)`.
            if end + 1 < len(toks) and toks[end + 1].text == "(":
                lo, hi = end + 1, _close(toks, end + 1)
            else:
                hi, depth, lo = at - 1, 0, 0
                for j in range(hi, -1, -1):  # back to the bracket that `hi` closes
                    depth += {")": 1, "(": -1}.get(toks[j].text, 0)
                    if depth == 0:
                        lo = j
                        break
            scope = [s for s in selectors if lo <= s.at <= hi and s.at in allowed]
        else:
            scope = [s for s in selectors if s.at in allowed]
        for label in labels:
            missing = [s.name for s in scope if label not in allowed[s.at]]
            if keyword in ("by", "without") and missing:
                found.append(f"{keyword} ({label}): {', '.join(missing)} has no such label")
            elif keyword not in ("by", "without") and len(missing) == len(scope):
                found.append(f"{keyword} ({label}): no series here has that label")
    if not selectors:
        found.append("the query reads no series")
    return found


# -- the checker itself ------------------------------------------------------------------


def test_checker_accepts_catalog_series_with_their_labels() -> None:
    assert problems(
        'histogram_quantile(0.95, sum by (stream, le) (rate('
        'ray_babelcast_caption_latency_seconds_bucket{kind="final",stream=~"$stream"}'
        '[$__rate_interval])))') == []
    assert problems('time() - max by (stream) (ray_babelcast_last_caption_timestamp_seconds)'
                    ) == []
    assert problems('sum by (actor) (babelcast_streams_placed) / on (actor) '
                    'sum by (actor) (babelcast_streams_budget)') == []
    assert problems('up{job="ray"} == 0') == []


def test_checker_finds_unknown_metrics_and_the_missing_ray_prefix() -> None:
    assert "babelcast_rollovers_total is not" in problems(
        "sum(rate(babelcast_rollovers_total[5m]))")[0]
    assert "is not a metric" in problems("ray_babelcast_nonexistent_total")[0]
    # _bucket exists only on histograms.
    assert problems("ray_babelcast_rollovers_total_bucket")


def test_checker_finds_labels_a_series_does_not_have() -> None:
    assert problems('ray_babelcast_rollovers_total{lang="pt"}') == [
        "ray_babelcast_rollovers_total has no label 'lang' (it has stream, reason, "
        "Component, NodeAddress, SessionName, Version, WorkerId, instance, job)"]
    assert problems("sum by (lang) (rate(ray_babelcast_captions_published_total[5m]))") == [
        "by (lang): ray_babelcast_captions_published_total has no such label"]
    # `le` is a bucket's label only.
    assert problems("sum by (le) (ray_babelcast_caption_latency_seconds_count)")


def test_checker_finds_misspelt_functions_and_empty_queries() -> None:
    assert problems("rates(ray_babelcast_rollovers_total[5m])") == [
        "unknown function rates()"]
    assert problems("1 + 1") == ["the query reads no series"]


def test_checker_scopes_by_to_the_aggregated_series_in_either_form() -> None:
    ok = "sum(rate(ray_babelcast_rollovers_total[5m])) by (reason)"
    assert problems(ok) == []
    bad = ("sum(rate(ray_babelcast_captions_published_total[5m])) by (reason) "
           "+ on () sum(ray_babelcast_rollovers_total)")
    assert problems(bad) == [
        "by (reason): ray_babelcast_captions_published_total has no such label"]
