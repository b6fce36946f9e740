"""Which watch events mean work: what the kopf event handlers ask before waking a policy.

A policy is re-planned when what it renders from changed: its generation (the spec), its selector, its
``kvtier.io/reenable`` annotation, or its deletion. Its own status writes, kopf's finalizer patch and label edits
are not that. A workload event matters unless it is the echo of the operator's own apply (same resourceVersion)
or only its status moved without finishing or restarting a rollout: a status-only update matters only when it
flips whether the controller has caught up (what ``Progressing`` reports; the caller coalesces it). A rollout
updates a Deployment's status several times; each used to cost a reconcile. Pure bookkeeping, no I/O, so it is
tested without kopf.
"""
from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

from .settings import REENABLE_ANNOTATION

WorkloadChange = Literal["echo", "quiet", "status", "change", "deleted"]


@dataclass(frozen=True)
class PolicyChange:
    """A policy event that means work. ``retargeted``: its selector appeared, changed or it is going away, so
    the policies sharing its workloads may see their conflicts change; ``old_selector`` is what it selected."""

    retargeted: bool
    old_selector: Optional[dict[str, Any]]
    known: bool  # seen before this event (False: e.g. deleted while the operator was down)


class EventFilter:
    def __init__(self) -> None:
        self._policies: dict[Hashable, tuple[Any, ...]] = {}
        self._own_writes: dict[Hashable, str] = {}
        self._workloads: dict[Hashable, tuple[Any, ...]] = {}

    # ----------------------------------------------------------------------------------------- policies

    def policy(self, key: Hashable, event_type: str, meta: Mapping[str, Any],
               selector: Optional[Mapping[str, Any]]) -> Optional[PolicyChange]:
        """None when the event changes nothing a plan reads."""
        before = self._policies.get(key)
        old_selector = json.loads(before[2]) if before is not None else None
        if event_type == "DELETED":
            self._policies.pop(key, None)
            return PolicyChange(True, old_selector, before is not None)
        fingerprint = (meta.get("generation"), (meta.get("annotations") or {}).get(REENABLE_ANNOTATION),
                       json.dumps(selector, sort_keys=True), bool(meta.get("deletionTimestamp")))
        if before == fingerprint:
            return None
        self._policies[key] = fingerprint
        return PolicyChange(before is None or before[2:] != fingerprint[2:], old_selector, before is not None)

    # ----------------------------------------------------------------------------------------- workloads

    def wrote(self, key: Hashable, resource_version: str) -> None:
        """The operator's own write left the workload at ``resource_version``: its event is an echo."""
        self._own_writes[key] = resource_version

    def workload(self, key: Hashable, event_type: str, meta: Mapping[str, Any],
                 rolled_out: bool = False) -> WorkloadChange:
        """``echo``: the operator's own write; ``quiet``: status moved, nothing a plan shows changed;
        ``status``: a rollout finished or restarted; ``change``: spec or labels; ``deleted``."""
        if event_type == "DELETED":
            self._workloads.pop(key, None)
            self._own_writes.pop(key, None)
            return "deleted"
        before = self._workloads.get(key)
        seen = (meta.get("generation"), json.dumps(dict(meta.get("labels") or {}), sort_keys=True), rolled_out)
        self._workloads[key] = seen
        if self._own_writes.get(key) == meta.get("resourceVersion"):
            return "echo"  # remembered, so the controller's updates after our apply are status-only
        if before is None or before[:2] != seen[:2]:
            return "change"
        return "quiet" if before[2] == rolled_out else "status"

    def remembers(self, key: Hashable) -> bool:
        """Whether anything about workload ``key`` is kept (nothing is, once it is deleted: no growth with churn)."""
        return key in self._own_writes or key in self._workloads
