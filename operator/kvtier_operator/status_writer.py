"""The one way status is written: a merge patch of the writer's own fields, guarded by a resourceVersion.

Two writers share ``status``, each owning its fields (``status.RECONCILE_FIELDS``, ``status.GUARD_FIELDS``). A
409 means someone wrote the policy since it was read. If what the writer computed from is unchanged in the fresh
object (``same_basis``: e.g. the same generation, the same guard state), the patch is recomputed against the fresh
status and sent again at once; otherwise the 409 is raised and the caller computes anew.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .kube import ApiError, Kube, policy_path
from .metrics import Metrics
from .status import overlay_conditions, status_patch

ATTEMPTS = 3


def write_status(kube: Kube, metrics: Metrics, policy: dict[str, Any], fields: dict[str, Any],
                 same_basis: Callable[[dict[str, Any]], bool], conditions: tuple[str, ...] = ()) -> bool:
    """Write ``fields`` (the writer's own) onto ``policy``'s status; True when something was written.

    ``conditions``: the condition types this writer owns. ``status.conditions`` is one list shared by both
    writers, so on every attempt the writer's own entries are laid over the list as it is now, never the list
    it read (re-sending that would erase a condition the other writer added in between).
    """
    meta = policy["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    current: Optional[dict[str, Any]] = policy
    ours = [c for c in fields.get("conditions") or [] if c.get("type") in conditions]
    for _ in range(ATTEMPTS):
        assert current is not None
        status = current.get("status") or {}
        if "conditions" in fields:
            fields = {**fields, "conditions": overlay_conditions(status.get("conditions") or [], ours)}
        patch = status_patch(status, fields)
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
            if current is None or not same_basis(current):
                raise
    raise ApiError(409, {"reason": "Conflict", "message": "status kept changing under the operator"})


def same_generation(policy: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    generation = policy["metadata"].get("generation")
    return lambda fresh: fresh["metadata"].get("generation") == generation
