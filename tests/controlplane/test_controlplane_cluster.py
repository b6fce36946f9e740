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


def test_kubectl_talks_to_a_v1_37_api_server(controlplane: ControlPlane) -> None:
    version = json.loads(controlplane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.37."), version
    assert version["clientVersion"]["gitVersion"].startswith("v1.37."), version
    names = controlplane.kubectl("get", "namespaces", "-o", "name").stdout.split()
    assert "namespace/kube-system" in names


def test_deployment_produces_an_owned_replicaset(controlplane: ControlPlane, namespace: str) -> None:
    controlplane.apply(
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
    with controlplane.api_client() as api:
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


def test_namespaces_get_their_default_service_account(controlplane: ControlPlane, namespace: str) -> None:
    with controlplane.api_client() as api:
        core = client.CoreV1Api(api)

        def default_sa() -> client.V1ServiceAccount | None:
            try:
                return core.read_namespaced_service_account("default", namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        eventually(default_sa, 60, f"ServiceAccount default in {namespace}")
