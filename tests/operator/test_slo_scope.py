"""Which pods the operator's SLO guard measures (slo_tick.scope_for), checked as regexes the way Prometheus
applies them (fully anchored)."""
from __future__ import annotations

import re

from kvtier_operator.slo_tick import scope_for


def pod_regex(status, spec=None):
    scope = scope_for("ns", status, (spec or {"slo": {}})["slo"].get("modelName"))
    return scope.pod_regex, scope.matchers()


def anchored(regex):
    return lambda name: re.fullmatch(f"(?:{regex})", name) is not None


def test_no_applied_target_matches_no_pod_instead_of_the_whole_namespace():
    for targets in ([], [{"kind": "Deployment", "name": "llm", "state": "Conflict"}],
                    [{"kind": "Deployment", "name": "llm", "state": "Refused"}]):
        regex, matchers = pod_regex({"targets": targets})
        assert matchers == ['namespace="ns"', 'pod=~"$^"'], targets
        assert not anchored(regex)("llm-7d9f8c6b5-x2x4q")


def test_target_pods_match_and_pods_of_a_longer_named_workload_do_not():
    regex, _ = pod_regex({"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"},
                                      {"kind": "StatefulSet", "name": "db.v2", "state": "MissingConfigArgument"}]})
    match = anchored(regex)
    assert match("llm-7d9f8c6b5-x2x4q") and match("db.v2-0") and match("db.v2-12")
    assert not match("llm-big-7d9f8c6b5-x2x4q")   # Deployment llm-big's pod
    assert not match("llm-big-0")                  # StatefulSet llm-big's pod
    assert not match("dbxv2-0")                    # the dot is literal


def test_model_name_wins_over_pod_names():
    _, matchers = pod_regex({"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"}]},
                            {"slo": {"modelName": "qwen"}})
    assert matchers == ['namespace="ns"', 'model_name="qwen"']
