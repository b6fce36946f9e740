"""Server-side apply with two field managers on one Deployment, the way kvtier shares Deployments with GitOps
tools: map-keyed list items (volumes, env, volumeMounts) are co-owned item by item, atomic lists (args) are not.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.dynamic.exceptions import DynamicApiError
from plugins.controlplane import ControlPlane

pytestmark = pytest.mark.controlplane

GITOPS = "gitops-tool"
KVTIER = "kvtier-operator"


def gitops_deployment(namespace: str, args: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {
                "metadata": {"labels": {"app": "engine"}},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "registry.invalid/engine:1",
                            "args": args,
                            "env": [{"name": "FROM_GIT", "value": "1"}],
                            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                        }
                    ],
                    "volumes": [{"name": "models", "emptyDir": {}}],
                },
            },
        },
    }


def kvtier_patch(namespace: str, **container: Any) -> dict[str, Any]:
    """Only what the operator owns: the container is named (its merge key) and carries just kvtier's items."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine", "namespace": namespace},
        "spec": {"template": {"spec": {"containers": [{"name": "engine", **container}]}}},
    }


def kvtier_items(namespace: str) -> dict[str, Any]:
    patch = kvtier_patch(
        namespace,
        env=[{"name": "KVTIER_POLICY", "value": "default"}],
        volumeMounts=[{"name": "kv-spill", "mountPath": "/kv"}],
    )
    patch["spec"]["template"]["spec"]["volumes"] = [{"name": "kv-spill", "emptyDir": {}}]
    return patch


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def managers(deployment: dict[str, Any]) -> set[str]:
    return {entry["manager"] for entry in deployment["metadata"]["managedFields"] if entry["operation"] == "Apply"}


def test_conflict_on_an_atomic_list_is_409(bare_controlplane: ControlPlane, namespace: str) -> None:
    bare_controlplane.apply(gitops_deployment(namespace, ["--port", "8000"]), field_manager=GITOPS)
    with pytest.raises(DynamicApiError) as caught:
        bare_controlplane.apply(kvtier_patch(namespace, args=["--port", "8000", "--kv-offload"]), field_manager=KVTIER)
    assert caught.value.status == 409
    status = json.loads(caught.value.body)
    assert status["reason"] == "Conflict"
    fields = [cause["field"] for cause in status["details"]["causes"]]
    assert fields == ['.spec.template.spec.containers[name="engine"].args'], fields
    assert GITOPS in status["message"]
    # Nothing changed, and forcing is what it would take.
    stored = bare_controlplane.apply(
        kvtier_patch(namespace, args=["--port", "8000", "--kv-offload"]), field_manager=KVTIER, force=True
    )
    assert container(stored)["args"] == ["--port", "8000", "--kv-offload"]


def test_applying_the_same_atomic_value_shares_ownership(bare_controlplane: ControlPlane, namespace: str) -> None:
    bare_controlplane.apply(gitops_deployment(namespace, ["--port", "8000"]), field_manager=GITOPS)
    stored = bare_controlplane.apply(kvtier_patch(namespace, args=["--port", "8000"]), field_manager=KVTIER)
    assert managers(stored) == {GITOPS, KVTIER}


def test_map_keyed_list_items_are_co_owned(bare_controlplane: ControlPlane, namespace: str) -> None:
    bare_controlplane.apply(gitops_deployment(namespace, ["--port", "8000"]), field_manager=GITOPS)
    merged = bare_controlplane.apply(kvtier_items(namespace), field_manager=KVTIER)
    spec = merged["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["models", "kv-spill"]
    assert [e["name"] for e in container(merged)["env"]] == ["FROM_GIT", "KVTIER_POLICY"]
    assert [m["name"] for m in container(merged)["volumeMounts"]] == ["models", "kv-spill"]
    assert container(merged)["args"] == ["--port", "8000"]
    assert managers(merged) == {GITOPS, KVTIER}

    # The GitOps tool syncs again from Git (which never mentions kvtier's items) with a new args value: no
    # conflict, and kvtier's items survive because the GitOps manager never owned them.
    resynced = bare_controlplane.apply(gitops_deployment(namespace, ["--port", "9000"]), field_manager=GITOPS)
    assert container(resynced)["args"] == ["--port", "9000"]
    assert [v["name"] for v in resynced["spec"]["template"]["spec"]["volumes"]] == ["models", "kv-spill"]
    assert [e["name"] for e in container(resynced)["env"]] == ["FROM_GIT", "KVTIER_POLICY"]

    # When kvtier withdraws its items (applies without them), only its own items go.
    withdrawn = bare_controlplane.apply(kvtier_patch(namespace), field_manager=KVTIER)
    assert [v["name"] for v in withdrawn["spec"]["template"]["spec"]["volumes"]] == ["models"]
    assert [e["name"] for e in container(withdrawn)["env"]] == ["FROM_GIT"]
