"""The one status write of a pass: a merge patch of what changed, guarded by a resourceVersion.

A policy's status has one writer, its pass (``controller``); kopf keeps its own bookkeeping in ``status.kopf``.
A 409 means someone wrote the policy since it was read (kopf's finalizer or bookkeeping, a label, an edit). If the
spec generation is unchanged, what the pass computed still holds: the patch is recomputed against the fresh status
and sent again at once. Otherwise the 409 is raised and the next pass computes anew.
"""
from __future__ import annotations

from typing import Any, Optional

from .kube import ApiError, Kube, policy_path
from .metrics import Metrics
from .status import status_patch

ATTEMPTS = 3


def write_status(kube: Kube, metrics: Metrics, policy: dict[str, Any], status: dict[str, Any]) -> bool:
    """Write ``status`` (the pass's whole document, ``status.compose``) onto ``policy``; True when something was
    written, False when the stored status already says it."""
    meta = policy["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    current: Optional[dict[str, Any]] = policy
    for _ in range(ATTEMPTS):
        assert current is not None
        patch = status_patch(current.get("status") or {}, status)
        if patch is None:
            return False
        try:
            kube.patch(policy_path(namespace, name, status=True),
                       {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}, "status": patch})
            metrics.api_writes.labels("status").inc()
            return True
        except ApiError as err:
            if err.status != 409:
                raise
            metrics.errors.labels("StatusConflict").inc()  # re-sent at once, not a retry
            current = kube.get(policy_path(namespace, name))
            if current is None or current["metadata"].get("generation") != generation:
                raise
    raise ApiError(409, {"reason": "Conflict", "message": "status kept changing under the operator"})
