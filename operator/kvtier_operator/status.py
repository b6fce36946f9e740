"""Policy status: conditions computed from a reconcile, merged with the previous ones, written once.

``lastTransitionTime`` moves only when a condition's status flips, so a status that did not change compares
equal and is not written (no watch event, no reconcile loop on our own writes).
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Optional

from .printable import printable
from .reports import Cond

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Conflict", "Stalled")
GUARD_CONDITION_TYPES = ("SLOUnknown", "SLOBreached", "TierRolledBack", "TierIdle")
# Status fields that are not the operator's own document: kopf's bookkeeping (written by kopf) and ``history``
# (an older operator's copy of ``slo.history``, dropped from status when a pass writes it).
NOT_OURS = ("kopf",)
RETIRED = ("history",)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(old: Iterable[dict[str, Any]], new: Iterable[Cond], generation: Optional[int],
                     now: str) -> list[dict[str, Any]]:
    """New conditions, keeping each one's lastTransitionTime unless its status flipped.

    Conditions of types not computed in this call (e.g. ``SLOUnknown`` when the guard did not evaluate in this
    pass) are kept as they are.
    """
    old = list(old)
    previous = {c.get("type"): c for c in old}
    computed: dict[str, dict[str, Any]] = {}
    for c in new:
        before = previous.get(c.type)
        since = before.get("lastTransitionTime") if before and before.get("status") == c.status else None
        # Messages carry user input (URLs, paths, the server's words): escaped here, for every condition.
        entry = {"type": c.type, "status": c.status, "reason": c.reason, "message": printable(c.message),
                 "lastTransitionTime": since or now}
        if generation is not None:
            entry["observedGeneration"] = generation
        computed[c.type] = entry
    # Keep the stored order (a pass that recomputes some types must not reorder the list).
    out = [computed.pop(str(c.get("type")), c) for c in old]
    return out + list(computed.values())


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

    Only the keys of ``new`` are considered (kopf's own fields are not the operator's to send)."""
    changed = {k: merge_diff(old.get(k), v) for k, v in new.items() if old.get(k) != v}
    return changed or None


def compose(old: dict[str, Any], computed: dict[str, Any]) -> dict[str, Any]:
    """The policy's status after a pass: what the pass computed over what is stored, validated as the API's
    ``KVCachePolicyStatus`` and serialised once. Fields the pass did not compute (a refusal computes no targets;
    a pass without an SLO evaluation computes no ``slo``) keep their stored values; retired fields are removed.
    """
    from .api.v1alpha1 import KVCachePolicyStatus  # pydantic models: loaded with the API, not with this module

    merged = {k: v for k, v in {**old, **computed}.items() if k not in NOT_OURS and k not in RETIRED}
    guard_state = merged.pop("slo", None)  # already the guard's typed state (api.guard_state, via slo.evaluate)
    doc = KVCachePolicyStatus.model_validate(merged).model_dump(
        by_alias=True, exclude_none=True, exclude_unset=True, exclude={"kopf"})
    if guard_state is not None:
        doc["slo"] = guard_state
    for key in RETIRED:
        if key in old:
            doc[key] = None
    # A field the pass computed as None is cleared (e.g. remoteStoreBudgetBytes once the guard disabled the remote
    # tier); left out of the patch, the stored value would stay forever.
    for key, value in computed.items():
        if value is None and key in old and key not in NOT_OURS:
            doc[key] = None
    return doc


def condition(status: dict[str, Any], type_: str) -> Optional[dict[str, Any]]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)
