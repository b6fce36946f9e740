"""Policy documents for the foundation tests."""
import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "kvtier.io/v1alpha1",
    "kind": "KVCachePolicy",
    "metadata": {"name": "llama", "namespace": "serving"},
    "spec": {
        "selector": {"matchLabels": {"app": "llama-70b"}},
        "engine": "vllm",
        "blockSize": 16,
        "tiers": [
            {"name": "host", "medium": "cpu", "size": "16Gi"},
            {"name": "nvme", "medium": "filesystem", "size": "500Gi", "path": "/mnt/kvcache",
             "volume": {"emptyDir": {}}},
        ],
    },
}


def policy(**spec_overrides: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for key, value in spec_overrides.items():
        if value is None:
            doc["spec"].pop(key, None)
        else:
            doc["spec"][key] = value
    return doc


def cpu(**kw: Any) -> dict[str, Any]:
    return {"name": "host", "medium": "cpu", "size": "16Gi", **kw}


def disk(name: str = "nvme", **kw: Any) -> dict[str, Any]:
    return {"name": name, "medium": "filesystem", "size": "500Gi", "path": f"/mnt/{name}",
            "volume": {"emptyDir": {}}, **kw}
