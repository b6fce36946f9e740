"""Per-tier state (``status.tiers``): which declared tiers are rendered. The one place it is derived.

Inputs: the declared tiers (name, enabled in the spec), whether the rollout is staged, the SLO guard's stored
state (``status.slo``, or None when there is no guard or it has not evaluated yet) and the previous
``status.tiers`` (for ``since``). The reconcile writes the result; the guard and its tools read it through the same
function, so both sides speak one vocabulary:

- ``Disabled``: ``DisabledInSpec`` (``enabled: false``) or the guard's reason (``SLOBreach``, ``ProbationBreach``);
- ``Pending``: ``StagedRollout`` (a staged rollout has not reached it);
- ``Enabled``: ``Enabled``, ``Probation`` (re-enabled automatically, on probation) or ``DryRunWouldDisable``.

Only Enabled tiers are rendered, and tiers the guard disabled where the engine bypasses them live (the control
file; ``guard_disabled``).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from .api import v1alpha1 as api

SPEC_DISABLED = "DisabledInSpec"
STAGED = "StagedRollout"


def derive(declared: Sequence[tuple[str, bool]], staged: bool, guard: Optional[Mapping[str, Any]],
           previous: Iterable[Mapping[str, Any]] = (), now: Optional[str] = None,
           measured: bool = False) -> list[dict[str, Any]]:
    """``status.tiers`` entries, in spec order. Pure.

    Without guard state a staged rollout starts GPU-only (every tier Pending) and an immediate one enables every
    declared tier, except that a tier the guard disabled earlier stays disabled (its state is in ``previous``).
    ``since`` is the guard's time when it has one, else kept from ``previous`` while the state and reason stay,
    else ``now``. ``measured`` (the policy has an SLO guard, which measures hit ratios): an Enabled tier keeps its
    ``hitRatio`` from ``previous`` until the guard's next evaluation replaces it (passes between evaluations
    measure nothing).
    """
    before = {t.get("name"): t for t in previous}
    disabled: Mapping[str, Any] = {}
    probation: Mapping[str, Any] = {}
    rolled: Optional[set[str]] = None  # None: every declared tier (no staged rollout in progress)
    if guard is not None:
        disabled = guard.get("disabled") or {}
        probation = guard.get("probation") or {}
        ro = guard.get("rollout")
        if staged:
            # A policy switched from immediate to staged keeps what it was running (its stored rollout).
            rolled = {t for t in ro.get("rolled") or [] if isinstance(t, str)} if isinstance(ro, Mapping) else set()
    elif staged:
        rolled = set()
    out = []
    for name, on in declared:
        prev = before.get(name)
        since: Optional[str] = None
        if not on:
            state, reason = "Disabled", SPEC_DISABLED
        elif guard is None and prev is not None and prev.get("state") == "Disabled" \
                and prev.get("reason") != SPEC_DISABLED:
            out.append(dict(prev))  # the guard's last word, kept while it has none
            continue
        elif isinstance(disabled.get(name), Mapping) and not disabled[name].get("dryRun"):
            state, reason, since = "Disabled", disabled[name].get("reason") or "Disabled", disabled[name].get("since")
        elif rolled is not None and name not in rolled:
            state, reason = "Pending", STAGED
        else:
            d = disabled.get(name) if isinstance(disabled.get(name), Mapping) else None
            state = "Enabled"
            reason = "Probation" if name in probation else ("DryRunWouldDisable" if d else "Enabled")
            since = (probation.get(name) or {}).get("since") or (d or {}).get("since")
        same = prev is not None and prev.get("state") == state and prev.get("reason") == reason
        entry = {"name": name, "state": state, "reason": reason,
                 "since": since or (prev.get("since") if same else None) or now}
        if measured and state == "Enabled" and prev is not None and prev.get("hitRatio") is not None:
            entry["hitRatio"] = prev["hitRatio"]
        out.append(entry)
    return out


def tier_states(spec: api.KVCachePolicySpec, status: Mapping[str, Any], now: str) -> list[dict[str, Any]]:
    """``status.tiers`` for a parsed spec and the stored status (its ``slo`` and ``tiers``)."""
    guard = status.get("slo") if spec.slo is not None else None
    return derive([(t.name, t.enabled) for t in spec.tiers], spec.rollout.strategy == "staged",
                  guard if isinstance(guard, Mapping) else None, status.get("tiers") or [], now,
                  measured=spec.slo is not None)


def enabled(states: Iterable[Mapping[str, Any]]) -> list[str]:
    return [t["name"] for t in states if t.get("state") == "Enabled"]


def guard_disabled(states: Iterable[Mapping[str, Any]]) -> list[str]:
    """Tiers Disabled by the SLO guard (not by the spec): an engine that reads the control file keeps them rendered
    and bypasses them live, so the guard's decision and its reversal need no restart."""
    return [t["name"] for t in states if t.get("state") == "Disabled" and t.get("reason") != SPEC_DISABLED]
