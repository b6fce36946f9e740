"""Which pods the operator's SLO guard measures (slo_tick.scope_for), checked as regexes the way Prometheus
applies them (fully anchored)."""
from __future__ import annotations

import re

from kvtier_operator.slo_tick import scope_for


def pod_regex(status, spec=None):
    scope = scope_for("ns", status, (spec or {"slo": {}})["slo"].get("modelName"))
    return (None, None) if scope is None else (scope.pod_regex, scope.matchers())


def anchored(regex):
    return lambda name: re.fullmatch(f"(?:{regex})", name) is not None


def test_no_applied_target_queries_nothing_instead_of_the_whole_namespace():
    for targets in ([], [{"kind": "Deployment", "name": "llm", "state": "Conflict"}],
                    [{"kind": "Deployment", "name": "llm", "state": "Refused"}]):
        for spec in (None, {"slo": {"modelName": "qwen"}}):
            assert scope_for("ns", {"targets": targets}, (spec or {"slo": {}})["slo"].get("modelName")) is None


def test_target_pods_match_and_pods_of_a_longer_named_workload_do_not():
    regex, _ = pod_regex({"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"},
                                      {"kind": "StatefulSet", "name": "db.v2", "state": "MissingConfigArgument"}]})
    match = anchored(regex)
    assert match("llm-7d9f8c6b5-x2x4q") and match("db.v2-0") and match("db.v2-12")
    assert not match("llm-big-7d9f8c6b5-x2x4q")   # Deployment llm-big's pod
    assert not match("llm-big-0")                  # StatefulSet llm-big's pod
    assert not match("dbxv2-0")                    # the dot is literal


def test_model_name_narrows_the_policy_pods_and_never_replaces_them():
    # A model name alone matched every workload serving that model, other policies' and other teams' too.
    regex, matchers = pod_regex({"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"}]},
                                {"slo": {"modelName": "qwen"}})
    assert matchers == ['namespace="ns"', f'pod=~"{regex}"', 'model_name="qwen"']
    assert anchored(regex)("llm-7d9f8c6b5-x2x4q") and not anchored(regex)("other-7d9f8c6b5-x2x4q")


def test_the_guard_sends_no_query_and_says_so_when_no_target_carries_the_configuration():
    from kvtier_operator.api.validation import parse_policy
    from kvtier_operator.settings import Settings
    from kvtier_operator.slo_tick import evaluate
    from plugins.operator import policy

    class Source:
        def __init__(self):
            self.asked = []

        def measure(self, queries):
            self.asked.append(queries)
            raise AssertionError("no query may be sent without a target")

        def close(self):
            pass

    for slo in ({"modelName": "qwen"}, {}):
        pol = policy(slo={"prometheus": {"url": "https://prometheus.monitoring:9090"}, "ttftP99": "2s", **slo})
        source = Source()
        step = evaluate(None, Settings(), pol, parse_policy(pol).spec, [], source)
        assert source.asked == [] and step.state is None and step.events == []
        [cond] = step.conditions
        assert (cond.type, cond.status, cond.reason) == ("SLOUnknown", "True", "NoTargets")
        assert "queries nothing" in cond.message


def test_without_targets_no_secret_is_read_and_the_allowlist_is_still_reported_first():
    from kvtier_operator.api.validation import parse_policy
    from kvtier_operator.settings import Settings
    from kvtier_operator.slo_tick import evaluate
    from plugins.operator import policy

    class NoKube:  # any read of a Secret (or anything) fails the test
        def __getattr__(self, name):
            raise AssertionError(f"kube.{name} called without a target to measure")

    pol = policy(slo={"prometheus": {"url": "https://prometheus.monitoring:9090",
                                     "auth": {"bearerToken": {"name": "prom-token", "key": "token"}}},
                      "ttftP99": "2s", "modelName": "qwen"})
    spec = parse_policy(pol).spec
    allowed = Settings(prometheus_allowed=("prometheus.monitoring:9090",))
    step = evaluate(NoKube(), allowed, pol, spec, [])
    assert [c.reason for c in step.conditions] == ["NoTargets"]
    refused = evaluate(NoKube(), Settings(), pol, spec, [])
    assert "not a Prometheus endpoint the operator's admin allows" in refused.problem
