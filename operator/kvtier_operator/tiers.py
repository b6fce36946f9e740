"""Per-tier state (``status.tiers``): which declared tiers are rendered. The one place it is derived.

Inputs: the declared tiers (name, enabled in the spec), whether the rollout is staged, the SLO guard's stored
state (``status.slo``, or None when there is no guard or it has not evaluated yet) and the previous
``status.tiers`` (for ``since``). The reconcile writes the result; the guard and its tools read it through the same
function, so both sides speak one vocabulary:

- ``Disabled``: ``DisabledInSpec`` (``enabled: false``) or the guard's reason (``SLOBreach``, ``ProbationBreach``);
- ``Pending``: ``StagedRollout`` (a staged rollout has not reached it);
- ``Enabled``: ``Enabled``, ``Probation`` (re-enabled automatically, on probation) or ``DryRunWouldDisable``.

Only Enabled tiers are rendered, and tiers the guard disabled where the engine bypasses them live (the control
file; ``guard_disabled``). The tier an SLO breach rolls back is the newest of the Enabled ones
(:func:`newest_enabled`): the guard asks this module, it has no rule of its own.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal, Optional, Union

from .api import v1alpha1 as api
from .api.guard_state import SLOGuardState
from .api.guard_state import read as read_guard_state

SPEC_DISABLED = "DisabledInSpec"
STAGED = "StagedRollout"
DRY_RUN = "DryRunWouldDisable"


def derive(declared: Sequence[tuple[str, bool]], staged: bool, guard: Optional[SLOGuardState],
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
    disabled = guard.disabled if guard is not None else {}
    probation = guard.probation if guard is not None else {}
    rolled: Optional[set[str]] = None  # None: every declared tier (no staged rollout in progress)
    if staged:
        # A policy switched from immediate to staged keeps what it was running (its stored rollout).
        rolled = set(guard.rollout.rolled) if guard is not None and guard.rollout is not None else set()
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
        elif name in disabled and not disabled[name].dry_run:
            state, reason, since = "Disabled", disabled[name].reason or "Disabled", disabled[name].since
        elif rolled is not None and name not in rolled:
            state, reason = "Pending", STAGED
        else:
            d, p = disabled.get(name), probation.get(name)
            state = "Enabled"
            reason = "Probation" if p is not None else (DRY_RUN if d is not None else "Enabled")
            since = (p.since if p is not None else None) or (d.since if d is not None else None)
        same = prev is not None and prev.get("state") == state and prev.get("reason") == reason
        entry = {"name": name, "state": state, "reason": reason,
                 "since": since or (prev.get("since") if same and prev is not None else None) or now}
        if measured and state == "Enabled" and prev is not None and prev.get("hitRatio") is not None:
            entry["hitRatio"] = prev["hitRatio"]
        out.append(entry)
    return out


# A pass's guard state: the typed state (None: no guard state), or STORED: parse ``status.slo`` where it is needed.
STORED: Final = "stored"
GuardInput = Union[SLOGuardState, None, Literal["stored"]]


def stored_guard(spec: api.KVCachePolicySpec, status: Mapping[str, Any], now: str) -> Optional[SLOGuardState]:
    """``status.slo`` parsed (once per pass: the pass hands the result on), None without ``spec.slo`` or before the
    guard's first evaluation. Read for rendering, never refused: a state a newer operator wrote is read for what
    this one understands (the guard itself refuses to evaluate it: ``api.guard_state.check_version``)."""
    stored = status.get("slo") if spec.slo is not None else None
    return read_guard_state(stored, now) if isinstance(stored, Mapping) else None


def tier_states(spec: api.KVCachePolicySpec, status: Mapping[str, Any], now: str,
                guard: GuardInput = STORED) -> list[dict[str, Any]]:
    """``status.tiers`` for a parsed spec, the stored status (its ``tiers``) and the guard's state (by default
    ``status.slo``, parsed here)."""
    state = stored_guard(spec, status, now) if isinstance(guard, str) else guard
    return derive([(t.name, t.enabled) for t in spec.tiers], spec.rollout.strategy == "staged",
                  state, status.get("tiers") or [], now, measured=spec.slo is not None)


def enabled(states: Iterable[Mapping[str, Any]]) -> list[str]:
    return [t["name"] for t in states if t.get("state") == "Enabled"]


def newest_enabled(states: Iterable[Mapping[str, Any]], simulated: bool = False) -> Optional[str]:
    """The newest (coldest) Enabled tier of :func:`derive`'s ``states``: the one an SLO breach rolls back first.
    None: GPU-only. ``simulated`` (a dry run): the tiers it would have disabled count as disabled, so its
    simulation moves on to the next tier as a real guard would."""
    names = [t["name"] for t in states
             if t.get("state") == "Enabled" and not (simulated and t.get("reason") == DRY_RUN)]
    return names[-1] if names else None


def guard_disabled(states: Iterable[Mapping[str, Any]]) -> list[str]:
    """Tiers Disabled by the SLO guard (not by the spec): an engine that reads the control file keeps them rendered
    and bypasses them live, so the guard's decision and its reversal need no restart."""
    return [t["name"] for t in states if t.get("state") == "Disabled" and t.get("reason") != SPEC_DISABLED]
