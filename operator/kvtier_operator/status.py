"""Policy status: conditions computed from a reconcile, merged with the previous ones, written once.

``lastTransitionTime`` moves only when a condition's status flips, so a status that did not change compares
equal and is not written (no watch event, no reconcile loop on our own writes).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Optional

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Conflict")
GUARD_CONDITION_TYPES = ("SLOUnknown", "SLOBreached", "TierRolledBack")
# Each status field has one writer. The reconcile derives tier states (tiers.tier_states) from the spec and the
# guard's state; the guard owns its state, its verdict and the history. Conditions are shared by type: each
# writer recomputes only its own types (merge_conditions keeps the others).
RECONCILE_FIELDS = ("observedGeneration", "conditions", "engine", "activeTiers", "targets", "tiers")
GUARD_FIELDS = ("slo", "sloState", "history", "conditions")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Cond:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


def merge_conditions(old: Iterable[dict[str, Any]], new: Iterable[Cond], generation: Optional[int],
                     now: str) -> list[dict[str, Any]]:
    """New conditions, keeping each one's lastTransitionTime unless its status flipped.

    Conditions of types this reconcile does not compute (e.g. ``SLOUnknown`` from the SLO guard) are kept as they
    are, so the two writers do not erase each other.
    """
    old = list(old)
    previous = {c.get("type"): c for c in old}
    computed: dict[str, dict[str, Any]] = {}
    for c in new:
        before = previous.get(c.type)
        since = before.get("lastTransitionTime") if before and before.get("status") == c.status else None
        entry = {"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
                 "lastTransitionTime": since or now}
        if generation is not None:
            entry["observedGeneration"] = generation
        computed[c.type] = entry
    # Keep the stored order (two writers each recomputing their own types must not reorder the list).
    out = [computed.pop(c.get("type"), c) for c in old]
    return out + list(computed.values())


def overlay_conditions(current: Iterable[dict[str, Any]], ours: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``current`` with the entries of ``ours`` in place of the same types (stored order kept, new types last)."""
    mine = {c["type"]: c for c in ours}
    out = [mine.pop(c.get("type"), c) for c in current]
    return out + list(mine.values())


def transitions(old: Iterable[dict[str, Any]], new: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conditions whose status or reason changed (what users see as a change, and get an Event for)."""
    previous = {c.get("type"): c for c in old}
    return [c for c in new
            if (previous.get(c["type"]) or {}).get("status") != c["status"]
            or (previous.get(c["type"]) or {}).get("reason") != c["reason"]]


def merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) turning ``old`` into ``new``: keys that disappear are sent as null.

    Sending a whole nested object is not enough: a merge patch merges it into the stored one, so a key the new
    value lacks (a tier no longer in ``slo.disabled``) would survive.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_diff(old[k], v)
    return out


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Merge patch of the fields in ``new`` that differ from ``old``; None when nothing changed.

    Only the keys of ``new`` are considered (each writer owns its own status fields)."""
    changed = {k: merge_diff(old.get(k), v) for k, v in new.items() if old.get(k) != v}
    return changed or None


def condition(status: dict[str, Any], type_: str) -> Optional[dict[str, Any]]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)
