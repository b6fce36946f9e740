"""Label selectors: matching in memory (to route workload events) and as the API server's query string."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

CATCH_ALL_MESSAGE = ("a selector must name at least one label a workload carries: a matchLabels entry, or a "
                     "matchExpressions term with operator In or Exists (an empty selector, or NotIn and DoesNotExist "
                     "alone, select every workload of the namespace)")
VALUES_MESSAGE = "operators In and NotIn need at least one value; Exists and DoesNotExist take none"


def has_positive_term(selector: Optional[Mapping[str, Any]]) -> bool:
    """Whether the selector names a label a workload must carry (the rule against catch-alls in disguise; the
    CRD's CEL rule on LabelSelector says the same)."""
    if not selector:
        return False
    if selector.get("matchLabels"):
        return True
    return any(isinstance(r, Mapping) and r.get("operator") in ("In", "Exists")
               for r in selector.get("matchExpressions") or [])


def requirement_problem(operator: Optional[str], values: Optional[list[str]]) -> Optional[str]:
    if operator in ("In", "NotIn"):
        return None if values else VALUES_MESSAGE
    return VALUES_MESSAGE if values else None


def matches(selector: Optional[Mapping[str, Any]], labels: Optional[Mapping[str, str]]) -> bool:
    """Whether ``labels`` satisfy a Kubernetes LabelSelector (camelCase keys, as stored).

    A selector that names no label a workload must carry matches nothing here: the CRD refuses it, and one stored
    before that rule must not select, nor conflict with, every workload of its namespace."""
    if selector is None or not has_positive_term(selector):
        return False
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
