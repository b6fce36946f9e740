"""From a guard :class:`Decision` to the policy's status fields, so the operator's timer only patches.

Pure: previous conditions and the time come in, the merged status fields go out; ``lastTransitionTime`` changes
only when a condition's status flips, as Kubernetes conventions require.
"""
from __future__ import annotations

from typing import Any, Iterable

from .decisions import Decision, SetCondition, enabled_tiers, format_time, tier_states
from .settings import SLOSettings

SLO_STATE = {"ok": "OK", "breach": "Breaching", "error": "Unknown", "noData": "NoData", "lowTraffic": "NoData"}
GUARD_CONDITIONS = ("SLOUnknown", "SLOBreached", "TierRolledBack")


def merge_conditions(previous: Iterable[dict[str, Any]], updates: Iterable[SetCondition], now: float,
                     generation: int | None = None) -> list[dict[str, Any]]:
    """Conditions with ``updates`` applied; other types (Ready, Conflict, ...) are kept as they were."""
    out = [dict(c) for c in previous]
    by_type = {c.get("type"): c for c in out}
    for update in updates:
        old = by_type.get(update.type)
        new = {"type": update.type, "status": update.status, "reason": update.reason, "message": update.message,
               "lastTransitionTime": format_time(now)}
        if generation is not None:
            new["observedGeneration"] = generation
        if old is not None:
            if old.get("status") == update.status and old.get("lastTransitionTime"):
                new["lastTransitionTime"] = old["lastTransitionTime"]
            old.clear()
            old.update(new)
        else:
            out.append(new)
            by_type[update.type] = new
    return out


def status_fields(settings: SLOSettings, decision: Decision, previous_conditions: Iterable[dict[str, Any]],
                  now: float, generation: int | None = None) -> dict[str, Any]:
    """``status`` keys the guard owns: slo, tiers, history, activeTiers, sloState, conditions (merged)."""
    state = decision.state
    active = enabled_tiers(settings, state)
    return {
        "slo": state,
        "tiers": tier_states(settings, state),
        "history": list(state.get("history", [])),
        "activeTiers": ",".join(active) if active else "none",
        "sloState": "DryRun:" + SLO_STATE.get(state.get("verdict"), "Unknown") if settings.dry_run
        else SLO_STATE.get(state.get("verdict"), "Unknown"),
        "conditions": merge_conditions(previous_conditions,
                                       [a for a in decision.actions if isinstance(a, SetCondition)], now, generation),
    }
