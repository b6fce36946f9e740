"""The operator as it ships: installed by its chart as a pod on a real node, from the image images/build makes.
Its probes pass through the kubelet, it runs as the chart's non-root user on a read-only root filesystem, its
metrics port answers, and it works the API server through in-cluster config and the chart's RBAC."""

from __future__ import annotations

import urllib.request

import pytest
from kubernetes import client
from plugins.node import NODE_NAME, OPERATOR_NAMESPACE, NodeCluster, image_ref, wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.slow]


def operator_pod(core: client.CoreV1Api) -> client.V1Pod:
    pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=kvtier").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def test_the_chart_runs_the_operator_image_as_a_ready_pod_on_the_node(node_cluster: NodeCluster) -> None:
    with node_cluster.cp.api_client() as api:
        core = client.CoreV1Api(api)
        pod = operator_pod(core)
    assert pod.spec.node_name == NODE_NAME
    assert pod.spec.containers[0].image == image_ref("operator")
    ready = [c.status for c in pod.status.conditions if c.type == "Ready"]
    assert ready == ["True"] and pod.status.container_statuses[0].restart_count == 0


def test_it_runs_as_the_charts_non_root_user_on_a_read_only_root(node_cluster: NodeCluster) -> None:
    with node_cluster.cp.api_client() as api:
        name = operator_pod(client.CoreV1Api(api)).metadata.name
    script = "id -u; id -g; touch /probe 2>&1 || true; touch /tmp/probe && echo tmp-writable"
    out = node_cluster.cp.kubectl("-n", OPERATOR_NAMESPACE, "exec", name, "--", "sh", "-c", script).stdout.splitlines()
    assert out[0:2] == ["65532", "65532"]
    assert "Read-only file system" in out[2] and out[3] == "tmp-writable"


def test_its_metrics_port_answers(node_cluster: NodeCluster) -> None:
    with node_cluster.cp.api_client() as api:
        pod = operator_pod(client.CoreV1Api(api))
    # The host reaches pod IPs on the node's bridge.
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:9090/metrics", timeout=10) as response:
        body = response.read().decode()
    assert "kvtier_operator_" in body


def test_it_reconciles_through_in_cluster_config_and_the_charts_rbac(node_cluster: NodeCluster) -> None:
    policy = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCachePolicy",
        "metadata": {"name": "no-targets", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "nothing-here"}},
            "engine": "vllm",
            "blockSize": 16,
            "backend": "native",
            "tiers": [{"name": "host", "medium": "cpu", "size": "64Mi"}],
        },
    }
    with node_cluster.cp.api_client() as api:
        custom = client.CustomObjectsApi(api)
        custom.create_namespaced_custom_object("kvtier.io", "v1alpha1", "default", "kvcachepolicies", policy)
        try:
            def ready_reason():
                obj = custom.get_namespaced_custom_object("kvtier.io", "v1alpha1", "default", "kvcachepolicies", "no-targets")
                conditions = (obj.get("status") or {}).get("conditions") or []
                return next((c["reason"] for c in conditions if c["type"] == "Ready"), None)

            assert wait_until(ready_reason, 60, "the operator's status on the policy") == "NoTargets"
        finally:
            custom.delete_namespaced_custom_object("kvtier.io", "v1alpha1", "default", "kvcachepolicies", "no-targets")
