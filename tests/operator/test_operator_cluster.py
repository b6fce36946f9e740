"""The operator against the real kube-apiserver: apply, GitOps coexistence, conflicts, refusals, restarts, 409s.

Users' manifests are applied with server-side apply as ``argocd-controller``, exactly as Argo CD's SSA sync does,
so field ownership on the server is what it is in a GitOps cluster.
"""
from __future__ import annotations

import copy
import json
import threading
import time

import pytest
from kvtier_operator.kube import config_map_path, policy_path, workload_path
from kvtier_operator.settings import FIELD_MANAGER, POLICY_LABEL
from plugins.operator import (
    GITOPS,
    TRTLLM_IMAGE,
    assert_owns_only_injected,
    cond,
    create_policy,
    deployment,
    get_policy,
    get_workload,
    make_policy,
    manager_entry,
    nvme_tier,
    template_hash,
    update_policy,
    user_apply,
    wait_applied,
    wait_for,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


def quiet_for(runner, seconds: float) -> bool:
    """True when the operator sent no write during ``seconds``."""
    def writes() -> float:
        return sum(runner.op.metrics.value("kvtier_operator_api_writes_total", {"kind": k})
                   for k in ("workload", "workload-args", "workload-release", "configmap", "status"))
    before = writes()
    time.sleep(seconds)
    return writes() == before


def settled(kube, namespace: str, policy: str, workload: str) -> bool:
    """The workload's controller caught up with its template and the policy's Progressing condition says so: what
    the operator reports can no longer change unless something changes in the cluster."""
    from kvtier_operator.workload import Workload

    return (Workload(get_workload(kube, namespace, workload)).rolled_out()
            and cond(get_policy(kube, namespace, policy), "Progressing").get("reason") == "RolledOut")


def unchanged_by_us(now: dict, before: dict) -> bool:
    """Same spec (generation, template) and the operator's managedFields entry untouched (same time)."""
    return (now["metadata"]["generation"] == before["metadata"]["generation"]
            and now["spec"]["template"] == before["spec"]["template"]
            and manager_entry(now, FIELD_MANAGER) == manager_entry(before, FIELD_MANAGER))


# ---------------------------------------------------------------------------------------------- flows

def test_apply_update_delete(kube, namespace, run_operator):
    manifest = deployment("llm", namespace)
    before = user_apply(kube, manifest)
    run_operator()
    create_policy(kube, make_policy("llm", namespace, tiers=[{"name": "cpu", "medium": "cpu", "size": "16Gi"},
                                                              nvme_tier()]))
    pol, wl = wait_applied(kube, namespace, "llm", "llm")
    assert pol["status"]["observedGeneration"] == pol["metadata"]["generation"]
    assert pol["status"]["activeTiers"] == "cpu,nvme"
    assert "kvtier.io/finalizer" in pol["metadata"]["finalizers"]
    assert not any(k.startswith("kopf.zalando.org") for k in pol["metadata"].get("annotations") or {})
    pod = wl["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"kvtier-config", "kvtier-shm", "kvtier-tier-nvme"}
    assert pod["initContainers"][0]["name"] == "kvtier-shm-cleanup"
    assert pod["containers"][0]["args"] == manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    assert_owns_only_injected(wl)
    # kopf never handled the workload itself: no kopf annotations, no finalizer on it (no drift for GitOps).
    assert not any("kopf" in k or k.startswith("kvtier.io/") for k in wl["metadata"].get("annotations") or {})
    assert not wl["metadata"].get("finalizers")
    cm = kube.get(config_map_path(namespace, "kvtier-llm"))
    assert cm["metadata"]["ownerReferences"][0]["uid"] == pol["metadata"]["uid"]
    assert "kv_connector_extra_config" in cm["data"]["engine.yaml"]

    # Update: a bigger cpu tier re-renders and re-applies (new hash, new ConfigMap content).
    first_hash = template_hash(wl)
    update_policy(kube, namespace, "llm", lambda p: p["spec"]["tiers"][0].update(size="32Gi"))
    wait_for(lambda: template_hash(get_workload(kube, namespace, "llm")) not in (None, first_hash), 30,
             what="new config hash after the policy update")
    pol, wl = wait_applied(kube, namespace, "llm", "llm")
    assert str(32 * 2**30) in kube.get(config_map_path(namespace, "kvtier-llm"))["data"]["engine.yaml"]
    shm = next(v for v in wl["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-shm")
    assert shm["emptyDir"]["sizeLimit"] == str(33 * 2**30)

    # Delete: everything the operator applied goes; the workload is as its owner wrote it.
    kube.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="policy gone (finalizer released)")
    wl = get_workload(kube, namespace, "llm")
    assert manager_entry(wl, FIELD_MANAGER) is None
    assert wl["spec"]["template"]["spec"] == before["spec"]["template"]["spec"]
    assert POLICY_LABEL not in wl["metadata"]["labels"] and template_hash(wl) is None
    assert kube.get(config_map_path(namespace, "kvtier-llm")) is None


def test_gitops_reapply_causes_no_conflict_and_no_drift_loop(kube, namespace, run_operator):
    manifest = deployment("llm", namespace)
    user_apply(kube, manifest)
    runner = run_operator()
    create_policy(kube, make_policy("llm", namespace))
    _, wl = wait_applied(kube, namespace, "llm", "llm")
    generation, hash_ = wl["metadata"]["generation"], template_hash(wl)
    writes = runner.op.metrics.value("kvtier_operator_api_writes_total", {"kind": "workload"})

    # Argo CD syncs the unchanged manifest: no 409, nothing changes, nobody re-applies.
    for _ in range(3):
        user_apply(kube, manifest)
    # The user changes their image in Git and Argo CD syncs it: our fields stay, still no conflict.
    changed = copy.deepcopy(manifest)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.33.1"
    user_apply(kube, changed)
    time.sleep(3)  # time for any reaction to the user's writes to happen
    wl = get_workload(kube, namespace, "llm")
    assert wl["metadata"]["generation"] == generation + 1  # the user's image change, and nothing else
    assert template_hash(wl) == hash_
    assert wl["spec"]["template"]["spec"]["containers"][0]["image"].endswith("v0.33.1")
    assert_owns_only_injected(wl)
    gitops = manager_entry(wl, GITOPS)
    assert "f:args" in json.dumps(gitops["fieldsV1"])  # the user still owns their args
    # The operator may re-apply after the user's writes (a no-op server-side) but never changes the object, and
    # once the user stops writing it stops too: no loop.
    quiet = runner.op.metrics.value("kvtier_operator_api_writes_total", {"kind": "workload"})
    assert quiet - writes <= 10
    time.sleep(3)
    assert unchanged_by_us(get_workload(kube, namespace, "llm"), wl)
    assert runner.op.metrics.value("kvtier_operator_api_writes_total", {"kind": "workload"}) == quiet


def test_conflicting_policies_both_report_and_neither_applies(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace, labels={"app": "llm", "team": "a"}))
    run_operator()
    create_policy(kube, make_policy("one", namespace, selector={"matchLabels": {"app": "llm"}}))
    create_policy(kube, make_policy("two", namespace, selector={"matchLabels": {"team": "a"}}))

    def both_conflict():
        return all(cond(get_policy(kube, namespace, n), "Conflict").get("status") == "True" for n in ("one", "two"))
    wait_for(both_conflict, 30, what="Conflict on both policies")
    assert "two" in cond(get_policy(kube, namespace, "one"), "Conflict")["message"]
    assert "one" in cond(get_policy(kube, namespace, "two"), "Conflict")["message"]
    wl = get_workload(kube, namespace, "llm")
    # The race between the two creations may have let "one" apply before "two" existed; once both see the
    # conflict, neither changes it.
    if manager_entry(wl, FIELD_MANAGER) is None:
        assert template_hash(wl) is None
    time.sleep(2)
    assert unchanged_by_us(get_workload(kube, namespace, "llm"), wl)
    # Removing one policy resolves the conflict; the other applies.
    kube.delete(policy_path(namespace, "two"))
    pol, _ = wait_applied(kube, namespace, "one", "llm")
    assert cond(pol, "Conflict")["status"] == "False"


def test_conflict_when_second_policy_arrives_leaves_workload_as_is(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace, labels={"app": "llm", "team": "a"}))
    run_operator()
    create_policy(kube, make_policy("one", namespace, selector={"matchLabels": {"app": "llm"}}))
    _, wl = wait_applied(kube, namespace, "one", "llm")
    create_policy(kube, make_policy("two", namespace, selector={"matchLabels": {"team": "a"}},
                                    tiers=[{"name": "cpu", "medium": "cpu", "size": "8Gi"}]))
    wait_for(lambda: cond(get_policy(kube, namespace, "one"), "Conflict").get("status") == "True", 30,
             what="policy one sees the conflict")
    wait_for(lambda: cond(get_policy(kube, namespace, "two"), "Conflict").get("status") == "True", 30,
             what="policy two sees the conflict")
    time.sleep(1)
    now = get_workload(kube, namespace, "llm")
    # The controller-manager may update .status; the spec (generation) and template stay as "one" left them.
    assert now["metadata"]["generation"] == wl["metadata"]["generation"]
    assert now["spec"]["template"] == wl["spec"]["template"]


def test_missing_config_argument_is_named_exactly(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace, args=["--model", "Qwen/Qwen3-8B"]))
    run_operator()
    create_policy(kube, make_policy("llm", namespace))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Degraded").get("reason") == "MissingConfigArgument" and p, 30,
                   what="MissingConfigArgument")
    assert 'add the argument "--config /etc/kvtier/engine.yaml"' in cond(pol, "Degraded")["message"]
    assert cond(pol, "Ready")["status"] == "False"
    # The user adds it in Git; the policy becomes Ready without the operator touching args.
    user_apply(kube, deployment("llm", namespace))
    wait_applied(kube, namespace, "llm", "llm")


def test_managed_args_takes_over_and_gives_back(kube, namespace, run_operator):
    # A cluster without GitOps: the user created the workload with a plain create (an Update, not an Apply).
    manifest = deployment("llm", namespace, args=["--model", "Qwen/Qwen3-8B"])
    kube.create(workload_path("Deployment", namespace), manifest)
    run_operator()
    create_policy(kube, make_policy("llm", namespace, injection={"args": "managed"}))
    _, wl = wait_applied(kube, namespace, "llm", "llm")
    assert wl["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--model", "Qwen/Qwen3-8B", "--config", "/etc/kvtier/engine.yaml"]
    kube.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="policy gone")
    assert get_workload(kube, namespace, "llm")["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--model", "Qwen/Qwen3-8B"]


def test_headroom_refusal_explains_the_numbers(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace, memory_request="8Gi", memory_limit="20Gi"))
    run_operator()
    create_policy(kube, make_policy("llm", namespace))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Degraded").get("reason") == "Refused" and p, 30, what="Refused")
    message = cond(pol, "Degraded")["message"]
    for text in ("memory request 8Gi", "cpu tier 16Gi", "headroom 1Gi", "= 25Gi", "memory limit is 20Gi",
                 GITOPS, "at least 25Gi"):
        assert text in message
    wl = get_workload(kube, namespace, "llm")
    assert manager_entry(wl, FIELD_MANAGER) is None and template_hash(wl) is None
    # Raising the limit in Git lets the policy through.
    user_apply(kube, deployment("llm", namespace, memory_request="8Gi", memory_limit="32Gi"))
    wait_applied(kube, namespace, "llm", "llm")


def test_invalid_policy_for_its_target_is_a_condition_not_a_crash(kube, namespace, run_operator):
    user_apply(kube, deployment("trt", namespace, image=TRTLLM_IMAGE,
                                args=["--extra_llm_api_options", "/etc/kvtier/engine.yaml"]))
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator()
    # Valid for the API server (engine unset), invalid once the engine is detected: LMCache is vLLM-only.
    create_policy(kube, make_policy("trt", namespace, backend="lmcache"))
    create_policy(kube, make_policy("llm", namespace))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "trt")) and
                   cond(p, "Degraded").get("status") == "True" and p, 30, what="Degraded on the invalid policy")
    assert "lmcache" in cond(pol, "Degraded")["message"]
    wait_applied(kube, namespace, "llm", "llm")  # the operator keeps working for everyone else
    assert runner.error is None
    # Fixing the policy applies it.
    update_policy(kube, namespace, "trt", lambda p: p["spec"].update(backend="native"))
    wait_for(lambda: cond(get_policy(kube, namespace, "trt"), "Ready").get("status") == "True", 30,
             what="fixed policy Ready")


def test_restart_changes_nothing_that_is_right(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace))
    user_apply(kube, deployment("db", namespace, kind="StatefulSet"))
    first = run_operator()
    create_policy(kube, make_policy("llm", namespace))
    create_policy(kube, make_policy("db", namespace))
    wait_applied(kube, namespace, "llm", "llm")
    wait_for(lambda: cond(get_policy(kube, namespace, "db"), "Ready").get("status") == "True", 30, what="db Ready")
    # Stop the first operator only once the cluster has settled, then take the state it left. "The operator sent
    # nothing for 2 s" alone was not settled: the operator's last write (Progressing False) follows the
    # controller-manager's status update of the rolled-out Deployment, and under load that update came later than
    # 2 s after the operator's previous write. The operator was idle because it was waiting for the controller, it
    # was stopped before the rollout finished, and the second operator then rightly wrote Progressing False: a
    # status write "after the operator went quiet", from a first state that was no longer right.
    wait_for(lambda: settled(kube, namespace, "llm", "llm"), 60, what="llm rolled out and reported so")
    wait_for(lambda: quiet_for(first, 2.0), 30, what="first operator idle")
    first.stop()
    objects = {
        "deployment": get_workload(kube, namespace, "llm"),
        "statefulset": get_workload(kube, namespace, "db", "StatefulSet"),
        "policy-llm": get_policy(kube, namespace, "llm"),
        "policy-db": get_policy(kube, namespace, "db"),
        "configmap": kube.get(config_map_path(namespace, "kvtier-llm")),
    }

    seen: list = []
    second = run_operator(hooks=[lambda key, outcome: seen.append(key)])
    wait_for(lambda: {(namespace, "llm"), (namespace, "db")} <= set(seen), 30, what="both policies reconciled")
    time.sleep(1)
    now = {
        "deployment": get_workload(kube, namespace, "llm"),
        "statefulset": get_workload(kube, namespace, "db", "StatefulSet"),
        "policy-llm": get_policy(kube, namespace, "llm"),
        "policy-db": get_policy(kube, namespace, "db"),
        "configmap": kube.get(config_map_path(namespace, "kvtier-llm")),
    }
    for key in ("policy-llm", "policy-db", "configmap"):  # objects nothing but us and the test writes
        assert now[key]["metadata"]["resourceVersion"] == objects[key]["metadata"]["resourceVersion"], (
            key, json.dumps(objects[key], sort_keys=True), json.dumps(now[key], sort_keys=True))
    for key in ("deployment", "statefulset"):  # the controller-manager may still write their .status
        assert unchanged_by_us(now[key], objects[key]), key
    assert template_hash(now["deployment"]) == template_hash(objects["deployment"])
    assert second.op.metrics.value("kvtier_operator_api_writes_total", {"kind": "status"}) == 0


def test_409_mid_reconcile_is_retried(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator()
    injected = threading.Event()

    def race(method: str, path: str) -> None:
        # Just before the operator writes the policy's status, someone else changes the policy: the status
        # write carries the resourceVersion it planned from, so the server answers 409 Conflict.
        if path.endswith("/status") and not injected.is_set():
            injected.set()
            update_policy(kube, namespace, "llm", lambda p: p["metadata"].setdefault("labels", {}).update(
                touched="yes"))

    runner.op.kube.before_write = race
    create_policy(kube, make_policy("llm", namespace))
    pol, _ = wait_applied(kube, namespace, "llm", "llm")
    assert injected.is_set()
    # A label does not change the plan: the status write is re-sent against the fresh object at once.
    assert runner.op.metrics.value("kvtier_operator_reconcile_errors_total", {"reason": "StatusConflict"}) >= 1
    assert pol["metadata"]["labels"]["touched"] == "yes"
    assert cond(pol, "Ready")["status"] == "True"


def test_409_from_a_spec_change_mid_reconcile_plans_again(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator()
    injected = threading.Event()

    def race(method: str, path: str) -> None:
        # The spec changes between the operator's read and its status write: a 409 whose plan is stale.
        if path.endswith("/status") and not injected.is_set():
            injected.set()
            update_policy(kube, namespace, "llm", lambda p: p["spec"]["tiers"][0].update(size="20Gi"))

    runner.op.kube.before_write = race
    create_policy(kube, make_policy("llm", namespace))
    wait_for(injected.is_set, 30, what="the injected spec change")
    wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
             (p.get("status") or {}).get("observedGeneration") == p["metadata"]["generation"] == 2 and p, 30,
             what="status of generation 2")
    assert runner.op.metrics.value("kvtier_operator_reconcile_errors_total", {"reason": "Conflict"}) >= 1
    _, wl = wait_applied(kube, namespace, "llm", "llm")
    shm = next(v for v in wl["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-shm")
    assert shm["emptyDir"]["sizeLimit"] == str(21 * 2**30)  # rendered from the new spec, not the stale one


def test_field_owned_by_another_manager_becomes_a_condition(kube, namespace, run_operator):
    # Someone else owns an env var the operator needs with another value: apply without force gets a 409,
    # which must become a condition (never a forced write, never a retry storm).
    manifest = deployment("llm", namespace)
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "LMCACHE_CONFIG_FILE", "value": "/somewhere/else.yaml"}]
    user_apply(kube, manifest)
    run_operator()
    create_policy(kube, make_policy("llm", namespace, backend="lmcache"))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Degraded").get("status") == "True" and p, 30, what="Degraded on a field conflict")
    assert "never forces" in cond(pol, "Degraded")["message"]
    # The server's words name the field and its owner, so the user knows what to change in Git.
    assert "LMCACHE_CONFIG_FILE" in cond(pol, "Degraded")["message"] and GITOPS in cond(pol, "Degraded")["message"]
    env = get_workload(kube, namespace, "llm")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "LMCACHE_CONFIG_FILE", "value": "/somewhere/else.yaml"}]


def test_workload_deleted_before_policy_is_not_an_error(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator()
    create_policy(kube, make_policy("llm", namespace))
    wait_applied(kube, namespace, "llm", "llm")
    kube.delete(workload_path("Deployment", namespace, "llm"))
    wait_for(lambda: cond(get_policy(kube, namespace, "llm"), "Ready").get("reason") == "NoTargets", 30,
             what="NoTargets after the workload is gone")
    kube.delete(policy_path(namespace, "llm"))
    wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="policy gone")
    # Nothing is remembered about objects that are gone (a long-running operator must not grow with churn).
    assert not runner.shared.events.remembers((namespace, "Deployment", "llm"))
    assert (namespace, "kvtier-llm") not in runner.op.applied_config_maps


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_liveness_and_metrics(kube, namespace, run_operator, caplog):
    import logging
    import urllib.request

    caplog.set_level(logging.INFO, logger="kvtier.operator")

    user_apply(kube, deployment("llm", namespace))
    user_apply(kube, deployment("big", namespace, memory_limit="20Gi"))
    port = _free_port()
    runner = run_operator(liveness_endpoint=f"http://127.0.0.1:{port}/healthz")
    metrics_port = runner.op.metrics.serve(0, "127.0.0.1")
    try:
        create_policy(kube, make_policy("llm", namespace))
        create_policy(kube, make_policy("big", namespace))
        wait_applied(kube, namespace, "llm", "llm")

        def reasons():
            return {(e.get("type"), e.get("reason")) for e in kube.list(f"/api/v1/namespaces/{namespace}/events")
                    if (e.get("involvedObject") or {}).get("kind") == "KVCachePolicy"}
        wait_for(lambda: {("Normal", "Applied"), ("Normal", "ConfigApplied"), ("Warning", "Refused")} <= reasons(),
                 20, what="Applied, ConfigApplied and Refused events")
        # Each transition is also one log line (kopf's per-event lines are off without --verbose).
        logged = {(r.levelname, r.getMessage().split(": ")[1]) for r in caplog.records
                  if r.name == "kvtier.operator" and r.getMessage().startswith(f"{namespace}/")}
        assert {("INFO", "Applied"), ("INFO", "ConfigApplied"), ("WARNING", "Refused")} <= logged, logged
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kvtier_operator_reconciles_total{result="ok"}' in text
        assert f'kvtier_operator_applied_targets{{namespace="{namespace}",policy="llm"}} 1.0' in text
        assert "kvtier_operator_reconcile_duration_seconds_bucket" in text
    finally:
        runner.op.metrics.close()


def test_kvtier_operator_command_runs_and_stops_on_sigterm(kube, namespace, controlplane):
    """The real entry point (`kvtier operator`, kopf.run with its signal handling) as a process."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    user_apply(kube, deployment("llm", namespace))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "operator"), str(root / "runtime")]),
           "KVTIER_NAMESPACES": namespace, "KVTIER_STANDALONE": "true", "KVTIER_METRICS_PORT": str(port),
           "KVTIER_METRICS_HOST": "127.0.0.1", "KVTIER_LIVENESS": "off", "KVTIER_READ_NODES": "false",
           "KUBECONFIG": str(controlplane.kubeconfig)}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier_operator.cli", "operator"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        create_policy(kube, make_policy("llm", namespace))
        wait_applied(kube, namespace, "llm", "llm", timeout=60)
        kube.delete(policy_path(namespace, "llm"))
        wait_for(lambda: get_policy(kube, namespace, "llm") is None, 30, what="policy released by the process")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
