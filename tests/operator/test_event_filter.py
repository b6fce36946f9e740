"""Which watch events wake a policy (event_filter.py)."""
from __future__ import annotations

from kvtier_operator.event_filter import EventFilter
from kvtier_operator.settings import REENABLE_ANNOTATION

SEL = {"matchLabels": {"app": "llm"}}


def meta(generation=1, rv="1", **extra):
    return {"generation": generation, "resourceVersion": rv, **extra}


def test_a_policy_wakes_on_spec_selector_annotation_and_deletion_only():
    f, key = EventFilter(), ("ns", "p")
    first = f.policy(key, "ADDED", meta(), SEL)
    assert first is not None and first.retargeted and not first.known and first.old_selector is None
    assert f.policy(key, "MODIFIED", meta(rv="2", finalizers=["kvtier.io/finalizer"]), SEL) is None  # kopf's patch
    assert f.policy(key, "MODIFIED", meta(rv="3", labels={"x": "y"}), SEL) is None                  # a label
    spec = f.policy(key, "MODIFIED", meta(generation=2, rv="4"), SEL)
    assert spec is not None and not spec.retargeted                          # same selector: no neighbour changes
    ann = f.policy(key, "MODIFIED", meta(generation=2, rv="5", annotations={REENABLE_ANNOTATION: "nvme"}), SEL)
    assert ann is not None and not ann.retargeted
    moved = f.policy(key, "MODIFIED", meta(generation=3, rv="6"), {"matchLabels": {"app": "other"}})
    assert moved is not None and moved.retargeted and moved.old_selector == SEL
    gone = f.policy(key, "DELETED", meta(generation=3, rv="7"), None)
    assert gone is not None and gone.known and gone.old_selector == {"matchLabels": {"app": "other"}}
    unknown = f.policy(("ns", "never-seen"), "DELETED", meta(), None)
    assert unknown is not None and not unknown.known


def test_workload_echo_status_change_and_delete():
    f, key = EventFilter(), ("ns", "Deployment", "llm")
    assert f.workload(key, "ADDED", meta(labels={"app": "llm"})) == "change"
    f.wrote(key, "7")   # the operator's apply: new generation, its label
    labels = {"app": "llm", "kvtier.io/policy": "p"}
    assert f.workload(key, "MODIFIED", meta(generation=2, rv="7", labels=labels)) == "echo"
    # The controller catching up: only the flip of "rolled out" is worth a reconcile (Progressing).
    assert f.workload(key, "MODIFIED", meta(generation=2, rv="8", labels=labels)) == "quiet"
    assert f.workload(key, "MODIFIED", meta(generation=2, rv="9", labels=labels), rolled_out=True) == "status"
    assert f.workload(key, "MODIFIED", meta(generation=2, rv="10", labels=labels), rolled_out=True) == "quiet"
    assert f.workload(key, "MODIFIED", meta(generation=3, rv="11", labels=labels), rolled_out=True) == "change"
    assert f.workload(key, "MODIFIED", meta(generation=3, rv="12", labels={"app": "x"}), rolled_out=True) == "change"
    assert f.workload(key, "DELETED", meta(generation=3, rv="7", labels={"app": "x"})) == "deleted"
    assert not f.remembers(key)
    # After a delete nothing is remembered: a re-created workload with an old resourceVersion is no echo.
    assert f.workload(key, "ADDED", meta(rv="7", labels={"app": "x"})) == "change"


def test_a_rollout_of_many_status_updates_wakes_its_policy_once():
    from kvtier_operator.workload import Workload

    f, key = EventFilter(), ("ns", "Deployment", "llm")
    obj = {"kind": "Deployment", "metadata": {"generation": 2, "resourceVersion": "7", "labels": {}},
           "spec": {"replicas": 2}, "status": {"observedGeneration": 1}}
    f.wrote(key, "7")
    assert f.workload(key, "MODIFIED", obj["metadata"], Workload(obj).rolled_out()) == "echo"
    wakes = []
    for rv, status in enumerate([{"observedGeneration": 2}, {"observedGeneration": 2, "updatedReplicas": 1},
                                 {"observedGeneration": 2, "updatedReplicas": 2},
                                 {"observedGeneration": 2, "updatedReplicas": 2, "availableReplicas": 1},
                                 {"observedGeneration": 2, "updatedReplicas": 2, "availableReplicas": 2}], 8):
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}, "status": status}
        wakes.append(f.workload(key, "MODIFIED", obj["metadata"], Workload(obj).rolled_out()))
    assert wakes == ["quiet", "quiet", "status", "quiet", "quiet"]
