"""Every CRD in the repository's crds/ is accepted by the real API server, Established, and served.

The `controlplane` fixture applies crds/; when the server refuses a CRD (a schema that is not structural, a
CEL rule that does not compile or is over its cost budget), these tests fail with the server's own message.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from plugins.controlplane import CRDS_DIR, ControlPlane, is_established, manifest_documents

pytestmark = pytest.mark.controlplane

REPOSITORY_CRDS = [d for d in manifest_documents(CRDS_DIR) if d["kind"] == "CustomResourceDefinition"]


@pytest.mark.parametrize("crd", REPOSITORY_CRDS, ids=[d["metadata"]["name"] for d in REPOSITORY_CRDS])
def test_repository_crd_is_established_and_served(controlplane: ControlPlane, namespace: str,
                                                 crd: dict[str, Any]) -> None:
    with controlplane.api_client() as api:
        stored = api.sanitize_for_serialization(
            client.ApiextensionsV1Api(api).read_custom_resource_definition(crd["metadata"]["name"])
        )
        assert is_established(stored)
        spec = crd["spec"]
        objects = client.CustomObjectsApi(api)
        for version in (v["name"] for v in spec["versions"] if v.get("served", True)):
            # Served: listing answers. In a namespace of this test's own, since the session's server is shared and
            # other tests' namespaces (and what is in them) may still be on their way out.
            if spec["scope"] == "Namespaced":
                listed = objects.list_namespaced_custom_object(spec["group"], version, namespace,
                                                               spec["names"]["plural"])
            else:
                listed = objects.list_cluster_custom_object(spec["group"], version, spec["names"]["plural"])
            assert listed["kind"].endswith("List") and isinstance(listed["items"], list)
