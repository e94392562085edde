"""The Grafana dashboard (cluster/dashboards/raylm.json) queries only metrics raylm exports.

Every metric name in every panel query must be one that Ray's metrics endpoint serves for a
metric defined in ``cluster/metrics.py`` (or one of a few verified Ray Serve built-ins), and
every raylm metric must be shown somewhere. Renaming a metric in ``cluster/metrics.py``
without updating the dashboard fails here. No Ray cluster is needed: only the JSON and the
name tables are read.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from raylm.cluster.metrics import ROUTER_METRICS, WORKER_METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "dashboards" / "raylm.json"

# Ray Serve's own metrics the dashboard uses (replica counts). Both seen in Ray 2.60's
# metrics endpoint with a Serve deployment running, with `application` and `deployment`
# labels (and `replica` on the healthy gauge).
RAY_BUILTIN_METRICS = {
    "ray_serve_deployment_replica_healthy",
    "ray_serve_autoscaling_target_replicas",
}

# Metrics only some replicas export (no panel is required for them, though one may show them).
OPTIONAL_METRICS = {"raylm_device_memory_used_bytes"}


def exported_names(name: str, kind: str) -> set[str]:
    """The series names Ray's Prometheus endpoint serves for a ``ray.util.metrics`` metric.

    Verified against Ray 2.60.0 by scraping ``ray.init(_metrics_export_port=...)``'s
    ``/metrics`` after an actor recorded one metric of each kind:
    - every name gets the ``ray_`` prefix;
    - a Counter gets ``_total`` appended unless its name already ends in ``_total``
      (``raylm_x_total`` -> ``ray_raylm_x_total``; ``raylm_x`` -> ``ray_raylm_x_total``);
    - a Histogram is served as ``_bucket`` (with ``le``), ``_sum`` and ``_count``, appended to
      the full name even when it ends in ``_total`` (``ray_raylm_iteration_tokens_total_bucket``);
    - a Gauge keeps its name;
    - tag keys become labels of the same name, next to Ray's own ``Component``,
      ``NodeAddress``, ``SessionName``, ``Version``, ``WorkerId`` and ``otel_scope_*``.
    """
    base = "ray_" + name
    if kind == "counter":
        return {base if base.endswith("_total") else base + "_total"}
    if kind == "histogram":
        return {base + suffix for suffix in ("_bucket", "_sum", "_count")}
    assert kind == "gauge", f"unknown metric kind {kind!r} for {name}"
    return {base}


def exported_table(tables: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Exported series name -> the raylm metric it comes from."""
    return {series: name for name, (kind, _) in tables.items() for series in exported_names(name, kind)}


# --------------------------------------------------------------------------- PromQL names

PROMQL_FUNCTIONS = {
    # aggregation operators
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10", "minute", "month",
    "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label",
    "sort_by_label_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time", "mad_over_time",
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh",
    "deg", "rad", "pi",
    # Grafana's Prometheus template-variable functions
    "label_values", "label_names", "metrics", "query_result",
}
PROMQL_KEYWORDS = {"and", "or", "unless", "atan2", "bool", "offset", "start", "end", "inf", "nan",
                   "group_left", "group_right"}  # the last two may stand without a label list
# Clauses whose parenthesised list holds label names, not metrics.
_LABEL_LIST_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_TOKEN = re.compile(r"(?P<num>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*\b"  # durations: offset 1h30m
                    r"|0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
                    r"|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects; raises on a call to an unknown function."""
    # Grafana's label_values(metric, label) / label_values(label): only a metric selector counts.
    expr = re.sub(r"^\s*label_values\s*\(\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$", "", expr)
    expr = re.sub(r"^\s*label_values\s*\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$", r"\1", expr)
    expr = _STRING.sub('""', expr)  # label values, regexes ($model_name lives here)
    expr = re.sub(r"\{[^{}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\[\]]*\]", "", expr)  # range / subquery selectors: [5m], [$__rate_interval]
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)  # any Grafana variable left outside strings
    expr = re.sub(r"#.*", "", expr)  # comments
    expr = _LABEL_LIST_CLAUSE.sub(" ", expr)
    names = set()
    for match in _TOKEN.finditer(expr):
        ident = match.group("id")
        if ident is None:
            continue
        if match.group("call"):
            if ident.lower() not in PROMQL_FUNCTIONS:
                raise ValueError(f"unknown PromQL function {ident!r} in {expr!r}")
            continue
        if ident.lower() in PROMQL_KEYWORDS or ident.lower() in PROMQL_FUNCTIONS:
            continue
        names.add(ident)
    return names


# --------------------------------------------------------------------------- dashboard walk


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def iter_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query template variable."""
    queries = [(f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"])
               for p in iter_panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            queries.append((f"variable {var['name']!r}", query))
    return queries


def unknown_metric_refs(dashboard: dict, tables: dict[str, tuple[str, str]]) -> list[str]:
    """Queries naming a metric that neither raylm nor the Ray built-in allow-list exports."""
    known = set(exported_table(tables)) | RAY_BUILTIN_METRICS
    return [f"{where}: {name}" for where, expr in dashboard_queries(dashboard)
            for name in sorted(promql_metric_names(expr)) if name not in known]


def metrics_without_panel(dashboard: dict, tables: dict[str, tuple[str, str]]) -> list[str]:
    """raylm metrics that no panel query shows."""
    used = set()
    for _, expr in dashboard_queries(dashboard):
        used |= promql_metric_names(expr)
    by_series = exported_table(tables)
    shown = {by_series[name] for name in used if name in by_series}
    return sorted(set(tables) - shown - OPTIONAL_METRICS)


ALL_METRICS = {**WORKER_METRICS, **ROUTER_METRICS}


# --------------------------------------------------------------------------- tests


def test_parser_finds_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model_name) '
        '(rate(ray_raylm_ttft_bucket{model_name=~"$model_name", le!="+Inf"}[$__rate_interval])))'
    ) == {"ray_raylm_ttft_bucket"}
    assert promql_metric_names(
        "sum without (WorkerId) (rate(a_total[5m] offset 1h)) / on (model_name) group_left (replica) "
        "count(b{x='y'}) > bool 1e3 or vector(0) and max_over_time(c[1m:10s])"
    ) == {"a_total", "b", "c"}
    assert promql_metric_names("label_values(ray_raylm_num_requests_running, model_name)") == {
        "ray_raylm_num_requests_running"}
    assert promql_metric_names('label_values(ray_raylm_x{replica="r"}, model_name)') == {"ray_raylm_x"}
    assert promql_metric_names("label_values(model_name)") == set()
    with pytest.raises(ValueError, match="unknown PromQL function"):
        promql_metric_names("rat(ray_raylm_generation_tokens_total[1m])")


def test_naming_rule():
    assert exported_names("raylm_generation_tokens_total", "counter") == {"ray_raylm_generation_tokens_total"}
    assert exported_names("raylm_requests", "counter") == {"ray_raylm_requests_total"}
    assert exported_names("raylm_num_requests_running", "gauge") == {"ray_raylm_num_requests_running"}
    assert exported_names("raylm_iteration_tokens_total", "histogram") == {
        "ray_raylm_iteration_tokens_total_bucket", "ray_raylm_iteration_tokens_total_sum",
        "ray_raylm_iteration_tokens_total_count"}


def test_dashboard_is_grafana_structure():
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert variables["model_name"]["datasource"]["uid"] == "${datasource}"

    ids = set()
    occupied: set[tuple[int, int]] = set()
    panels = list(iter_panels(dashboard["panels"]))
    assert len([p for p in panels if p["type"] != "row"]) >= 15
    for panel in panels:
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        assert panel.get("title"), panel
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            assert "targets" not in panel
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel["targets"]
        assert targets, f"panel {panel['title']!r} has no targets"
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"] == panel["datasource"], panel["title"]
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert promql_metric_names(expr), f"{panel['title']!r}: no metric in {expr!r}"
            if "ray_raylm_" in expr:
                # raylm series are filtered by the model variable.
                assert 'model_name=~"$model_name"' in expr, f"{panel['title']!r}: {expr!r}"


def test_dashboard_queries_only_exported_metrics():
    assert unknown_metric_refs(load_dashboard(), ALL_METRICS) == []


def test_every_metric_has_a_panel():
    assert metrics_without_panel(load_dashboard(), ALL_METRICS) == []


def test_histograms_are_queried_as_exported():
    """histogram_quantile must read a ``_bucket`` series, grouped by ``le``."""
    for where, expr in dashboard_queries(load_dashboard()):
        for match in re.finditer(r"histogram_quantile\(\s*[0-9.]+\s*,(.*)", expr):
            inner = match.group(1)
            assert re.search(r"by \([^)]*\ble\b", inner), f"{where}: {expr}"
            assert "_bucket{" in inner, f"{where}: {expr}"


@pytest.mark.parametrize("old", ["raylm_time_to_first_token_seconds", "raylm_generation_tokens_total",
                                 "raylm_router_queue_depth"])
def test_renaming_a_metric_breaks_the_check(old):
    """A metric renamed in cluster/metrics.py (here in a copy of its tables) is caught both ways."""
    tables = copy.deepcopy(ALL_METRICS)
    tables[old.replace("raylm_", "raylm_renamed_", 1)] = tables.pop(old)
    dashboard = load_dashboard()
    assert any(old in ref for ref in unknown_metric_refs(dashboard, tables))
    assert old.replace("raylm_", "raylm_renamed_", 1) in metrics_without_panel(dashboard, tables)


def test_changing_a_metric_kind_breaks_the_check():
    """A counter turned into a gauge/histogram changes its exported names: caught too."""
    tables = copy.deepcopy(ALL_METRICS)
    tables["raylm_router_queue_time_seconds"] = ("gauge", "")
    assert any("ray_raylm_router_queue_time_seconds_bucket" in ref
               for ref in unknown_metric_refs(load_dashboard(), tables))


def test_a_typo_in_the_dashboard_is_caught():
    dashboard = load_dashboard()
    target = next(p for p in iter_panels(dashboard["panels"]) if p["type"] != "row")["targets"][0]
    target["expr"] = target["expr"].replace("ray_raylm_", "ray_raylm_typo_")
    assert unknown_metric_refs(dashboard, ALL_METRICS)


def test_offload_tiers_are_never_summed_together():
    """A host tier's hits and a cluster tier's are different things: every aggregation in a query
    of a KV offload metric keeps ``tier``."""
    queries = [(where, expr) for where, expr in dashboard_queries(load_dashboard()) if "ray_raylm_kv_offload_" in expr]
    assert queries
    aggregation = re.compile(r"\b(?:sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile)\s*"
                             r"(?:(by|without)\s*\(([^()]*)\))?\s*\(")
    for where, expr in queries:
        groups = aggregation.findall(expr)
        assert groups and all(clause == "by" and re.search(r"\btier\b", labels) for clause, labels in groups), \
            f"{where}: {expr}"
