"""The Grafana dashboard shipped with the chart: the panels the issue asks for, and only exported metric names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from chart.exported_metrics import OPERATOR, RUNTIME, allowed_series
from chart.promql_names import UncheckableName, metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvtier" / "files" / "grafana-dashboard.json"


def _panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard):
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            # label_values(metric, label)
            yield f"variable {variable['name']}", query.removeprefix("label_values(").split(",")[0]


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def test_dashboard_references_only_exported_metric_names(dashboard):
    allowed = allowed_series()
    unknown = {(title, name) for title, expr in _exprs(dashboard) for name in metric_names(expr)
               if name not in allowed}
    assert unknown == set(), "not exported (see tests/chart/exported_metrics.py)"


def test_the_check_catches_an_unknown_name_and_an_open_regex():
    assert metric_names('sum(rate(kvtier_runtime_hitz_total[5m]))') - allowed_series() == {"kvtier_runtime_hitz_total"}
    assert {"vllm:prefix_cache_hits_total", "vllm_prefix_cache_hits_total"} == metric_names(
        'rate({__name__=~"vllm[:_]prefix_cache_hits_total"}[1m])')
    with pytest.raises(UncheckableName):
        metric_names('rate({__name__=~"vllm.*"}[1m])')


@pytest.mark.parametrize("words, metric", [
    ("hit", "kvtier_runtime_hits_total"),
    ("promotions", "kvtier_runtime_promotions_total"),
    ("p99 time to first token", "vllm_time_to_first_token_seconds_bucket"),
    ("p99 inter-token latency", "vllm_inter_token_latency_seconds_bucket"),
    ("rollbacks", "kvtier_operator_tier_rollbacks_total"),
    ("remote tier", "kvtier_runtime_remote_misses_total"),
])
def test_required_panels_exist(dashboard, words, metric):
    matching = [p for p in _panels(dashboard) if words in p["title"].lower()]
    assert matching, f"no panel titled with {words!r}"
    assert any(metric in metric_names(t["expr"]) for p in matching for t in p["targets"])


@pytest.mark.parametrize("words, variable, default", [("p99 time to first token", "ttft_budget", "2"),
                                                      ("p99 inter-token latency", "itl_budget", "0.15")])
def test_latency_panels_show_the_threshold(dashboard, words, variable, default):
    # The operator exports no per-policy threshold, so the budget is a dashboard variable whose default is the
    # PrometheusRule's alert threshold.
    (panel,) = [p for p in _panels(dashboard) if words in p["title"].lower()]
    assert f"vector(${variable})" in [t["expr"] for t in panel["targets"]]
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == variable]
    assert var["query"] == default
    rules = (DASHBOARD.parent / "prometheus-rules.yaml").read_text()
    assert f"> {default}\n" in rules
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_latency_queries_match_both_metric_name_spellings(dashboard):
    # Prometheus 2.x stores vLLM's vllm:* series as vllm_* (OpenMetrics escaping); the dashboard must find both.
    vllm = [expr for _, expr in _exprs(dashboard) if "vllm" in expr]
    assert vllm and all('__name__=~"vllm[:_]' in expr for expr in vllm)


def test_panels_have_unique_ids_and_datasource_variable(dashboard):
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "namespace"}
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"


# ---------------------------------------------------------------------------------------------- the real exporters


def _families(registry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


def test_operator_list_is_what_the_operator_exports():
    import kvtier_operator.metrics as module

    exported = _families(module.Metrics().registry)
    # prometheus_client names a counter family without its _total suffix.
    assert {name: kind for name, kind in exported.items()} == OPERATOR


def test_runtime_list_is_what_the_runtime_exports():
    import kvtier_runtime.metrics as module
    from prometheus_client.metrics import MetricWrapperBase
    exported = {m._name: m._type for m in vars(module).values() if isinstance(m, MetricWrapperBase)}
    assert exported == RUNTIME
