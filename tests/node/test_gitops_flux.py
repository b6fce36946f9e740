"""kvtier beside a real GitOps controller: Flux's source-controller and kustomize-controller (built from their Go
modules by e2e/flux/run, run as pods on the real node) sync a bare Git repository on this host, with pruning and a
5 s interval, while the operator (installed by its chart, as a pod) configures what Flux applies.

What a real controller does that the unit tests' second field manager does not: it re-applies on an interval with
its own server-side apply options (forced ownership of what Git says), it checks drift with dry runs, it prunes what
left Git, and it owns the whole object as written in Git, including the lists the operator adds items to.

The tests run in file order on one repository: each starts from the state the previous one left (a commit of a
namespace, an opted-in Deployment and a policy; then changes to both; then the policy's removal).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from kvtier_operator.labels import OPT_IN_ANY, OPT_IN_LABEL
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, FIELD_MANAGER, REENABLE_ANNOTATION
from plugins.node import CHART, HELM, OPERATOR_NAMESPACE, OPERATOR_RELEASE, NodeCluster, image_ref, wait_until
from plugins.prometheus import require_prometheus
from scenario.manifests import DEGRADED, HEALTHY, Names, synthetic_deployment, synthetic_engine_config_map
from scenario.manifests import policy as scenario_policy
from scenario.prometheus import PrometheusProcess

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FLUX_RUN = REPO / "e2e" / "flux" / "run"
FLUX_MANAGER = "kustomize-controller"
INTERVAL_S = 5  # e2e/flux/sync.yaml
SYNC_TIMEOUT_S = 120
KUSTOMIZE = ("kustomize.toolkit.fluxcd.io", "v1", "flux-system", "kustomizations", "gitops")


@dataclass
class GitOps:
    cluster: NodeCluster
    bare: Path
    work: Path
    namespace: str = field(default_factory=lambda: f"gitops-{uuid.uuid4().hex[:6]}")

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.work), *args], check=True, capture_output=True, text=True,
                              timeout=60).stdout.strip()

    def commit(self, files: dict[str, Any], message: str) -> str:
        """Writes FILE -> manifest (None deletes it), commits, pushes to main; returns the commit's sha."""
        for name, doc in files.items():
            path = self.work / name
            if doc is None:
                path.unlink()
            else:
                path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.git("add", "-A")
        self.git("-c", "user.name=kvtier-e2e", "-c", "user.email=e2e@kvtier.invalid", "commit", "-q", "-m", message)
        self.git("push", "-q", "origin", "main")
        return self.git("rev-parse", "HEAD")

    def kustomization(self) -> dict[str, Any]:
        group, version, ns, plural, name = KUSTOMIZE
        with self.cluster.cp.api_client() as api:
            return client.CustomObjectsApi(api).get_namespaced_custom_object(group, version, ns, plural, name)

    def synced(self, sha: str) -> dict[str, Any]:
        """Waits until Flux applied commit ``sha`` and calls the Kustomization Ready at that revision."""
        def ready() -> dict[str, Any] | None:
            k = self.kustomization()
            status = k.get("status") or {}
            conds = {c["type"]: c for c in status.get("conditions") or []}
            ok = (status.get("lastAppliedRevision", "").endswith(sha)
                  and conds.get("Ready", {}).get("status") == "True")
            return k if ok else None
        return wait_until(ready, SYNC_TIMEOUT_S, f"Flux Ready at {sha[:8]}",
                          detail=lambda: json.dumps((self.kustomization().get("status") or {}).get("conditions")))

    def deployment(self) -> dict[str, Any]:
        with self.cluster.cp.api_client() as api:
            obj = client.AppsV1Api(api).read_namespaced_deployment("llm", self.namespace)
            return api.sanitize_for_serialization(obj)

    def policy(self) -> dict[str, Any] | None:
        with self.cluster.cp.api_client() as api:
            try:
                return client.CustomObjectsApi(api).get_namespaced_custom_object(
                    "kvtier.io", "v1alpha1", self.namespace, "kvcachepolicies", "llm")
            except ApiException as e:
                if e.status == 404:
                    return None
                raise

    def pods(self) -> list[client.V1Pod]:
        with self.cluster.cp.api_client() as api:
            return client.CoreV1Api(api).list_namespaced_pod(self.namespace, label_selector="app=llm").items


@pytest.fixture(scope="module")
def gitops(node_cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GitOps]:
    cp_dir = node_cluster.cp.state_dir
    out = subprocess.run([str(FLUX_RUN), "up", str(cp_dir)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("GITOPS_REPO=")]
    bare = Path(line.split("=", 1)[1])
    work = tmp_path_factory.mktemp("gitops") / "work"
    subprocess.run(["git", "clone", "-q", str(bare), str(work)], check=True, timeout=60)
    g = GitOps(node_cluster, bare, work)
    try:
        yield g
    finally:
        # Deleting the Kustomization garbage-collects what it applied (prune), then Flux itself goes.
        node_cluster.cp.kubectl("-n", "flux-system", "delete", "kustomization", "gitops", "--wait=true",
                                "--timeout=60s", check=False)
        node_cluster.cp.kubectl("delete", "namespace", "flux-system", "--wait=false", check=False)
        subprocess.run([str(FLUX_RUN), "down", str(cp_dir)], check=False, timeout=60)


def manifests(g: GitOps, *, size: str = "256Mi", labels: dict[str, str] | None = None, replicas: int = 1,
              extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """The repository's files: a namespace, an opted-in Deployment whose args consent to the rendered config, and
    a KVCachePolicy with one host tier."""
    pod_labels = {"app": "llm"}
    container = {
        "name": "engine", "image": image_ref("base"), "imagePullPolicy": "Never",
        # A stand-in for the engine: it sleeps and ignores its arguments; the consent is in them.
        "command": ["sh", "-c", "exec sleep 1000000", "engine"],
        "args": ["--config", "/etc/kvtier/engine.yaml", *extra_args],
        "resources": {"requests": {"memory": "64Mi"}},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": g.namespace,
                     "labels": {"app": "llm", OPT_IN_LABEL: OPT_IN_ANY, **(labels or {})}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": pod_labels},
                 "template": {"metadata": {"labels": pod_labels},
                              "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]}}},
    }
    policy = {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
        "metadata": {"name": "llm", "namespace": g.namespace},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "engine": "vllm", "blockSize": 16, "backend": "native",
                 "tiers": [{"name": "host", "medium": "cpu", "size": size, "evictionPolicy": "lru"}]},
    }
    return {"namespace.yaml": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": g.namespace}},
            "deployment.yaml": deployment, "policy.yaml": policy}


def template_hash(d: dict[str, Any]) -> str | None:
    return ((d["spec"]["template"]["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION))


def managers(obj: dict[str, Any]) -> dict[str, str]:
    """Field manager -> the time of its last write."""
    return {m["manager"]: m.get("time", "") for m in obj["metadata"].get("managedFields") or []}


def spec_writers(obj: dict[str, Any]) -> dict[str, str]:
    """:func:`managers` of the two that write the Deployment's spec, Flux and kvtier (the Deployment controller's
    status writes are its own business)."""
    return {m: t for m, t in managers(obj).items() if m in (FLUX_MANAGER, FIELD_MANAGER)}


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    return next((c["status"] for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind),
                None)


def configured(g: GitOps) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        d = g.deployment()
        ok = template_hash(d) and FIELD_MANAGER in managers(d) and condition(g.policy(), "Ready") == "True"
        return d if ok else None
    return check


def test_one_commit_of_namespace_workload_and_policy_is_configured_and_ready(gitops: GitOps) -> None:
    g = gitops
    sha = g.commit(manifests(g), "serve llm with a host tier")
    g.synced(sha)
    d = wait_until(configured(g), 120, "the operator configured the Deployment Flux applied",
                   detail=lambda: json.dumps((g.policy() or {}).get("status")))
    volumes = {v["name"] for v in d["spec"]["template"]["spec"].get("volumes") or []}
    assert any("kvtier" in v for v in volumes), volumes
    # Both write the object; neither took the other's place.
    assert {FLUX_MANAGER, FIELD_MANAGER} <= set(managers(d)), managers(d)
    # The pod Flux's first apply started (before the operator's fields) is replaced once, by a configured one.
    wait_until(lambda: (pods := g.pods()) and all(
        p.status.phase == "Running" and p.metadata.deletion_timestamp is None
        and (p.metadata.annotations or {}).get(CONFIG_HASH_ANNOTATION) == template_hash(d) for p in pods) or None,
               120, "only configured pods running", detail=lambda: str([(p.metadata.name, p.status.phase)
                                                                      for p in g.pods()]))
    # The Kustomization stays Ready at that revision once the operator's fields are in (no drift reported).
    assert g.synced(sha)


def test_nothing_flaps_over_five_flux_intervals(gitops: GitOps) -> None:
    g = gitops
    first = g.deployment()
    pods = {p.metadata.uid: p.status.container_statuses[0].restart_count for p in g.pods()}
    k_first = g.kustomization()["status"]
    deadline = time.monotonic() + 5.5 * INTERVAL_S
    seen: list[tuple[int, str | None]] = []
    while time.monotonic() < deadline:
        d = g.deployment()
        seen.append((d["metadata"]["generation"], template_hash(d)))
        # Unknown while a sync runs (Flux's "reconciliation in progress"), never False: kvtier's fields are no
        # drift Flux fails on and no health check it fails.
        k = g.kustomization()
        assert condition(k, "Ready") != "False", k["status"]["conditions"]
        time.sleep(2)
    last = g.deployment()
    assert set(seen) == {(first["metadata"]["generation"], template_hash(first))}, seen
    assert {p.metadata.uid: p.status.container_statuses[0].restart_count for p in g.pods()} == pods
    # Flux's drift check found nothing to re-apply: its write of the Deployment is the one from the sync, and
    # the operator did not write again either.
    assert len(spec_writers(first)) == 2 and spec_writers(last) == spec_writers(first), \
        (managers(first), managers(last))
    k_last = g.kustomization()["status"]
    assert k_last["lastAppliedRevision"] == k_first["lastAppliedRevision"]


def test_git_changes_to_the_workload_and_to_the_policy_both_land_and_only_the_policy_rerenders(gitops: GitOps) -> None:
    g = gitops
    before = g.deployment()
    sha = g.commit({"deployment.yaml": manifests(g, labels={"team": "search"}, replicas=2,
                                                  extra_args=("--max-model-len", "4096"))["deployment.yaml"]},
                   "llm: two replicas, a team label, a longer context")
    g.synced(sha)
    d = wait_until(lambda: (d := g.deployment())["spec"]["replicas"] == 2 and d, 60, "two replicas")
    assert d["metadata"]["labels"]["team"] == "search"
    args = d["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--config", "/etc/kvtier/engine.yaml", "--max-model-len", "4096"], args
    assert template_hash(d) == template_hash(before)
    assert FIELD_MANAGER in managers(d)

    hashes: list[str | None] = []
    sha = g.commit({"policy.yaml": manifests(g, size="512Mi")["policy.yaml"]}, "llm: a bigger host tier")
    g.synced(sha)

    def rerendered() -> dict[str, Any] | None:
        d = g.deployment()
        hashes.append(template_hash(d))
        return d if template_hash(d) != template_hash(before) else None
    after = wait_until(rerendered, 90, "the policy change re-rendered")
    # Watch a few more intervals: one new hash, never back to the old one, never a third.
    end = time.monotonic() + 3 * INTERVAL_S
    while time.monotonic() < end:
        hashes.append(template_hash(g.deployment()))
        time.sleep(2)
    distinct = list(dict.fromkeys(hashes))
    assert distinct in ([template_hash(before), template_hash(after)], [template_hash(after)]), distinct
    assert hashes[-1] == template_hash(after)
    # The Git fields of the earlier change survived the re-render.
    assert after["spec"]["replicas"] == 2 and after["metadata"]["labels"]["team"] == "search"


def test_a_refused_policy_fails_fluxs_health_check_at_once_with_the_refusal(gitops: GitOps) -> None:
    """Flux waits (wait: true) for what it applied to be healthy. A refused policy says Stalled, so Flux's kstatus
    reads it as Failed and reports the refusal at once, rather than waiting out its timeout on "in progress"."""
    g = gitops
    refused = manifests(g)["policy.yaml"]
    refused["metadata"]["name"] = "refused"
    refused["spec"]["selector"] = {"matchLabels": {"app": "nothing-yet"}}
    refused["spec"]["tiers"].append({"name": "nvme", "medium": "filesystem", "size": "1Gi", "path": "/mnt/kv",
                                     "volume": {"hostPath": {"path": "/var/lib/not-allowed"}}})
    sha = g.commit({"refused.yaml": refused}, "a policy the admin's settings do not allow")
    started = time.monotonic()

    def failed() -> dict[str, Any] | None:
        k = g.kustomization()
        ready = next((c for c in k["status"].get("conditions") or [] if c["type"] == "Ready"), {})
        return ready if ready.get("status") == "False" and sha in k["status"].get("lastAttemptedRevision", "") \
            else None
    ready = wait_until(failed, 60, "Flux's health check failed on the refused policy")
    # Flux's own timeout is 60 s (e2e/flux/sync.yaml); it did not wait it out.
    assert time.monotonic() - started < 45, time.monotonic() - started
    assert f"KVCachePolicy/{g.namespace}/refused" in ready["message"] and "Failed" in ready["message"], ready
    g.synced(g.commit({"refused.yaml": None}, "drop the refused policy"))


def test_the_policy_pruned_from_git_releases_the_workload(gitops: GitOps) -> None:
    g = gitops
    sha = g.commit({"policy.yaml": None}, "llm: no more tiering")
    g.synced(sha)
    wait_until(lambda: g.policy() is None or None, 60, "Flux pruned the policy")

    def released() -> dict[str, Any] | None:
        d = g.deployment()
        return d if FIELD_MANAGER not in managers(d) and template_hash(d) is None else None
    d = wait_until(released, 90, "the operator released the Deployment")
    spec = d["spec"]["template"]["spec"]
    assert not any("kvtier" in v["name"] for v in spec.get("volumes") or []), spec.get("volumes")
    assert not spec.get("initContainers"), spec.get("initContainers")
    # As Git has it.
    assert spec["containers"][0]["args"] == ["--config", "/etc/kvtier/engine.yaml", "--max-model-len", "4096"]
    assert d["spec"]["replicas"] == 2
    g.synced(sha)


# ------------------------------------------------------------------------------------ the SLO guard under Flux
@pytest.fixture
def guarded(gitops: GitOps, tmp_path: Path) -> Iterator[tuple[GitOps, Any, Names]]:
    """A second namespace in the same repository: the synthetic engine (e2e/synthetic_engine) opted in to a policy
    with a cpu and a filesystem tier and short SLO settings; Prometheus on the node's bridge scrapes its pods, and
    the operator is allowed to query it (a helm upgrade of the session's release, undone afterwards)."""
    require_prometheus()
    g = gitops
    # The node's bridge address, as e2e/node/run recorded it: pods reach the host there.
    env = dict(line.split("=", 1) for line in (g.cluster.cp.state_dir / "node" / "net.env").read_text().split())
    prom = PrometheusProcess(tmp_path / "prometheus", scrape_interval="1s", host=env["gateway"])
    prom.start()
    names = Names(namespace=f"{g.namespace}-slo", workload="llm-slo", policy="llm-slo")
    helm_env = {**os.environ, **{f"HELM_{k}_HOME": str(g.cluster.cp.state_dir.parent / "helm")
                                 for k in ("CACHE", "CONFIG", "DATA")}}

    def upgrade(*settings: str) -> None:
        subprocess.run([str(HELM), "upgrade", OPERATOR_RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                        "--kubeconfig", str(g.cluster.cp.kubeconfig), "--reuse-values", "--wait", "--timeout", "180s",
                        *settings], check=True, env=helm_env, capture_output=True, text=True, timeout=240)
    upgrade("--set", "slo.prometheus.allowHttp=true",
            "--set-json", f'slo.prometheus.allowed=["{prom.host}:{prom.port}"]',
            "--set-json", 'operator.extraArgs=["--resync=60","--backoff-max=5"]')
    try:
        yield g, prom, names
    finally:
        prom.stop()
        upgrade("--set", "slo.prometheus.allowHttp=false", "--set-json", "slo.prometheus.allowed=[]",
                "--set-json", "operator.extraArgs=[]")


def tier_state(g: GitOps, names: Names, tier: str) -> str | None:
    with g.cluster.cp.api_client() as api:
        pol = client.CustomObjectsApi(api).get_namespaced_custom_object(
            "kvtier.io", "v1alpha1", names.namespace, "kvcachepolicies", names.policy)
    return next((t.get("state") for t in (pol.get("status") or {}).get("tiers") or [] if t.get("name") == tier), None)


def test_the_slo_guards_rollback_and_re_enable_survive_flux(guarded: tuple[GitOps, Any, Names]) -> None:
    g, prom, names = guarded
    script = (REPO / "e2e" / "synthetic_engine" / "engine.py").read_text()
    deployment = synthetic_deployment(names, image_ref("operator"), HEALTHY)
    deployment["spec"]["replicas"] = 1  # as Git has it: the pod started before the config was injected is replaced
    files = {"slo/namespace.yaml": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": names.namespace}},
             "slo/engine-script.yaml": synthetic_engine_config_map(names, script),
             "slo/deployment.yaml": deployment, "slo/policy.yaml": scenario_policy(names, prom.url)}
    (g.work / "slo").mkdir(exist_ok=True)
    g.synced(g.commit(files, "llm-slo: a synthetic engine guarded by its SLO"))
    with g.cluster.cp.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)

        def workload() -> dict[str, Any]:
            return api.sanitize_for_serialization(apps.read_namespaced_deployment(names.workload, names.namespace))

        def serving() -> list[client.V1Pod] | None:
            """The Running, ready pods of the current template, each a Prometheus target (old ones dropped)."""
            want = template_hash(workload())
            pods = [p for p in core.list_namespaced_pod(names.namespace, label_selector=f"app={names.workload}").items
                    if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
                    and (p.metadata.annotations or {}).get(CONFIG_HASH_ANNOTATION) == want
                    and all(c.ready for c in p.status.container_statuses or [])]
            for address in list(prom.targets):
                if address not in {f"{p.status.pod_ip}:8000" for p in pods}:
                    prom.remove_target(address)
            for p in pods:
                prom.add_target(f"{p.status.pod_ip}:8000", namespace=names.namespace, pod=p.metadata.name)
            return pods or None

        (pod,) = wait_until(serving, 180, "the guarded engine serving its configured template")
        healthy_hash = template_hash(workload())
        wait_until(lambda: tier_state(g, names, names.fs_tier) == "Enabled" or None, 60, "both tiers Enabled")

        # The engine slows down: three breaches in a row disable the newest tier.
        request = urllib.request.Request(f"http://{pod.status.pod_ip}:8000/control", method="POST",
                                         data=json.dumps(DEGRADED).encode(), headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=5).close()
        wait_until(lambda: serving() and tier_state(g, names, names.fs_tier) == "Disabled" or None, 120,
                   "the guard disabled the filesystem tier", interval_s=2)
        rolled_hash = wait_until(lambda: (h := template_hash(workload())) != healthy_hash and h, 60,
                                 "the rollback re-rendered")
        generation = workload()["metadata"]["generation"]
        # Flux syncs three more times: none of them undoes the rollback, nor reports the operator's change as drift.
        end = time.monotonic() + 3.5 * INTERVAL_S
        while time.monotonic() < end:
            assert tier_state(g, names, names.fs_tier) == "Disabled"
            assert template_hash(workload()) == rolled_hash
            assert condition(g.kustomization(), "Ready") != "False"
            time.sleep(2)
        assert workload()["metadata"]["generation"] == generation

        # A person re-enables it (the annotation is not in Git; Flux leaves what it does not own alone).
        serving()
        g.cluster.cp.kubectl("-n", names.namespace, "annotate", "kvcachepolicy", names.policy,
                             f"{REENABLE_ANNOTATION}={names.fs_tier}")
        wait_until(lambda: tier_state(g, names, names.fs_tier) == "Enabled" or None, 120,
                   "the filesystem tier re-enabled", interval_s=2)
        wait_until(lambda: template_hash(workload()) == healthy_hash or None, 60, "re-rendered with both tiers")
        end = time.monotonic() + 2.5 * INTERVAL_S
        while time.monotonic() < end:
            serving()
            assert tier_state(g, names, names.fs_tier) == "Enabled"
            assert template_hash(workload()) == healthy_hash
            assert condition(g.kustomization(), "Ready") != "False"
            time.sleep(2)
