"""The control plane is the real thing end to end: kube-apiserver v1.37 answers kubectl, and
kube-controller-manager runs the controllers that turn a Deployment into a ReplicaSet and fill namespaces."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from plugins.controlplane import ControlPlane

pytestmark = pytest.mark.controlplane

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll until `probe` returns something other than None (controllers act asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s}s")
        time.sleep(0.2)


def test_kubectl_talks_to_a_v1_37_api_server(bare_controlplane: ControlPlane) -> None:
    version = json.loads(bare_controlplane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.37."), version
    assert version["clientVersion"]["gitVersion"].startswith("v1.37."), version
    names = bare_controlplane.kubectl("get", "namespaces", "-o", "name").stdout.split()
    assert "namespace/kube-system" in names


def test_deployment_produces_an_owned_replicaset(bare_controlplane: ControlPlane, namespace: str) -> None:
    bare_controlplane.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": namespace},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:1"}]},
                },
            },
        }
    )
    with bare_controlplane.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        replicasets = eventually(
            lambda: apps.list_namespaced_replica_set(namespace).items or None, 60, "ReplicaSet for Deployment web"
        )
        owner = replicasets[0].metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.controller) == ("Deployment", "web", True)
        # The ReplicaSet controller creates the Pods; with no scheduler or kubelet they stay Pending.
        pods = eventually(
            lambda: (lambda items: items if len(items) == 2 else None)(core.list_namespaced_pod(namespace).items),
            60,
            "2 Pods of ReplicaSet",
        )
        assert {p.status.phase for p in pods} == {"Pending"}


def test_namespaces_get_their_default_service_account(bare_controlplane: ControlPlane, namespace: str) -> None:
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)

        def default_sa() -> client.V1ServiceAccount | None:
            try:
                return core.read_namespaced_service_account("default", namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        eventually(default_sa, 60, f"ServiceAccount default in {namespace}")


def _absent(read: Callable[[], object]) -> bool | None:
    """True once `read` answers 404, None while the object is still there."""
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return None


def test_owner_references_cascade(bare_controlplane: ControlPlane, namespace: str) -> None:
    # The garbage collector deletes a dependent once its owner is gone (background propagation).
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
        )
        ref = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)
        core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="dependent", owner_references=[ref]))
        )
        core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bystander")))
        core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")
        eventually(
            lambda: _absent(lambda: core.read_namespaced_config_map("dependent", namespace)),
            60,
            "dependent ConfigMap collected after its owner was deleted",
        )
        assert core.read_namespaced_config_map("bystander", namespace).metadata.name == "bystander"


def test_foreground_deletion_waits_for_dependents(bare_controlplane: ControlPlane, namespace: str) -> None:
    # Foreground: the owner stays (with the foregroundDeletion finalizer) until the GC has deleted its dependents.
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
        )
        ref = client.V1OwnerReference(
            api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid, block_owner_deletion=True
        )
        core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="dependent", owner_references=[ref]))
        )
        core.delete_namespaced_config_map("owner", namespace, propagation_policy="Foreground")
        for name in ("dependent", "owner"):
            eventually(
                lambda name=name: _absent(lambda: core.read_namespaced_config_map(name, namespace)),
                60,
                f"ConfigMap {name} gone after foreground deletion",
            )


def test_deleted_namespace_is_emptied_and_removed(bare_controlplane: ControlPlane) -> None:
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        name = core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(generate_name="kvtier-test-delete-"))
        ).metadata.name
        core.create_namespaced_config_map(name, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="content")))
        core.delete_namespace(name)
        # The namespace controller deletes the content, then removes the "kubernetes" finalizer.
        # About 5 s idle. Generous for a loaded 2-core machine; minutes here mean the controller is throttled
        # (it once fell back to client-go's 5 QPS and took 154 s with the suite's CRDs installed).
        eventually(lambda: _absent(lambda: core.read_namespace(name)), 120, f"namespace {name} deleted")


def test_namespaces_get_the_root_ca_config_map(bare_controlplane: ControlPlane, namespace: str) -> None:
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)

        def root_ca() -> client.V1ConfigMap | None:
            try:
                return core.read_namespaced_config_map("kube-root-ca.crt", namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        published = eventually(root_ca, 60, f"ConfigMap kube-root-ca.crt in {namespace}")
        # The CA that signed the API server's certificate, i.e. the one the admin kubeconfig trusts.
        with open(api.configuration.ssl_ca_cert, encoding="ascii") as ca_file:
            assert published.data["ca.crt"].strip() == ca_file.read().strip()


def test_aggregated_cluster_roles_are_filled(bare_controlplane: ControlPlane) -> None:
    # admin/edit/view carry only an aggregationRule at bootstrap; the aggregation controller fills their rules.
    with bare_controlplane.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        view = eventually(
            lambda: (lambda role: role if role.rules else None)(rbac.read_cluster_role("view")),
            60,
            "rules aggregated into ClusterRole view",
        )
        assert any("pods" in (rule.resources or []) for rule in view.rules)
