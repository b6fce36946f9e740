"""Two writers, one status (status_writer.write_status) against the real API server: a 409 caused by the other
writer is resolved by laying this writer's fields and condition types over the fresh object, never by erasing
what the other one wrote in between."""
from __future__ import annotations

import pytest

from kvtier_operator.kube import ApiError, policy_path
from kvtier_operator.metrics import Metrics
from kvtier_operator.status import CONDITION_TYPES, overlay_conditions
from kvtier_operator.status_writer import write_status

from plugins.operator import create_policy, get_policy, make_policy

pytestmark = [pytest.mark.controlplane]


def cond(type_, status="True", reason="R", at="2026-12-01T00:00:00Z"):
    return {"type": type_, "status": status, "reason": reason, "message": "", "lastTransitionTime": at}


def test_overlay_keeps_foreign_types_and_order():
    current = [cond("SLOUnknown"), cond("Ready", "False")]
    assert overlay_conditions(current, [cond("Ready"), cond("Conflict", "False")]) == [
        cond("SLOUnknown"), cond("Ready"), cond("Conflict", "False")]


def test_a_conflicting_guard_write_survives_the_reconciles_retry(kube, namespace):
    create_policy(kube, make_policy("llm", namespace))
    pol = get_policy(kube, namespace, "llm")
    raced = []

    def guard_writes_first(method, path):
        if not raced and path.endswith("/status"):
            raced.append(path)
            fresh = get_policy(kube, namespace, "llm")
            kube.patch(policy_path(namespace, "llm", status=True),
                       {"metadata": {"resourceVersion": fresh["metadata"]["resourceVersion"]},
                        "status": {"sloState": "Unknown", "conditions": [cond("SLOUnknown")]}})

    kube.before_write = guard_writes_first
    try:
        fields = {"observedGeneration": 1, "conditions": [cond("Ready"), cond("Conflict", "False")]}
        metrics = Metrics()
        assert write_status(kube, metrics, pol, fields, lambda fresh: True, conditions=CONDITION_TYPES)
    finally:
        kube.before_write = None
    status = get_policy(kube, namespace, "llm")["status"]
    assert raced and metrics.value("kvtier_operator_reconcile_errors_total", {"reason": "StatusConflict"}) == 1
    assert [c["type"] for c in status["conditions"]] == ["SLOUnknown", "Ready", "Conflict"]
    assert status["sloState"] == "Unknown" and status["observedGeneration"] == 1


def test_a_changed_basis_raises_the_conflict_for_the_caller(kube, namespace):
    create_policy(kube, make_policy("llm", namespace))
    pol = get_policy(kube, namespace, "llm")
    kube.patch(policy_path(namespace, "llm", status=True), {"status": {"sloState": "OK"}})
    with pytest.raises(ApiError) as err:
        write_status(kube, Metrics(), pol, {"observedGeneration": 1}, lambda fresh: False)
    assert err.value.status == 409
