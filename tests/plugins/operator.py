"""Fixtures and helpers for the operator's tests against the real control plane (tests/plugins/controlplane.py).

``kube``: a client on the control plane's kubeconfig. ``namespace``: a fresh namespace per test, so each test's
operator (namespaced) sees only its own objects. ``run_operator``: starts the operator in-process, in a thread
with its own event loop and a fresh kopf registry, and stops every one it started at teardown.
"""
from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Optional

import pytest
from kvtier_operator.kube import ApiError, policy_path, workload_path
from kvtier_operator.labels import OPT_IN_ANY, OPT_IN_LABEL
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, FIELD_MANAGER

GITOPS = "argocd-controller"


# ---------------------------------------------------------------------------------------------- builders
# Objects as users write them and as the API server returns them, for the operator's tests.

VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
TRTLLM_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0"


def policy(name: str = "llm", namespace: str = "default", *, selector: Optional[dict] = None,
           tiers: Optional[list] = None, generation: int = 1, uid: str = "uid-1", status: Optional[dict] = None,
           **spec_extra: Any) -> dict[str, Any]:
    spec = {
        "selector": selector or {"matchLabels": {"app": name}},
        "tiers": tiers if tiers is not None else [{"name": "cpu", "medium": "cpu", "size": "16Gi"}],
        **spec_extra,
    }
    obj = {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
           "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
           "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def nvme_tier(name: str = "nvme", path: str = "/mnt/nvme") -> dict[str, Any]:
    return {"name": name, "medium": "filesystem", "size": "100Gi", "path": path,
            "volume": {"hostPath": {"path": "/mnt/disks/nvme0", "type": "DirectoryOrCreate"}}}


def deployment(name: str = "llm", namespace: str = "default", *, labels: Optional[dict] = None,
               args: Optional[list] = None, image: str = VLLM_IMAGE, memory_request: Optional[str] = "8Gi",
               memory_limit: Optional[str] = "64Gi", kind: str = "Deployment",
               container: str = "vllm", opt_in: Optional[str] = OPT_IN_ANY) -> dict[str, Any]:
    """A serving workload manifest, as a user writes it (no status, no managedFields); its owner opts in to
    ``opt_in`` (a policy name, "true" for any, None for none)."""
    resources: dict[str, Any] = {}
    if memory_request:
        resources.setdefault("requests", {})["memory"] = memory_request
    if memory_limit:
        resources.setdefault("limits", {})["memory"] = memory_limit
    pod_labels = {"app": name}
    c = {"name": container, "image": image, "args": list(args if args is not None else
                                                           ["--model", "Qwen/Qwen3-8B", "--config",
                                                            "/etc/kvtier/engine.yaml"])}
    if resources:
        c["resources"] = resources
    spec: dict[str, Any] = {"replicas": 1, "selector": {"matchLabels": pod_labels},
                            "template": {"metadata": {"labels": pod_labels}, "spec": {"containers": [c]}}}
    if kind == "StatefulSet":
        spec["serviceName"] = name
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {**(labels or {"app": name}), **({OPT_IN_LABEL: opt_in} if opt_in else {})}},
            "spec": spec}


def observed(manifest: dict[str, Any], *, manager: str = "argocd-controller", generation: int = 1,
             resource_version: str = "100") -> dict[str, Any]:
    """The manifest as stored: managedFields naming ``manager`` as owner of its container resources and args."""
    obj = copy.deepcopy(manifest)
    c = obj["spec"]["template"]["spec"]["containers"][0]
    fields: dict[str, Any] = {"f:image": {}, "f:name": {}}
    if "args" in c:
        fields["f:args"] = {}
    if "resources" in c:
        fields["f:resources"] = {f"f:{k}": {f"f:{r}": {} for r in v} for k, v in c["resources"].items()}
    obj["metadata"].update({
        "generation": generation, "resourceVersion": resource_version,
        "managedFields": [{"manager": manager, "operation": "Apply", "apiVersion": "apps/v1",
                           "fieldsType": "FieldsV1",
                           "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:containers": {
                               'k:{"name":"' + c["name"] + '"}': fields}}}}}}],
    })
    return obj


# ---------------------------------------------------------------------------------------------- cluster helpers

def make_policy(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body = {"selector": {"matchLabels": {"app": name}}, "tiers": [{"name": "cpu", "medium": "cpu", "size": "16Gi"}]}
    body.update(spec)
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def user_apply(kube, manifest: dict[str, Any], manager: str = GITOPS) -> dict[str, Any]:
    meta = manifest["metadata"]
    return kube.apply(workload_path(manifest["kind"], meta["namespace"], meta["name"]), manifest, manager=manager)


def create_policy(kube, policy: dict[str, Any]) -> dict[str, Any]:
    return kube.create(policy_path(policy["metadata"]["namespace"]), policy)


def get_policy(kube, namespace: str, name: str) -> Optional[dict[str, Any]]:
    return kube.get(policy_path(namespace, name))


def update_policy(kube, namespace: str, name: str, mutate) -> dict[str, Any]:
    """Read-modify-write of the policy's spec/metadata, retried when the operator's status write races it."""
    for _ in range(20):
        pol = get_policy(kube, namespace, name)
        mutate(pol)
        try:
            return kube.request("PUT", policy_path(namespace, name), body=pol)
        except ApiError as err:
            if err.status != 409:
                raise
            time.sleep(0.1)
    raise AssertionError("could not update the policy")


def get_workload(kube, namespace: str, name: str, kind: str = "Deployment") -> dict[str, Any]:
    return kube.get(workload_path(kind, namespace, name))


def cond(policy: Optional[dict[str, Any]], type_: str) -> dict[str, Any]:
    for c in ((policy or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def template_hash(obj: dict[str, Any]) -> Optional[str]:
    return ((obj["spec"]["template"].get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)


def wait_applied(kube, namespace: str, name: str, workload: str, timeout: float = 30) -> tuple[dict, dict]:
    """Until the policy is Ready and the workload carries the hash its status reports."""
    def check():
        pol = get_policy(kube, namespace, name)
        if cond(pol, "Ready").get("status") != "True":
            return None
        want = pol["status"]["targets"][0]["configHash"]
        wl = get_workload(kube, namespace, workload)
        return (pol, wl) if template_hash(wl) == want else None
    return wait_for(check, timeout, what=f"policy {name} applied to {workload}")


def manager_entry(obj: dict[str, Any], manager: str) -> Optional[dict[str, Any]]:
    return next((m for m in obj["metadata"].get("managedFields") or [] if m["manager"] == manager
                 and not m.get("subresource")), None)


def leaf_paths(fields: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, child in fields.items():
        if key == ".":
            continue
        if child:
            out += leaf_paths(child, prefix + (key,))
        else:
            out.append(prefix + (key,))
    return out


def assert_owns_only_injected(obj: dict[str, Any]) -> None:
    entry = manager_entry(obj, FIELD_MANAGER)
    assert entry is not None and entry["operation"] == "Apply"
    for path in leaf_paths(entry["fieldsV1"]):
        text = "/".join(path)
        allowed = (
            text == "f:metadata/f:labels/f:kvtier.io/policy"
            or text == "f:spec/f:template/f:metadata/f:annotations/f:kvtier.io/config-hash"
            or text.startswith('f:spec/f:template/f:spec/f:volumes/k:{"name":"kvtier-')
            or text.startswith('f:spec/f:template/f:spec/f:initContainers/k:{"name":"kvtier-shm-cleanup"}')
            or text == 'f:spec/f:template/f:spec/f:containers/k:{"name":"vllm"}/f:name'
            or text.startswith('f:spec/f:template/f:spec/f:containers/k:{"name":"vllm"}/f:volumeMounts/')
            or text.startswith('f:spec/f:template/f:spec/f:containers/k:{"name":"vllm"}/f:env/')
        )
        assert allowed, f"{FIELD_MANAGER} owns {text}, which it did not inject"
        if 'k:{"name":"vllm"}' in path:  # the user's container: never its args, image or resources
            assert not {"f:args", "f:image", "f:resources", "f:command"} & set(path), text



def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll until ``predicate()`` is truthy; return its value, or fail naming what was awaited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what or predicate}; last value: {last!r}")


@pytest.fixture(scope="session")
def kube(controlplane):
    from kvtier_operator.kube import Kube

    client = Kube(str(controlplane.kubeconfig))
    yield client
    client.close()


@pytest.fixture
def namespace(kube) -> Iterator[str]:
    name = f"op-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def run_operator(kube, namespace, controlplane):
    """``run_operator(hooks=(), **settings)`` -> a started OperatorThread watching the test's namespace."""
    from kvtier_operator.kube import Kube
    from kvtier_operator.settings import Settings

    from plugins.operator_thread import OperatorThread

    started: list[OperatorThread] = []

    def start(hooks: Any = (), **overrides: Any) -> OperatorThread:
        values: dict[str, Any] = dict(namespaces=(namespace,), standalone=True, liveness_endpoint=None,
                                      metrics_port=None, resync_seconds=60.0, backoff_initial=0.2, backoff_max=2.0,
                                      read_nodes=False, kubeconfig=str(controlplane.kubeconfig),
                                      # The admin trusts the test's node path and its local Prometheus.
                                      host_path_prefixes=("/mnt/disks",), prometheus_allowed=("127.0.0.1:*",),
                                      prometheus_allow_http=True)
        values.update(overrides)
        runner = OperatorThread(Settings(**values), Kube(str(controlplane.kubeconfig)))
        runner.op.on_reconciled.extend(hooks)  # attached before the first reconcile can happen
        started.append(runner)
        return runner.start()

    yield start
    # Delete the test's policies while an operator still runs, so their finalizers are released and the
    # namespace can go; then stop every operator started.
    running = [r for r in started if r._thread.is_alive()]
    if running:
        for pol in kube.list(policy_path(namespace)):
            kube.delete(policy_path(namespace, pol["metadata"]["name"]))
        try:
            wait_for(lambda: not kube.list(policy_path(namespace)), 20, what="policies released at teardown")
        except AssertionError:
            pass  # a test that broke the operator: the namespace is left for inspection
    for runner in started:
        try:
            runner.stop()
        finally:
            runner.op.kube.close()
