"""One writer, one status (status_writer.write_status) against the real API server: a 409 caused by a write that
left the spec alone (kopf's bookkeeping, a label) is re-sent against the fresh object at once; a 409 from a spec
change is raised, so the next pass plans from the new spec."""
from __future__ import annotations

import pytest
from kvtier_operator.kube import ApiError, policy_path
from kvtier_operator.metrics import Metrics
from kvtier_operator.status import compose
from kvtier_operator.status_writer import write_status
from plugins.operator import create_policy, get_policy, make_policy

pytestmark = [pytest.mark.controlplane]


def cond(type_, status="True", reason="R", at="2026-12-01T00:00:00Z"):
    return {"type": type_, "status": status, "reason": reason, "message": "", "lastTransitionTime": at}


def test_compose_keeps_what_the_pass_did_not_compute_and_drops_the_retired_history():
    old = {"observedGeneration": 1, "targets": [{"kind": "Deployment", "name": "llm", "state": "Applied",
                                                 "message": ""}],
           "sloState": "OK", "slo": {"verdict": "ok", "history": [{"tier": "nvme"}]},
           "history": [{"tier": "nvme"}], "kopf": {"progress": {}}}
    new = compose(old, {"observedGeneration": 2, "conditions": [cond("Ready")]})
    assert new["observedGeneration"] == 2 and new["targets"] == old["targets"] and new["sloState"] == "OK"
    assert new["slo"] == old["slo"]  # history lives in status.slo.history only
    assert new["history"] is None  # removed by the merge patch
    assert "kopf" not in new  # kopf's own bookkeeping is never sent by the operator


def test_a_409_from_a_write_that_left_the_spec_alone_is_resent(kube, namespace):
    create_policy(kube, make_policy("llm", namespace))
    pol = get_policy(kube, namespace, "llm")
    raced = []

    def label_first(method, path):
        if not raced and path.endswith("/status"):
            raced.append(path)
            kube.patch(policy_path(namespace, "llm"), {"metadata": {"labels": {"touched": "yes"}}})

    kube.before_write = label_first
    try:
        metrics = Metrics()
        status = compose(pol.get("status") or {}, {"observedGeneration": 1, "conditions": [cond("Ready")]})
        assert write_status(kube, metrics, pol, status)
    finally:
        kube.before_write = None
    stored = get_policy(kube, namespace, "llm")
    assert raced and metrics.value("kvtier_operator_reconcile_errors_total", {"reason": "StatusConflict"}) == 1
    assert stored["status"]["observedGeneration"] == 1 and stored["metadata"]["labels"]["touched"] == "yes"
    # The same status again: nothing to write.
    assert not write_status(kube, metrics, stored, status)


def test_a_409_from_a_spec_change_is_raised_for_the_next_pass(kube, namespace):
    create_policy(kube, make_policy("llm", namespace))
    pol = get_policy(kube, namespace, "llm")
    spec = dict(pol["spec"])
    spec["tiers"] = [{**spec["tiers"][0], "size": "20Gi"}]
    kube.patch(policy_path(namespace, "llm"), {"spec": spec})
    with pytest.raises(ApiError) as err:
        write_status(kube, Metrics(), pol, {"observedGeneration": 1})
    assert err.value.status == 409
