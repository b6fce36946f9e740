"""Least privilege, round two (issue 24): each class of weakness the adversarial probe found, on the real API
server, as the low-privilege author "mallory" of test_least_privilege (KVCachePolicy objects in one namespace,
nothing else). Each test names its class; the operator runs with the chart's trust settings as in
tests/plugins/operator.py unless a test says otherwise.

A. a path check before normalisation       B. adopting a foreign object
C. conflict before opt-in                  D. a URL allowlist on raw text
E. progress the author can write           F. unbounded output and oracles
"""
from __future__ import annotations

import json
import re
import time

import pytest
from kvtier_operator.kube import ApiError, config_map_path, policy_path
from kvtier_operator.settings import POLICY_LABEL
from plugins.operator import (
    cond,
    deployment,
    get_policy,
    get_workload,
    make_policy,
    template_hash,
    user_apply,
    wait_applied,
    wait_for,
)
from security.test_least_privilege import (  # noqa: F401 - fixtures
    AUTHOR,
    CPU,
    _slo_policy,
    _token_secret,
    author,
    listener,
)

pytestmark = pytest.mark.controlplane


def _disk(path: str, name: str = "disk", volume: dict | None = None) -> dict:
    return {"name": name, "medium": "filesystem", "size": "1Gi", "path": path, "volume": volume or {"emptyDir": {}}}


def _refused(author, namespace: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as refused:
        author.create(policy_path(namespace), body)
    assert refused.value.status == 422, refused.value
    return refused.value


# ---------------------------------------------------------------------------------------------- A

@pytest.mark.parametrize("tiers, field", [
    # The probe's case: '//' passed the system-path rule, and the renderer mounted the tier over the token.
    ([CPU, _disk("/var//run/secrets/kubernetes.io/serviceaccount")], "spec.tiers[1].path"),
    ([CPU, _disk("/var/lib//kubelet")], "spec.tiers[1].path"),
    ([CPU, _disk("/mnt/kv/")], "spec.tiers[1].path"),
    # Two spellings of one directory: the policy was stuck, retried forever without status.
    ([CPU, _disk("/mnt/kv", "a"), _disk("/mnt//kv", "b")], "spec.tiers[2].path"),
    ([CPU, _disk("/mnt/k", volume={"hostPath": {"path": "/mnt/disks//kv"}})], "spec.tiers[1].volume.hostPath.path"),
])
def test_class_a_paths_are_judged_in_normal_form_never_normalised(namespace, author, tiers, field):
    error = _refused(author, namespace, make_policy("p", namespace, backend="kvtier", tiers=tiers))
    assert field in error.message and "normal form" in error.message, error.message


# ---------------------------------------------------------------------------------------------- B

def test_class_b_a_foreign_config_map_is_neither_adopted_nor_deleted(kube, namespace, author, run_operator):
    path = config_map_path(namespace, "kvtier-llm")
    kube.create(f"/api/v1/namespaces/{namespace}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kvtier-llm", "labels": {"team": "db"}},
        "data": {"db.conf": "precious"}})
    before = kube.get(path)
    wl_before = user_apply(kube, deployment("llm", namespace))  # opted in, with the config argument
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace, engine="vllm"))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Ready").get("reason") == "ForeignObject" and p, 30, what="Ready ForeignObject")
    assert "ConfigMap kvtier-llm" in cond(pol, "Degraded")["message"]
    events = wait_for(lambda: [e for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
                               if e.get("reason") == "ForeignObject" and e.get("type") == "Warning"], 15,
                      what="a Warning Event")
    assert events
    time.sleep(1)
    after = kube.get(path)
    assert after["data"] == before["data"] and after["metadata"].get("labels") == {"team": "db"}
    assert not after["metadata"].get("ownerReferences")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # never written
    # No workload is pointed at someone else's ConfigMap either.
    assert get_workload(kube, namespace, "llm")["spec"]["template"] == wl_before["spec"]["template"]
    author.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="the policy deleted")
    time.sleep(1)
    assert kube.get(path)["data"] == {"db.conf": "precious"}


# ---------------------------------------------------------------------------------------------- C

def test_class_c_a_policy_not_opted_in_to_neither_conflicts_nor_freezes(kube, namespace, author, run_operator):
    user_apply(kube, deployment("llm", namespace, opt_in="owner"))  # the owner chose policy "owner"
    run_operator()
    selector = {"matchLabels": {"app": "llm"}}
    kube.create(policy_path(namespace), make_policy("owner", namespace, selector=selector))
    _, wl = wait_applied(kube, namespace, "owner", "llm")
    author.create(policy_path(namespace), make_policy("intruder", namespace, selector=selector))
    wait_for(lambda: cond(get_policy(kube, namespace, "intruder"), "Ready").get("reason") == "NotOptedIn", 30,
             what="the intruder NotOptedIn")
    time.sleep(1)
    owner = get_policy(kube, namespace, "owner")
    assert cond(owner, "Conflict").get("status") == "False", cond(owner, "Conflict")
    assert [t["state"] for t in owner["status"]["targets"]] == ["Applied"]  # its SLO scope keeps the workload
    # The owner's later change still reaches the workload.
    kube.request("PATCH", policy_path(namespace, "owner"), body={"spec": {"tiers": [{**CPU, "size": "2Gi"}]}},
                 content_type="application/merge-patch+json")
    wait_for(lambda: template_hash(get_workload(kube, namespace, "llm")) not in (None, template_hash(wl)), 30,
             what="the owner's change applied")


@pytest.mark.parametrize("selector", [
    {"matchExpressions": [{"key": "unused", "operator": "DoesNotExist"}]},
    {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]},
    {"matchExpressions": [{"key": "app", "operator": "NotIn"}]},
    {"matchLabels": {}},
])
def test_class_c_catch_all_selectors_are_refused_at_admission(namespace, author, selector):
    error = _refused(author, namespace, make_policy("p", namespace, selector=selector))
    assert "spec.selector" in error.message, error.message


# ---------------------------------------------------------------------------------------------- D

@pytest.mark.parametrize("entry, suffix, words", [
    # An allowed prefix /prom let /prom/%2e%2e/admin out to servers that normalise paths.
    ("{url}/prom", "/prom/%2e%2e/admin", "percent-encoded"),
    ("{url}/prom", "/prom/%2E%2E%2Fadmin", "percent-encoded"),
    ("{url}/prom", "/prom/../admin", "'.' or '..'"),
    ("{url}/prom", "/prom/..;/admin", "'.' or '..'"),
    ("{url}/prom", "/prom/%252e%252e/admin", "percent-encoded"),
    # A host-only entry is the scheme's default port, not every port of the host.
    ("127.0.0.1", "", "not a Prometheus endpoint the operator's admin allows"),
])
def test_class_d_the_allowlist_matches_scheme_host_port_and_decoded_path(kube, namespace, author, run_operator,
                                                                         listener, entry, suffix, words):
    _token_secret(kube, namespace)
    run_operator(prometheus_allowed=(entry.format(url=listener.url),), prometheus_allow_http=True)
    pol = _slo_policy("exfil", namespace, listener.url + suffix)
    try:
        author.create(policy_path(namespace), pol)
    except ApiError as err:  # refused at admission is as good: nothing is ever sent
        assert err.status == 422
    else:
        pol = wait_for(lambda: (p := get_policy(kube, namespace, "exfil")) and
                       cond(p, "SLOUnknown").get("status") == "True" and p, 30, what="SLOUnknown")
        assert words in cond(pol, "SLOUnknown")["message"], cond(pol, "SLOUnknown")
        time.sleep(2.5)  # a few more intervals
    assert listener.received == []  # not one connection, so no token


# ---------------------------------------------------------------------------------------------- E

def _released(kube, namespace: str, name: str) -> bool:
    wl = get_workload(kube, namespace, name)
    volumes = [v["name"] for v in wl["spec"]["template"]["spec"].get("volumes") or []]
    return POLICY_LABEL not in (wl["metadata"].get("labels") or {}) and not any(v.startswith("kvtier") for v in volumes)


def test_class_e_forged_progress_does_not_skip_the_release(kube, namespace, author, run_operator):
    user_apply(kube, deployment("llm", namespace))
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace))
    wait_applied(kube, namespace, "llm", "llm")
    done = {"started": "2026-01-01T00:00:00.000000+00:00", "stopped": "2026-01-01T00:00:01.000000+00:00",
            "delayed": None, "purpose": "delete", "retries": 1, "success": True, "failure": False, "message": None}
    # kopf's progress record for the release handler, as an author could write it where kopf kept it.
    author.request("PATCH", policy_path(namespace, "llm"), body={"metadata": {"annotations": {
        "kvtier.io/release": json.dumps(done)}}}, content_type="application/merge-patch+json")
    # ... and where it keeps it now: the status subresource, which the author may not write.
    with pytest.raises(ApiError) as denied:
        author.request("PATCH", policy_path(namespace, "llm", status=True),
                       body={"status": {"kopf": {"progress": {"release": done}}}},
                       content_type="application/merge-patch+json")
    assert denied.value.status == 403
    author.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="the policy deleted")
    wait_for(lambda: _released(kube, namespace, "llm"), 30, what="the workload released")


def test_class_e_removing_the_finalizer_does_not_skip_the_release(kube, namespace, author, run_operator):
    user_apply(kube, deployment("llm", namespace))
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace))
    wait_applied(kube, namespace, "llm", "llm")
    author.request("PATCH", policy_path(namespace, "llm"), body={"metadata": {"finalizers": None}},
                   content_type="application/merge-patch+json")
    author.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="the policy deleted")
    wait_for(lambda: _released(kube, namespace, "llm"), 30, what="the workload released")


# The chart's side of class E (its aggregated edit role grants no kvcachepolicies/status) is checked on the real
# API server by tests/chart/test_chart_controlplane.py::test_aggregated_roles_let_users_view_and_edit_policies.


# ---------------------------------------------------------------------------------------------- F

def test_class_f_condition_messages_stay_bounded_with_300_targets(kube, namespace, author, run_operator):
    for i in range(300):
        # Opted in but without the config argument: every target has a long MissingConfigArgument message.
        user_apply(kube, deployment(f"llm-{i:03d}-{'x' * 40}", namespace, labels={"app": "many"},
                                    args=["--model", "m"]))
    run_operator()
    author.create(policy_path(namespace), make_policy("many", namespace, selector={"matchLabels": {"app": "many"}}))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "many")) and
                   len((p.get("status") or {}).get("targets") or []) == 300 and p, 120,
                   what="status written for 300 targets")
    ready = cond(pol, "Ready")
    assert ready["reason"] == "MissingConfigArgument"
    assert len(ready["message"]) < 8192 and "and 295 more (295 MissingConfigArgument" in ready["message"], \
        len(ready["message"])


def test_class_f_query_overrides_need_the_admins_flag(kube, namespace, author, run_operator, listener):
    _token_secret(kube, namespace)
    run_operator()  # the admin allows this Prometheus, but not query overrides
    pol = _slo_policy("q", namespace, listener.url)
    pol["spec"]["slo"]["queries"] = {"requestRate": "sum(rate(anything_at_all[5m]))"}
    author.create(policy_path(namespace), pol)
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "q")) and
                   cond(p, "SLOUnknown").get("status") == "True" and p, 30, what="SLOUnknown")
    assert "allowQueryOverrides" in cond(pol, "SLOUnknown")["message"]
    time.sleep(2.5)
    assert listener.received == []


def test_class_f_secret_port_and_reason_phrase_failures_read_the_same(kube, namespace, author, run_operator,
                                                                      listener):
    _token_secret(kube, namespace)
    run_operator()
    closed = "http://127.0.0.1:9"
    cases = {"nosecret": (closed, "nosecret"), "refused": (closed, "prom-token"),
             "answered": (listener.url, "prom-token")}  # the listener answers 500 with a reason phrase
    for name, (url, secret) in cases.items():
        user_apply(kube, deployment(name, namespace))  # targets, so the guard does query
        author.create(policy_path(namespace), _slo_policy(name, namespace, url, secret=secret))
    seen = {}
    for name, (url, _) in cases.items():
        pol = wait_for(lambda name=name: (p := get_policy(kube, namespace, name)) and
                       cond(p, "SLOUnknown").get("status") == "True" and p, 30, what=f"SLOUnknown on {name}")
        c = cond(pol, "SLOUnknown")
        # The count of failures in a row differs with timing; everything else must be the same words.
        seen[name] = (c["reason"], re.sub(r"^[0-9]+ ", "N ", c["message"].replace(url, "URL")))
    assert len(set(seen.values())) == 1, seen
    assert "Internal Server Error" not in str(seen) and "500" not in str(seen)


def test_class_f_pvc_tiers_need_the_admins_allowlist(kube, namespace, author, run_operator):
    before = user_apply(kube, deployment("llm", namespace))
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace, tiers=[
        CPU, _disk("/mnt/kv", volume={"persistentVolumeClaim": {"claimName": "someone-elses-data"}})]))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Ready").get("reason") == "PersistentVolumeClaimNotAllowed" and p, 30,
                   what="PersistentVolumeClaimNotAllowed")
    assert "spec.tiers[1].volume.persistentVolumeClaim.claimName" in cond(pol, "Ready")["message"]
    time.sleep(1)
    assert get_workload(kube, namespace, "llm")["spec"]["template"] == before["spec"]["template"]
