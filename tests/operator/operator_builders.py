"""Objects as the API server returns them, for the operator's tests (pure and against the control plane)."""
from __future__ import annotations

import copy
from typing import Any, Optional

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
               container: str = "vllm") -> dict[str, Any]:
    """A serving workload manifest, as a user writes it (no status, no managedFields)."""
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
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": name}},
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
