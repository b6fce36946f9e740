"""Which policies an event wakes (handlers.to_wake, neighbours, concerned): pure, tested without kopf.

Two classes of defect: a wake-up missing (a policy whose plan changed is not re-planned) and routing work that
grows with the number of policies for events that concern one (quadratic over a burst of new policies: the
scale benchmark's p99 at 500 policies).
"""
from __future__ import annotations

import pytest
from kvtier_operator import handlers
from kvtier_operator.labels import OPT_IN_ANY, OPT_IN_LABEL
from kvtier_operator.settings import POLICY_LABEL


def sel(app):
    return {"matchLabels": {"app": app}}


def policies(n):
    return [{"name": f"p{i}", "selector": sel(f"w{i}")} for i in range(n)]


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = handlers.matches

    def counting(selector, labels):
        calls.append(1)
        return real(selector, labels)

    monkeypatch.setattr(handlers, "matches", counting)
    return calls


def test_a_status_only_event_wakes_the_configuring_policy_without_matching_every_policy(counted):
    labels = {"app": "w7", OPT_IN_LABEL: "p7", POLICY_LABEL: "p7"}
    assert handlers.concerned("status", labels, policies(500)) == ["p7"]
    assert counted == []  # O(1), whatever the number of policies
    assert handlers.concerned("status", {"app": "w7"}, policies(500)) == []  # configured by nobody: nobody


def test_a_spec_or_label_change_wakes_every_policy_selecting_it_and_the_one_it_names():
    labels = {"app": "w3", POLICY_LABEL: "old"}
    assert handlers.concerned("change", labels, policies(5)) == ["old", "p3"]
    assert handlers.concerned("deleted", labels, policies(5)) == ["old", "p3"]


def test_neighbours_are_only_policies_a_shared_workload_opted_in_to():
    ps = [{"name": "a", "selector": sel("x")}, {"name": "b", "selector": sel("x")},
          {"name": "c", "selector": sel("y")}]
    workloads = [{"app": "x", OPT_IN_LABEL: "a"},          # opted in to a only: b can never be a's rival here
                 {"app": "y", OPT_IN_LABEL: OPT_IN_ANY}]   # opted in to any: a (selecting it now) and c are rivals
    both = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["x", "y"]}]}
    assert handlers.neighbours("a", None, both, ps, workloads) == ["c"]
    assert handlers.neighbours("a", None, sel("x"), ps, workloads) == []


def test_a_new_policy_among_many_single_opt_in_workloads_matches_nothing_per_other_policy(counted):
    ps = policies(500)
    workloads = [{"app": f"w{i}", OPT_IN_LABEL: f"p{i}"} for i in range(500)]
    assert handlers.to_wake("p1", "ADDED", False, True, None, sel("w1"), ps, workloads) == ["p1"]
    assert counted == []


def test_deletions():
    ps = policies(3)
    # Seen before: its neighbours (none here), not itself.
    assert handlers.to_wake("p0", "DELETED", True, True, sel("w0"), None, ps, []) == []
    # Never seen (deleted while the operator was down): the namespace, so conflicts it held are re-planned.
    assert handlers.to_wake("p0", "DELETED", False, True, None, None, ps, []) == ["p0", "p1", "p2"]
