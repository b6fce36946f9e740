"""SLOSettings derived from the API models (the one parser of spec.slo / spec.rollout), and PromQL building;
every rejection names its field and rule, in the API's words."""
from __future__ import annotations

import pytest
from kvtier_operator.api.units import parse_duration
from kvtier_operator.slo import Scope, SLOSpecError, build_queries
from kvtier_operator.slo.queries import promql_duration
from plugins.slo_harness import slo_settings


def spec(slo=None, rollout=None, tiers=("host", "nvme")):
    declared = [{"name": t, "medium": "cpu", "size": "1Gi"} if i == 0 else
                {"name": t, "medium": "filesystem", "size": "10Gi", "path": f"/mnt/{t}{i}", "volume": {"emptyDir": {}}}
                for i, t in enumerate(tiers)]
    out = {"selector": {"matchLabels": {"app": "llm"}}, "tiers": declared,
           "slo": {"prometheus": {"url": "http://prometheus.monitoring:9090"}, "ttftP99": "2s", **(slo or {})}}
    if rollout is not None:
        out["rollout"] = rollout
    return out


def drop_none(d):
    return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def test_issue_example_parses_to_seconds():
    s = slo_settings(spec({"itlP99": "150ms", "window": "5m", "interval": "30s", "consecutiveBreaches": 3,
                                    "onNoData": "hold", "minRequestRate": 0.2, "cooldown": "15m",
                                    "reenable": {"mode": "auto", "after": "1h"}, "dryRun": False},
                                   {"strategy": "staged", "stageObservation": "30m"}))
    assert (s.ttft_p99_s, s.itl_p99_s, s.window_s, s.interval_s, s.cooldown_s) == (2, 0.15, 300, 30, 900)
    assert (s.reenable_mode, s.reenable_after_s, s.probation_s) == ("auto", 3600, 1800)
    assert (s.rollout_strategy, s.stage_observation_s, s.tiers) == ("staged", 1800, ("host", "nvme"))
    assert s.prometheus.url == "http://prometheus.monitoring:9090"


@pytest.mark.parametrize("slo,rollout,expected", [
    ({"window": "5x"}, None, "spec.slo.window: '5x' does not match"),
    ({"consecutiveBreaches": 0}, None, "spec.slo.consecutiveBreaches: 0: Input should be greater than or equal to 1"),
    ({"onNoData": "ignore"}, None, "spec.slo.onNoData: 'ignore': Input should be 'hold' or 'breach'"),
    ({"minRequestRate": -1}, None, "spec.slo.minRequestRate: -1: Input should be greater than or equal to 0"),
    ({"reenable": {"mode": "sometimes"}}, None, "spec.slo.reenable.mode: 'sometimes': Input should be"),
    ({"dryRun": "maybe"}, None, "spec.slo.dryRun: 'maybe': Input should be a valid boolean"),
    ({"prometheus": {"url": "prometheus:9090"}}, None, "spec.slo.prometheus.url: 'prometheus:9090' does not match"),
    ({"prometheus": None}, None, "spec.slo.prometheus: required"),
    ({"ttftP99": None}, None, "spec.slo: an SLO needs at least one of ttftP99, itlP99"),
    ({"ttftP99MaxRatio": 1.2}, None, "spec.slo: relative thresholds (ttftP99MaxRatio, itlP99MaxRatio) need"),
    ({"ttftP99MaxRatio": 1}, {"strategy": "staged"}, "spec.slo.ttftP99MaxRatio: 1: Input should be greater than 1"),
    ({"prometheus": {"url": "http://p:9090", "auth": {"username": {"name": "s", "key": "u"}}}}, None,
     "spec.slo.prometheus.auth: username and password go together"),
    ({"prometheus": {"url": "http://p:9090", "auth": {"bearerToken": {"name": "s"}}}}, None,
     "spec.slo.prometheus.auth.bearerToken.key: required"),
    ({"queries": {"p50": "up"}}, None, "spec.slo.queries.p50: unknown field"),
    ({}, {"strategy": "canary"}, "spec.rollout.strategy: 'canary': Input should be 'immediate' or 'staged'"),
    ({}, {"stageObservation": "forever"}, "spec.rollout.stageObservation: 'forever' does not match"),
])
def test_rejections_name_the_field_and_the_rule(slo, rollout, expected):
    with pytest.raises(SLOSpecError) as info:
        slo_settings(drop_none(spec(slo, rollout)))
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems


def test_all_problems_are_reported_at_once():
    with pytest.raises(SLOSpecError) as info:
        slo_settings(spec({"window": "x", "interval": "y"}))
    assert len(info.value.problems) == 2, info.value.problems


def test_defaults_are_the_models():
    from kvtier_operator.api import v1alpha1 as api

    s = slo_settings(spec())
    slo = api.SLOSpec.model_validate({"prometheus": {"url": "http://p:9090"}, "ttftP99": "1s"})
    assert (s.window_s, s.interval_s, s.cooldown_s) == tuple(parse_duration(v) for v in
                                                               (slo.window, slo.interval, slo.cooldown))
    assert (s.reenable_after_s, s.probation_s) == (parse_duration(slo.reenable.after),
                                                   parse_duration(slo.reenable.probation))
    assert s.stage_observation_s == parse_duration(api.RolloutSpec().stage_observation)
    assert s.history_limit == api.HISTORY_LIMIT  # status.slo.history, trimmed by the guard (evaluate)


def test_durations():
    assert parse_duration("1h30m") == 5400 and parse_duration("150ms") == 0.15
    assert promql_duration(300) == "5m" and promql_duration(2.5) == "2500ms" and promql_duration(3600) == "1h"
    with pytest.raises(ValueError):
        parse_duration("-1s")


def test_vllm_queries_match_both_spellings_and_scope_the_targets():
    q = build_queries("vllm", Scope(namespace="llm", pods=["llama-1", "llama-0"]), 300)
    assert q.ttft_p99 == ('histogram_quantile(0.99, sum by (le) (rate({__name__=~"vllm[:_]time_to_first_token_'
                          'seconds_bucket", namespace="llm", pod=~"llama-0|llama-1"}[5m])))')
    assert '__name__=~"vllm[:_]inter_token_latency_seconds_bucket"' in q.itl_p99
    assert q.request_rate.startswith('sum(rate({__name__=~"vllm[:_]e2e_request_latency_seconds_count"')


def test_trtllm_queries_and_model_name_scope():
    q = build_queries("trtllm", Scope(namespace="llm", model_name='we"ird\\name'), 60)
    assert '__name__=~"trtllm[:_]time_per_output_token_seconds_bucket"' in q.itl_p99
    assert 'model_name="we\\"ird\\\\name"' in q.ttft_p99 and "[1m]" in q.ttft_p99


def test_overrides_replace_one_query_and_keep_the_scope():
    q = build_queries("vllm", Scope(namespace="llm"), 30,
                      {"ttftP99": "max(my_ttft_p99{$selector}[$window])"})
    assert q.ttft_p99 == 'max(my_ttft_p99{namespace="llm"}[30s])'
    assert "vllm[:_]inter_token_latency_seconds_bucket" in q.itl_p99


def test_bad_scope_and_engine_are_errors():
    with pytest.raises(ValueError, match="engine: 'sglang'"):
        build_queries("sglang", Scope(), 60)
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        build_queries("vllm", Scope(extra_labels={"bad-label": "x"}), 60)


def test_scope_narrows_by_model_name_and_never_widens_to_the_namespace():
    from kvtier_operator.slo_tick import scope_for

    applied = {"targets": [{"kind": "StatefulSet", "name": "b", "state": "Applied"},
                           {"kind": "StatefulSet", "name": "a", "state": "Applied"}]}
    model = slo_settings(spec({"modelName": "llama-70b"})).model_name
    assert scope_for("llm", applied, model).matchers() == [
        'namespace="llm"', 'pod=~"a-[0-9]+|b-[0-9]+"', 'model_name="llama-70b"']
    assert scope_for("llm", applied, slo_settings(spec()).model_name).matchers() == [
        'namespace="llm"', 'pod=~"a-[0-9]+|b-[0-9]+"']
    # No pods yet: nothing is queried, rather than every pod in the namespace or of the model.
    assert scope_for("llm", {"targets": []}, model) is None
