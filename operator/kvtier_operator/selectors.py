"""Label selectors: matching in memory (to route workload events) and as the API server's query string."""
from __future__ import annotations

from typing import Any, Mapping, Optional


def matches(selector: Optional[Mapping[str, Any]], labels: Optional[Mapping[str, str]]) -> bool:
    """Whether ``labels`` satisfy a Kubernetes LabelSelector (camelCase keys, as stored)."""
    if not selector:
        return False  # the CRD forbids an empty selector; never treat one as "everything"
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req.get("key"), req.get("operator"), req.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def to_query(selector: Mapping[str, Any]) -> str:
    """The ``labelSelector`` query parameter equivalent to a LabelSelector."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], sorted(req.get("values") or [])
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)
