"""Revoking trust releases: an operator restarted without the allowlist entry (remote store, PVC, hostPath prefix)
that once admitted a policy's tier takes back what it applied under it (the mount, the Secret projection, the
store URL in its ConfigMap), says why in a condition, and posts one Event. Before, a refusal planned nothing and
released nothing: the workload kept the store's Secret and URL."""
from __future__ import annotations

import copy
import time
from typing import Optional

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.controller import Operator
from kvtier_operator.kube import config_map_path, policy_path, workload_path
from kvtier_operator.settings import POLICY_LABEL, Settings
from kvtier_operator.status import compose, condition
from plugins.operator import deployment, observed, policy

NOW = "2026-12-01T08:00:00Z"
LATER = "2026-12-01T08:05:00Z"
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}
STORE = "redis://valkey.kv:6379"
REMOTE = {"name": "shared", "medium": "remote", "size": "8Gi",
          "remote": {"url": STORE + "/0", "passwordSecret": {"name": "valkey", "key": "password"},
                     "macKeySecret": {"name": "kv-mac", "key": "mac"}}}
PVC = {"name": "disk", "medium": "filesystem", "size": "10Gi", "path": "/kv",
       "volume": {"persistentVolumeClaim": {"claimName": "kv-cache"}}}
HOST = {"name": "disk", "medium": "filesystem", "size": "10Gi", "path": "/kv",
        "volume": {"hostPath": {"path": "/mnt/nvme/kv"}}}

CASES = {
    "remote store": (REMOTE, {"remote_stores_allowed": (STORE,)}, "RemoteStoreNotAllowed",
                     "spec.tiers[1].remote.url"),
    "pvc": (PVC, {"pvc_allowed": ("default/kv-cache",)}, "PersistentVolumeClaimNotAllowed",
            "spec.tiers[1].volume.persistentVolumeClaim.claimName"),
    "host path": (HOST, {"host_path_prefixes": ("/mnt/nvme",)}, "HostPathNotAllowed",
                  "spec.tiers[1].volume.hostPath.path"),
}


def _policy(tier: dict) -> dict:
    return policy(tiers=[CPU, tier], backend="kvtier", engine="vllm")


def _applied(pol: dict, trust: dict) -> tuple[dict, dict]:
    """The workload as the API server holds it after the trusted pass applied, and the policy's status then."""
    p = rc.plan(pol, [observed(deployment())], [], now=NOW, **trust)
    [t] = p.targets
    assert t.state == rc.APPLIED and t.apply is not None
    wl = observed(deployment())
    wl["metadata"]["labels"].update(t.apply["metadata"]["labels"])
    args = wl["spec"]["template"]["spec"]["containers"][0]["args"]
    wl["spec"]["template"] = copy.deepcopy(t.apply["spec"]["template"])
    wl["spec"]["template"]["spec"]["containers"][0]["args"] = args  # the owner's (or managed) args stay
    return wl, {**pol, "status": compose({}, p.status)}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_tier_no_longer_trusted_is_released_with_a_condition_and_one_event(case):
    tier, trust, reason, field = CASES[case]
    wl, pol = _applied(_policy(tier), trust)
    assert wl["metadata"]["labels"][POLICY_LABEL] == "llm"
    revoked = rc.plan(pol, [wl], [], now=LATER)  # the operator restarted without the entry
    [t] = revoked.targets
    assert t.remove and t.state == rc.RELEASED and t.apply is None, t
    assert revoked.config_map is None and revoked.release_config_map
    assert revoked.status["targets"] == []
    ready, degraded = condition(revoked.status, "Ready"), condition(revoked.status, "Degraded")
    assert ready["status"] == "False" and ready["reason"] == reason
    assert degraded["status"] == "True" and degraded["reason"] == reason
    assert ready["message"].startswith(field) and "releases what it applied before" in ready["message"]
    [event] = revoked.events
    assert event.type == "Warning" and event.reason == reason
    assert event.message.startswith("released Deployment/llm: " + field), event.message

    # The next pass: the workload carries nothing of the policy any more; no second Event, nothing to write.
    released = observed(deployment())
    again = rc.plan({**pol, "status": compose(pol["status"], revoked.status)}, [released], [], now=LATER)
    assert again.targets == [] and again.events == []
    assert condition(again.status, "Ready") == ready  # the same words once the release is done


def test_a_refusal_with_nothing_applied_releases_nothing():
    p = rc.plan(_policy(REMOTE), [observed(deployment())], [], now=NOW)
    assert p.targets == [] and not p.release_config_map
    assert condition(p.status, "Ready")["reason"] == "RemoteStoreNotAllowed"


def test_managed_args_are_taken_back_too():
    pol = _policy(REMOTE)
    pol["spec"]["injection"] = {"args": "managed"}
    wl, pol = _applied(pol, {"remote_stores_allowed": (STORE,)})
    c = wl["spec"]["template"]["spec"]["containers"][0]
    assert "--config" in c["args"]
    [t] = rc.plan(pol, [wl], [], now=LATER).targets
    assert t.remove and t.args_update is not None
    args = t.args_update["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--config" not in args


class FakeKube:
    """The API calls a pass makes, on a dict of objects by path; server-side applies recorded in order."""

    def __init__(self, objects: dict[str, dict]):
        self.objects = objects
        self.applied: list[tuple[str, dict]] = []
        self.deleted: list[str] = []

    def get(self, path: str) -> Optional[dict]:
        return copy.deepcopy(self.objects.get(path))

    def list(self, path: str, label_selector: Optional[str] = None) -> list[dict]:
        out = []
        for p, obj in self.objects.items():
            if p.rsplit("/", 1)[0] != path:
                continue
            labels = obj["metadata"].get("labels") or {}
            if label_selector and not all(labels.get(k) == v for k, v in
                                          (term.split("=", 1) for term in label_selector.split(",") if "=" in term)):
                continue
            out.append(copy.deepcopy(obj))
        return out

    def apply(self, path: str, body: dict, manager: str = "") -> dict:
        self.applied.append((path, body))
        obj = self.objects.setdefault(path, {"metadata": {}})
        if body.get("kind") in ("Deployment", "StatefulSet") and set(body) <= {"apiVersion", "kind", "metadata"}:
            obj["metadata"]["labels"].pop(POLICY_LABEL, None)  # the release: kvtier's fields are gone
        obj["metadata"]["resourceVersion"] = "200"
        return copy.deepcopy(obj)

    def patch(self, path: str, body: dict, content_type: str = "") -> dict:
        target = path.removesuffix("/status")
        obj = self.objects[target]
        if "status" in body:
            obj["status"] = {**(obj.get("status") or {}), **body["status"]}
        return copy.deepcopy(obj)

    def delete(self, path: str) -> bool:
        self.deleted.append(path)
        return self.objects.pop(path, None) is not None


def test_the_operator_releases_the_workload_and_deletes_its_config_map_when_the_store_is_no_longer_allowed():
    wl, pol = _applied(_policy(REMOTE), {"remote_stores_allowed": (STORE,)})
    pol["metadata"]["resourceVersion"] = "10"
    cm = rc.config_map_body(pol, {"engine.yaml": "url: " + STORE})
    w_path, cm_path = workload_path("Deployment", "default", "llm"), config_map_path("default", "kvtier-llm")
    kube = FakeKube({policy_path("default", "llm"): pol, w_path: wl, cm_path: cm})
    op = Operator(Settings(read_nodes=False), kube)  # no remote_stores_allowed: trust revoked
    outcome = op.run_pass("default", "llm", [])
    assert kube.applied == [(w_path, {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "metadata": {"name": "llm", "namespace": "default"}})]
    assert kube.deleted == [cm_path]
    assert [e.reason for e in outcome.events] == ["RemoteStoreNotAllowed"]
    stored = kube.objects[policy_path("default", "llm")]
    assert condition(stored["status"], "Ready")["reason"] == "RemoteStoreNotAllowed"

    kube.applied.clear()
    again = op.run_pass("default", "llm", [])
    assert kube.applied == [] and again.events == []


@pytest.mark.controlplane
def test_on_a_real_api_server_an_operator_restarted_without_the_prefix_releases_the_host_path(kube, namespace,
                                                                                             run_operator):
    from plugins.operator import cond, get_policy, get_workload, make_policy, user_apply, wait_applied, wait_for

    def events(reason: str) -> list:
        return [e for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
                if e["involvedObject"].get("kind") == "KVCachePolicy" and e.get("reason") == reason]

    user_apply(kube, deployment("llm", namespace))
    tier = {"name": "disk", "medium": "filesystem", "size": "1Gi", "path": "/kv",
            "volume": {"hostPath": {"path": "/mnt/disks/kv"}}}
    kube.create(policy_path(namespace), make_policy("llm", namespace, tiers=[CPU, tier]))
    first = run_operator()  # the fixture's admin allows /mnt/disks
    wait_applied(kube, namespace, "llm", "llm")
    first.stop()

    def host_paths() -> list:
        volumes = get_workload(kube, namespace, "llm")["spec"]["template"]["spec"].get("volumes") or []
        return [v for v in volumes if "hostPath" in v]

    assert host_paths()
    run_operator(host_path_prefixes=())  # the admin took the prefix away
    wait_for(lambda: host_paths() == [], 30, what="the hostPath volume released")
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Ready").get("reason") == "HostPathNotAllowed" and p, 30, what="HostPathNotAllowed")
    assert "releases what it applied before" in cond(pol, "Ready")["message"]
    assert POLICY_LABEL not in (get_workload(kube, namespace, "llm")["metadata"].get("labels") or {})
    assert kube.get(config_map_path(namespace, "kvtier-llm")) is None
    wait_for(lambda: events("HostPathNotAllowed"), 30, what="the Event")
    time.sleep(2)  # a second one would have been posted by now
    [event] = events("HostPathNotAllowed")
    assert event["type"] == "Warning" and event.get("count", 1) == 1, event
    assert event["message"].startswith("released Deployment/llm: spec.tiers[1].volume.hostPath.path"), event
