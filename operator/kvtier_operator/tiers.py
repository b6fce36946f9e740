"""Per-tier state in status: which declared tiers are rendered.

The reconcile only seeds and tidies ``status.tiers`` (new tiers, tiers removed or switched off in the spec); the
SLO guard moves tiers between Enabled, Disabled and Pending. Only Enabled tiers are rendered.
"""
from __future__ import annotations

from typing import Any, Iterable

from .api import v1alpha1 as api

SPEC_DISABLED = "DisabledInSpec"


def tier_states(spec: api.KVCachePolicySpec, old: Iterable[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    previous = {t.get("name"): t for t in old}
    staged = spec.rollout.strategy == "staged"
    out = []
    for tier in spec.tiers:
        before = previous.get(tier.name)
        if not tier.enabled:
            entry = {"name": tier.name, "state": "Disabled", "reason": SPEC_DISABLED}
        elif before is None or (before.get("state") == "Disabled" and before.get("reason") == SPEC_DISABLED):
            entry = ({"name": tier.name, "state": "Pending", "reason": "WaitingForStage"} if staged
                     else {"name": tier.name, "state": "Enabled", "reason": "Declared"})
        else:
            out.append(before)
            continue
        same = before is not None and before.get("state") == entry["state"] and before.get("reason") == entry["reason"]
        entry["since"] = before.get("since", now) if same and before else now
        out.append(entry)
    return out


def enabled(states: Iterable[dict[str, Any]]) -> list[str]:
    return [t["name"] for t in states if t.get("state") == "Enabled"]
