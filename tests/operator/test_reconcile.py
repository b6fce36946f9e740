"""The reconcile's decisions, on objects shaped as the API server returns them (no cluster needed)."""
from __future__ import annotations

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.selectors import matches, to_query
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, POLICY_LABEL
from kvtier_operator.status import Cond, condition, merge_conditions, status_patch
from kvtier_operator.workload import has_config_args, without_config_args
from plugins.operator import TRTLLM_IMAGE, deployment, nvme_tier, observed, policy

NOW = "2026-11-29T08:00:00Z"
LATER = "2026-11-29T09:00:00Z"


def cond(plan: rc.Plan, type_: str) -> dict:
    c = condition(plan.status, type_)
    assert c is not None, type_
    return c


def test_applies_only_map_keyed_items_and_annotations():
    p = rc.plan(policy(tiers=[{"name": "cpu", "medium": "cpu", "size": "16Gi"}, nvme_tier()]),
                [observed(deployment())], [], now=NOW, host_path_prefixes=("/mnt/disks",))
    [t] = p.targets
    assert t.state == rc.APPLIED and t.args_update is None
    body = t.apply
    assert set(body) == {"apiVersion", "kind", "metadata", "spec"}
    assert body["metadata"]["labels"] == {POLICY_LABEL: "llm"}
    template = body["spec"]["template"]
    assert template["metadata"]["annotations"] == {CONFIG_HASH_ANNOTATION: t.config_hash}
    pod = template["spec"]
    assert set(pod) == {"containers", "volumes", "initContainers"}
    [c] = pod["containers"]
    assert set(c) == {"name", "volumeMounts"}  # no args, no resources: the user owns those
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/etc/kvtier", "/dev/shm", "/mnt/nvme"}
    assert {v["name"] for v in pod["volumes"]} == {"kvtier-config", "kvtier-shm", "kvtier-tier-nvme"}
    shm = next(v for v in pod["volumes"] if v["name"] == "kvtier-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": str(17 * 2**30)}
    [init] = pod["initContainers"]
    assert "vllm_offload_*.mmap" in init["command"][-1]
    assert p.config_map["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "engine.yaml" in p.config_map["data"]
    assert cond(p, "Ready")["status"] == "True"
    assert cond(p, "Ready")["observedGeneration"] == 1


def test_config_hash_is_stable_and_follows_the_spec():
    a = rc.plan(policy(), [observed(deployment())], [], now=NOW).targets[0].config_hash
    b = rc.plan(policy(), [observed(deployment())], [], now=LATER).targets[0].config_hash
    c = rc.plan(policy(tiers=[{"name": "cpu", "medium": "cpu", "size": "32Gi"}]), [observed(deployment())], [],
                now=NOW).targets[0].config_hash
    assert a == b != c


def test_two_policies_on_one_workload_both_report_conflict_and_neither_applies():
    wl = observed(deployment(labels={"app": "llm", "team": "a"}))
    p1 = policy("one", selector={"matchLabels": {"app": "llm"}})
    p2 = policy("two", selector={"matchLabels": {"team": "a"}}, uid="uid-2")
    for mine, other in ((p1, p2), (p2, p1)):
        p = rc.plan(mine, [wl], [other], now=NOW)
        [t] = p.targets
        assert t.state == rc.CONFLICT and t.apply is None and not t.remove
        other_name = other["metadata"]["name"]
        assert other_name in t.message
        assert cond(p, "Conflict")["status"] == "True"
        assert cond(p, "Ready")["status"] == "False"
        assert any(e.type == "Warning" and e.reason == "SelectedByAnotherPolicy" for e in p.events)


def test_missing_config_argument_names_the_exact_argument():
    p = rc.plan(policy(), [observed(deployment(args=["--model", "m"]))], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.MISSING_ARG
    assert '"--config /etc/kvtier/engine.yaml"' in t.message and "'vllm'" in t.message
    assert t.apply is None and t.config_hash is None  # nothing is applied until the owner adds the argument
    assert cond(p, "Degraded")["reason"] == rc.MISSING_ARG


def test_config_argument_may_use_equals_form():
    assert has_config_args({"args": ["--config=/etc/kvtier/engine.yaml"]}, ["--config", "/etc/kvtier/engine.yaml"])


def test_trtllm_needs_extra_llm_api_options():
    p = rc.plan(policy(), [observed(deployment(image=TRTLLM_IMAGE, args=["--model", "m"]))], [], now=NOW)
    assert '"--extra_llm_api_options /etc/kvtier/engine.yaml"' in p.targets[0].message


def test_managed_args_adds_and_release_removes_the_argument():
    pol = policy(injection={"args": "managed"})
    wl = observed(deployment(args=["--model", "m"]))
    p = rc.plan(pol, [wl], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.APPLIED
    assert t.args_update["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "args": ["--model", "m", "--config", "/etc/kvtier/engine.yaml"]}]
    assert t.args_update["metadata"]["resourceVersion"] == "100"
    applied = observed(deployment(args=["--model", "m", "--config", "/etc/kvtier/engine.yaml"]))
    applied["metadata"]["labels"][POLICY_LABEL] = "llm"
    [r] = rc.release_plan(pol, [applied])
    assert r.remove and r.args_update["spec"]["template"]["spec"]["containers"][0]["args"] == ["--model", "m"]
    assert without_config_args(["a", "--config", "x", "b"], ["--config", "x"]) == ["a", "b"]


def test_events_topic_argument_is_asked_for_added_when_managed_and_taken_back_at_release():
    """spec.events: the pod's KV event topic is an argument (kv@$(KVTIER_POD_IP)@<namespace>/<model>: the kubelet
    expands the pod IP the operator's env carries), asked of the owner like --config, in any order and place among
    the args; managed args gain it and lose it again at release."""
    events = {"enabled": True, "model": "llama"}
    topic = ["--kv-events-config.topic", "kv@$(KVTIER_POD_IP)@default/llama"]
    p = rc.plan(policy(events=events), [observed(deployment(args=["--model", "m", "--config",
                                                                    "/etc/kvtier/engine.yaml"]))], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.MISSING_ARG and "kv@$(KVTIER_POD_IP)@default/llama" in t.message
    given = [f"{topic[0]}={topic[1]}", "--model", "m", "--config", "/etc/kvtier/engine.yaml"]
    [t] = rc.plan(policy(events=events), [observed(deployment(args=given))], [], now=NOW).targets
    assert t.state == rc.APPLIED
    env = t.apply["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KVTIER_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    pol = policy(events=events, injection={"args": "managed"})
    [t] = rc.plan(pol, [observed(deployment(args=["--model", "m"]))], [], now=NOW).targets
    added = ["--model", "m", "--config", "/etc/kvtier/engine.yaml", *topic]
    assert t.args_update["spec"]["template"]["spec"]["containers"] == [{"name": "vllm", "args": added}]
    applied = observed(deployment(args=added))
    applied["metadata"]["labels"][POLICY_LABEL] = "llm"
    [r] = rc.release_plan(pol, [applied])
    assert r.args_update["spec"]["template"]["spec"]["containers"][0]["args"] == ["--model", "m"]


def test_headroom_refusal_gives_the_numbers():
    wl = observed(deployment(memory_request="8Gi", memory_limit="20Gi"))
    p = rc.plan(policy(), [wl], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.REFUSED and t.apply is None
    for number in ("8Gi", "16Gi", "1Gi", "25Gi", "20Gi", "argocd-controller"):
        assert number in t.message
    assert cond(p, "Degraded")["reason"] == rc.REFUSED


def test_headroom_against_node_allocatable_without_a_limit():
    wl = observed(deployment(memory_request="8Gi", memory_limit=None))
    assert rc.plan(policy(), [wl], [], now=NOW, node_allocatable=64 * 2**30).targets[0].state == rc.APPLIED
    t = rc.plan(policy(), [wl], [], now=NOW, node_allocatable=24 * 2**30).targets[0]
    assert t.state == rc.REFUSED and "24Gi" in t.message and "25Gi" in t.message


def test_memory_limit_nobody_else_owns_is_raised_by_the_operator():
    wl = observed(deployment(memory_request="8Gi", memory_limit="20Gi"))
    wl["metadata"]["managedFields"] = []  # e.g. the limit is ours from an earlier apply, or unowned
    t = rc.plan(policy(), [wl], [], now=NOW).targets[0]
    assert t.state == rc.APPLIED
    assert t.apply["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"memory": "25Gi"}}


def test_user_limit_big_enough_is_left_alone():
    t = rc.plan(policy(), [observed(deployment(memory_limit="64Gi"))], [], now=NOW).targets[0]
    assert "resources" not in t.apply["spec"]["template"]["spec"]["containers"][0]


def test_invalid_policy_is_a_condition():
    bad = policy(tiers=[nvme_tier()])  # the first tier must be cpu (a CEL rule)
    p = rc.plan(bad, [observed(deployment())], [], now=NOW)
    assert p.invalid and p.targets == [] and p.config_map is None
    assert cond(p, "Degraded")["reason"] == "InvalidPolicy"
    assert "spec.tiers" in cond(p, "Degraded")["message"]


def test_engine_specific_rule_on_a_detected_engine_is_a_target_error():
    p = rc.plan(policy(backend="lmcache"), [observed(deployment(image=TRTLLM_IMAGE))], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.ERROR and "lmcache" in t.message and t.apply is None


def test_unmatched_workload_with_our_label_is_released():
    wl = observed(deployment(labels={"app": "other", POLICY_LABEL: "llm"}))
    p = rc.plan(policy(), [wl], [], now=NOW)
    [t] = p.targets
    assert t.remove and t.state == rc.RELEASED
    assert p.status["targets"] == []
    assert cond(p, "Ready")["reason"] == "NoTargets"


def test_only_enabled_tiers_are_rendered():
    tiers = [{"name": "cpu", "medium": "cpu", "size": "16Gi"}, nvme_tier()]
    status = {"tiers": [{"name": "cpu", "state": "Enabled", "reason": "Enabled", "since": NOW},
                        {"name": "nvme", "state": "Disabled", "reason": "SLOBreach", "since": NOW}]}
    p = rc.plan(policy(tiers=tiers, status=status), [observed(deployment())], [], now=LATER,
                host_path_prefixes=("/mnt/disks",))
    assert p.status["activeTiers"] == "cpu"
    assert p.status["tiers"] == status["tiers"]  # the guard's decisions are kept as they are
    mounts = p.targets[0].apply["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert "/mnt/nvme" not in {m["mountPath"] for m in mounts}


def test_staged_rollout_starts_with_tiers_pending():
    pol = policy(tiers=[{"name": "cpu", "medium": "cpu", "size": "16Gi"}], rollout={"strategy": "staged"},
                 slo={"prometheus": {"url": "http://prom:9090"}, "ttftP99": "2s"})
    p = rc.plan(pol, [observed(deployment())], [], now=NOW)
    assert p.status["tiers"][0]["state"] == "Pending" and p.status["activeTiers"] == "none"
    assert "shm" not in str(p.targets[0].apply)


def test_status_is_unchanged_on_a_second_identical_reconcile():
    first = rc.plan(policy(), [observed(deployment())], [], now=NOW)
    again = rc.plan(policy(status=first.status), [observed(deployment())], [], now=LATER)
    assert status_patch(first.status, again.status) is None
    assert [e.reason for e in again.events] == []


def test_condition_transition_time_moves_only_on_a_flip():
    old = merge_conditions([], [Cond("Ready", "True", "Applied", "a")], 1, NOW)
    same = merge_conditions(old, [Cond("Ready", "True", "Applied", "b")], 2, LATER)
    flipped = merge_conditions(old, [Cond("Ready", "False", "Refused", "c")], 2, LATER)
    assert same[0]["lastTransitionTime"] == NOW and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == LATER
    kept = merge_conditions([{"type": "SLOUnknown", "status": "True", "reason": "x", "lastTransitionTime": NOW}],
                            [Cond("Ready", "True", "Applied")], 1, NOW)
    assert [c["type"] for c in kept] == ["SLOUnknown", "Ready"]
    reordered = merge_conditions(kept, [Cond("Ready", "True", "Applied")], 1, LATER)
    assert [c["type"] for c in reordered] == ["SLOUnknown", "Ready"] and reordered == kept


def test_named_container_missing_is_an_error():
    t = rc.plan(policy(container="engine"), [observed(deployment())], [], now=NOW).targets[0]
    assert t.state == rc.ERROR and "'engine' not found (containers: vllm)" in t.message


def test_statefulsets_are_targets_too():
    t = rc.plan(policy(), [observed(deployment(kind="StatefulSet"))], [], now=NOW).targets[0]
    assert t.kind == "StatefulSet" and t.apply["kind"] == "StatefulSet"


@pytest.mark.parametrize("labels,expected", [
    ({"app": "llm", "tier": "gold"}, True), ({"app": "llm", "tier": "bronze"}, False),
    ({"app": "llm"}, False), ({"app": "llm", "tier": "gold", "canary": "1"}, False)])
def test_selector_matching(labels, expected):
    sel = {"matchLabels": {"app": "llm"},
           "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "silver"]},
                                {"key": "canary", "operator": "DoesNotExist"}]}
    assert matches(sel, labels) is expected
    assert to_query(sel) == "app=llm,tier in (gold,silver),!canary"
    assert matches({}, labels) is False


def test_a_workload_already_carrying_the_configuration_is_not_written_again():
    first = rc.plan(policy(), [observed(deployment())], [], now=NOW).targets[0]
    # The workload as the server returns it after our apply: our items merged in, quantities canonical,
    # and an Apply entry for our manager.
    stored = observed(deployment())
    body = first.apply
    stored["metadata"]["labels"].update(body["metadata"]["labels"])
    stored["spec"]["template"]["metadata"]["annotations"] = dict(body["spec"]["template"]["metadata"]["annotations"])
    pod, ours = stored["spec"]["template"]["spec"], body["spec"]["template"]["spec"]
    pod["volumes"] = [dict(v) for v in ours["volumes"]]
    next(v for v in pod["volumes"] if v["name"] == "kvtier-shm")["emptyDir"] = {"medium": "Memory",
                                                                               "sizeLimit": "17Gi"}
    pod["initContainers"] = ours["initContainers"]
    pod["containers"][0]["volumeMounts"] = ours["containers"][0]["volumeMounts"]
    stored["metadata"]["managedFields"].append({"manager": "kvtier-operator", "operation": "Apply",
                                                "fieldsType": "FieldsV1", "fieldsV1": {}})
    again = rc.plan(policy(), [stored], [], now=NOW).targets[0]
    assert again.apply is None and again.unchanged and again.state == rc.APPLIED
    assert again.config_hash == first.config_hash
    # A mount removed by someone else is put back.
    pod["containers"][0]["volumeMounts"] = pod["containers"][0]["volumeMounts"][1:]
    assert rc.plan(policy(), [stored], [], now=NOW).targets[0].apply is not None


def test_status_patch_nulls_keys_that_disappear():
    old = {"slo": {"disabled": {"nvme": {"since": "t"}}, "verdict": "breach"}, "engine": "vllm"}
    new = {"slo": {"disabled": {}, "verdict": "ok"}, "engine": "vllm"}
    assert status_patch(old, new) == {"slo": {"disabled": {"nvme": None}, "verdict": "ok"}}
    assert status_patch(old, {"engine": None}) == {"engine": None}
    assert status_patch(new, new) is None


def test_a_refusal_is_posted_as_one_event_not_one_per_condition():
    # The memory limit is the user's field and too small for request + cpu tier + headroom: Ready goes False and
    # Degraded True with the same reason and message; a user reading `kubectl get events` sees it once.
    wl = observed(deployment(memory_request="48Gi", memory_limit="48Gi"))
    p = rc.plan(policy(tiers=[{"name": "cpu", "medium": "cpu", "size": "32Gi"}]), [wl], [], now=NOW)
    assert cond(p, "Ready")["status"] == "False" and cond(p, "Degraded")["status"] == "True"
    warnings = [e for e in p.events if e.type == "Warning"]
    assert len(warnings) == 1, warnings
    assert "81Gi" in warnings[0].message


# kstatus (Flux's health checks, `kubectl wait`-style tools) reads a policy as Failed only through a Stalled
# condition; with Ready False alone it reads "in progress" and waits out its timeout.
@pytest.mark.parametrize("case", ["invalid", "refused", "missing-arg", "not-opted-in", "conflict"])
def test_what_waits_for_a_person_is_stalled(case):
    wl = observed(deployment())
    others: list = []
    if case == "invalid":
        mine = policy(tiers=[nvme_tier()])
    elif case == "refused":
        mine, wl = policy(), observed(deployment(memory_request="8Gi", memory_limit="20Gi"))
    elif case == "missing-arg":
        mine, wl = policy(), observed(deployment(args=["--model", "m"]))
    elif case == "not-opted-in":
        mine, wl = policy(), observed(deployment(opt_in=None))
    else:
        wl = observed(deployment(labels={"app": "llm", "team": "a"}))
        mine = policy("one", selector={"matchLabels": {"app": "llm"}})
        others = [policy("two", selector={"matchLabels": {"team": "a"}}, uid="uid-2")]
    p = rc.plan(mine, [wl], others, now=NOW)
    stalled = cond(p, "Stalled")
    assert stalled["status"] == "True" and stalled["message"], stalled
    assert stalled["reason"] in (cond(p, "Ready")["reason"], cond(p, "Degraded")["reason"], rc.CONFLICT)


def test_applied_and_no_targets_are_not_stalled():
    applied = rc.plan(policy(), [observed(deployment())], [], now=NOW)
    assert cond(applied, "Ready")["status"] == "True"
    assert cond(applied, "Stalled")["status"] == "False"
    # A workload may still be on its way (Git applies both at once): Ready False, not Stalled.
    empty = rc.plan(policy(), [], [], now=NOW)
    assert cond(empty, "Ready")["status"] == "False" and cond(empty, "Stalled")["status"] == "False"
