"""CRD behaviour only a real API server has: CEL validation (including transition rules), pruning of unknown
fields, strict field validation, the status subresource, optimistic concurrency and finalizers.

The Widget CRD here is the tests' own, so these run before and independently of kvtier's CRD in crds/.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from plugins.controlplane import ControlPlane, apply_manifests

pytestmark = pytest.mark.controlplane

GROUP = "controlplane.test.kvtier.io"
VERSION = "v1"
PLURAL = "widgets"
RANGE_MESSAGE = "minReplicas must not exceed maxReplicas"
IMMUTABLE_MESSAGE = "spec.owner is immutable"

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["minReplicas", "maxReplicas"],
                                "properties": {
                                    "minReplicas": {"type": "integer", "minimum": 0},
                                    "maxReplicas": {"type": "integer", "minimum": 0},
                                    "owner": {
                                        "type": "string",
                                        "x-kubernetes-validations": [
                                            {"rule": "self == oldSelf", "message": IMMUTABLE_MESSAGE}
                                        ],
                                    },
                                },
                                "x-kubernetes-validations": [
                                    {"rule": "self.minReplicas <= self.maxReplicas", "message": RANGE_MESSAGE}
                                ],
                            },
                            "status": {
                                "type": "object",
                                "properties": {"observed": {"type": "integer"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def widget_crd(bare_controlplane: ControlPlane) -> None:
    apply_manifests(bare_controlplane, [WIDGET_CRD])


@pytest.fixture
def widgets(bare_controlplane: ControlPlane, widget_crd: None) -> Iterator[client.CustomObjectsApi]:
    with bare_controlplane.api_client() as api:
        yield client.CustomObjectsApi(api)


def widget(name: str, min_replicas: int = 1, max_replicas: int = 3, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"minReplicas": min_replicas, "maxReplicas": max_replicas, **spec},
    }


def create(api: client.CustomObjectsApi, namespace: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, **kw)


def get(api: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def error_causes(exc: ApiException) -> tuple[str, list[dict[str, Any]]]:
    status = json.loads(exc.body)
    return status["message"], status.get("details", {}).get("causes", [])


def test_cel_rule_rejects_with_its_message(widgets: client.CustomObjectsApi, namespace: str) -> None:
    with pytest.raises(ApiException) as caught:
        create(widgets, namespace, widget("bad-range", min_replicas=5, max_replicas=2))
    assert caught.value.status == 422
    message, causes = error_causes(caught.value)
    assert RANGE_MESSAGE in message
    assert any(c.get("field") == "spec" and RANGE_MESSAGE in c.get("message", "") for c in causes), causes


def test_object_satisfying_the_rule_is_stored(widgets: client.CustomObjectsApi, namespace: str) -> None:
    stored = create(widgets, namespace, widget("good-range", min_replicas=2, max_replicas=2))
    assert stored["spec"] == {"minReplicas": 2, "maxReplicas": 2}
    assert stored["metadata"]["resourceVersion"]


def test_cel_transition_rule_sees_the_old_object(widgets: client.CustomObjectsApi, namespace: str) -> None:
    create(widgets, namespace, widget("owned", owner="team-a"))
    with pytest.raises(ApiException) as caught:
        widgets.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "owned", {"spec": {"owner": "team-b"}}
        )
    assert caught.value.status == 422
    assert IMMUTABLE_MESSAGE in error_causes(caught.value)[0]
    # The same rule passes when the value does not change.
    widgets.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "owned", {"spec": {"maxReplicas": 4}})
    assert get(widgets, namespace, "owned")["spec"]["owner"] == "team-a"


def test_unknown_field_is_pruned(widgets: client.CustomObjectsApi, namespace: str) -> None:
    stored = create(widgets, namespace, widget("pruned", colour="blue"))
    assert "colour" not in stored["spec"]
    assert "colour" not in get(widgets, namespace, "pruned")["spec"]


def test_unknown_field_is_rejected_under_strict_field_validation(
    widgets: client.CustomObjectsApi, namespace: str
) -> None:
    with pytest.raises(ApiException) as caught:
        create(widgets, namespace, widget("strict", colour="blue"), field_validation="Strict")
    assert caught.value.status == 400
    assert 'unknown field "spec.colour"' in error_causes(caught.value)[0]


def test_status_subresource_separates_spec_and_status(widgets: client.CustomObjectsApi, namespace: str) -> None:
    created = create(widgets, namespace, widget("split", min_replicas=1, max_replicas=3))
    # A write to /status carries a changed spec: the spec change is dropped, the status kept.
    body = {**created, "spec": {**created["spec"], "maxReplicas": 9}, "status": {"observed": 7}}
    after_status = widgets.replace_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "split", body)
    assert after_status["spec"]["maxReplicas"] == 3
    assert after_status["status"] == {"observed": 7}
    # And a write to the main resource cannot change status.
    body = {**after_status, "spec": {**after_status["spec"], "maxReplicas": 5}, "status": {"observed": 0}}
    after_main = widgets.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "split", body)
    assert after_main["spec"]["maxReplicas"] == 5
    assert after_main["status"] == {"observed": 7}


def test_stale_resource_version_update_is_a_conflict(widgets: client.CustomObjectsApi, namespace: str) -> None:
    original = create(widgets, namespace, widget("raced"))
    fresh = widgets.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "raced", {**original, "spec": {**original["spec"], "maxReplicas": 4}}
    )
    assert fresh["metadata"]["resourceVersion"] != original["metadata"]["resourceVersion"]
    stale = {**original, "spec": {**original["spec"], "maxReplicas": 8}}  # still carries the old resourceVersion
    with pytest.raises(ApiException) as caught:
        widgets.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "raced", stale)
    assert caught.value.status == 409
    assert "the object has been modified" in error_causes(caught.value)[0]
    assert get(widgets, namespace, "raced")["spec"]["maxReplicas"] == 4


def test_finalizer_delays_deletion_until_removed(widgets: client.CustomObjectsApi, namespace: str) -> None:
    body = widget("held")
    body["metadata"]["finalizers"] = ["kvtier.io/test-hold"]
    create(widgets, namespace, body)
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "held")
    held = get(widgets, namespace, "held")
    assert held["metadata"]["deletionTimestamp"]
    assert held["metadata"]["finalizers"] == ["kvtier.io/test-hold"]
    widgets.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "held", {"metadata": {"finalizers": None}}
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            get(widgets, namespace, "held")
        except ApiException as exc:
            assert exc.status == 404
            break
        assert time.monotonic() < deadline, "object still present 10s after its finalizer was removed"
        time.sleep(0.1)
