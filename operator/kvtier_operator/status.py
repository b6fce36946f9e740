"""Policy status: conditions computed from a reconcile, merged with the previous ones, written once.

``lastTransitionTime`` moves only when a condition's status flips, so a status that did not change compares
equal and is not written (no watch event, no reconcile loop on our own writes).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Optional

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Conflict")
# Fields of status the reconcile owns; the SLO guard owns slo, sloState and history, and tier states it flips.
RECONCILE_FIELDS = ("observedGeneration", "conditions", "engine", "activeTiers", "targets", "tiers")


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


def transitions(old: Iterable[dict[str, Any]], new: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conditions whose status or reason changed (what users see as a change, and get an Event for)."""
    previous = {c.get("type"): c for c in old}
    return [c for c in new
            if (previous.get(c["type"]) or {}).get("status") != c["status"]
            or (previous.get(c["type"]) or {}).get("reason") != c["reason"]]


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Merge patch of the fields in ``new`` that differ from ``old``; None when nothing changed.

    Top-level fields absent from ``new`` are left alone (the reconcile and the SLO guard each write their own).
    Within a field, a key that ``new`` no longer has is sent as null: a JSON merge patch merges objects, so
    without it a tier removed from ``slo.disabled`` would stay there and a re-enabled tier would stay off.
    """
    changed = {k: _merge_diff(old.get(k), v) for k, v in new.items() if not _same(old.get(k), v)}
    return changed or None


def _same(old: Any, new: Any) -> bool:
    """Equal as stored: a null and a missing key read back alike."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(_same(old.get(k), new.get(k)) for k in set(old) | set(new))
    return old == new


def _merge_diff(old: Any, new: Any) -> Any:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out: dict[str, Any] = {}
    for key in set(old) | set(new):
        if key not in new or new[key] is None:
            if old.get(key) is not None:
                out[key] = None
        elif not _same(old.get(key), new[key]):
            out[key] = _merge_diff(old.get(key), new[key])
    return out


def condition(status: dict[str, Any], type_: str) -> Optional[dict[str, Any]]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)
