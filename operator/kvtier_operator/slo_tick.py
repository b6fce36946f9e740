"""The SLO guard's step in a policy's pass (``controller``): evaluate ``spec.slo`` once, write nothing.

``evaluate`` takes the guard's state as the pass parsed it (``status.slo``, typed: ``api.guard_state``), runs
``slo.tick`` against the policy's Prometheus and returns a :class:`GuardStep`: the new state (typed; the pass dumps
it once, into the status it writes), its verdict (``sloState``), its conditions, its Events and whether a
``kvtier.io/reenable`` request was acknowledged. The pass folds the step into the one status it writes, and
re-plans with the new state when the tiers it derives changed, so the rendered configuration and status.tiers
follow the guard's verdict in the same pass. Rollbacks are Warning Events and count in
``kvtier_operator_tier_rollbacks_total``. An SLO configuration the guard cannot act on is ``SLOUnknown`` (the
stored state is kept, so fixing the spec or the Secret resumes counting where it stopped).
"""
from __future__ import annotations

import base64
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from . import slo
from .api import guard_state
from .api import v1alpha1 as api
from .api.guard_state import SLOGuardState
from .api.units import parse_duration
from .reports import Cond, Event
from .settings import REENABLE_ANNOTATION, Settings
from .slo import hit_ratios as hr
from .slo.client import PrometheusClientConfig, PrometheusSource, Unavailable, resolve_client_config
from .tiers import STORED, GuardInput, derive, enabled
from .trust import endpoint_problem

# The API's default spec.slo.interval, used until the spec can be read.
DEFAULT_INTERVAL = parse_duration(api.SLOSpec.model_fields["interval"].default)
QUERY_OVERRIDES_REFUSED = ("spec.slo.queries: query overrides are not allowed by the operator's admin (operator "
                           "setting allowQueryOverrides); remove spec.slo.queries to use the built-in queries, "
                           "which are scoped to this policy's targets")
log = logging.getLogger("kvtier.operator")
SLO_STATE = {"ok": "OK", "breach": "Breaching", "error": "Unknown", "noData": "NoData", "lowTraffic": "NoData"}


# ---------------------------------------------------------------------------------------------- secrets

class Kube(Protocol):
    """What the guard's step reads from the API server: the Secrets ``spec.slo.prometheus`` names, by path (the
    controller's ``kube.Kube``; the guard imports nothing from the controller)."""

    def get(self, path: str) -> Optional[dict[str, Any]]: ...


def client_config(kube: Kube, namespace: str, prom: slo.PrometheusSettings) -> PrometheusClientConfig:
    """``spec.slo.prometheus`` as a connectable config, its Secrets read from the policy's namespace.

    The slo package owns the field rules (``resolve_client_config``); this only supplies the Secret reader.
    """
    def read_secret(name: str, key: str) -> str:
        # Every failure reads the same in status (resolve_client_config): whether the Secret exists is not told.
        secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        raw = ((secret or {}).get("data") or {}).get(key)
        if raw is None:
            raise KeyError(key)
        return base64.b64decode(raw).decode()

    # The TLS context loads the CA bundle from a file; /tmp is writable in the chart's pod.
    return resolve_client_config(prom, read_secret, os.path.join(tempfile.gettempdir(), "kvtier-ca"))


# ---------------------------------------------------------------------------------------------- scope

# Pod names their controllers give: Deployment pods are ``<name>-<template hash, 1-10>-<suffix, 5>``, both drawn
# from Kubernetes' safe alphabet (k8s.io/apimachinery util/rand), StatefulSet pods ``<name>-<ordinal>``. Exact
# shapes, so a workload ``llm`` never claims the pods of ``llm-big``.
_SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
_POD_SUFFIX = {"Deployment": f"-{_SAFE}{{1,10}}-{_SAFE}{{5}}", "StatefulSet": "-[0-9]+"}
MATCH_NOTHING = "$^"


def scope_for(namespace: str, status: dict[str, Any], model_name: Optional[str]) -> Optional[slo.Scope]:
    """The policy's own pods: the namespace and the pods of the targets carrying the configuration, always;
    ``spec.slo.modelName`` narrows that further (the engine's ``model_name`` label), never replaces it (a model
    name alone matched every workload serving that model, other policies' and other teams' included).

    None when no target carries the configuration (none applied yet, or every one in conflict): the guard then
    queries nothing, rather than judging the policy by other pods.
    """
    patterns = sorted({re.escape(t["name"]) + _POD_SUFFIX.get(t.get("kind", ""), "-.+")
                       for t in status.get("targets") or [] if t.get("state") in ("Applied", "MissingConfigArgument")})
    if not patterns:
        return None
    return slo.Scope(namespace=namespace, pod_regex="|".join(patterns), model_name=model_name or None)


# ---------------------------------------------------------------------------------------------- one step

@dataclass
class GuardStep:
    """What one evaluation decided. ``state`` None: the stored state stays (misconfigured, nothing measured)."""

    interval: float
    slo_state: str
    conditions: list[Cond] = field(default_factory=list)
    state: Optional[SLOGuardState] = None
    events: list[Event] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    verdict: Optional[str] = None
    reenable_left: Optional[list[str]] = None  # the annotation's tiers still requested, when one was acknowledged
    problem: Optional[str] = None  # an InvalidConfiguration message (logged and counted by the caller)
    # Hit ratios measured after the SLO queries (informational; None: not measured in this evaluation).
    hit_ratios: Optional[hr.HitRatios] = None


NO_TARGETS = ("no workload of this policy carries its configuration yet, so the SLO guard queries nothing (it "
              "measures only the policy's own pods, never other pods of the namespace or of the model)")


def no_targets(interval: float) -> GuardStep:
    """Nothing to measure: said in status (SLOUnknown), the stored state kept, no query sent, no Event."""
    return GuardStep(interval=interval, slo_state="NoData", conditions=[Cond("SLOUnknown", "True", "NoTargets",
                                                                             NO_TARGETS)])


def reenable_requests(policy_obj: dict[str, Any]) -> list[str]:
    raw = (policy_obj["metadata"].get("annotations") or {}).get(REENABLE_ANNOTATION, "")
    return [t.strip() for t in raw.split(",") if t.strip()]


def misconfigured(message: str, interval: float) -> GuardStep:
    return GuardStep(interval=interval, slo_state="Unknown", verdict="error", problem=message,
                     conditions=[Cond("SLOUnknown", "True", "InvalidConfiguration", message)],
                     events=[Event("Warning", "InvalidSLOConfiguration", message)])


def measurement_source(kube: Kube, settings: Settings, namespace: str,
                       guard: slo.SLOSettings) -> tuple[Optional[Any], Optional[str]]:
    """The policy's Prometheus as a measurement source, or the reason it may not be asked (the admin's allowlist).

    (None, None): no Prometheus is configured, so there is nothing to measure.
    """
    if guard.prometheus is None:
        return None, None
    # Before any Secret is read: credentials go only to endpoints the admin allowed (docs/install.md).
    refused = endpoint_problem(guard.prometheus.url, settings.prometheus_allowed, settings.prometheus_allow_http)
    if refused:
        return None, refused
    try:
        config = client_config(kube, namespace, guard.prometheus)
    except ValueError:
        # A missing, forbidden or malformed Secret reads exactly like an unreachable endpoint: same reason, same
        # words (whether a Secret exists is not told).
        return Unavailable(guard.prometheus.url), None
    return PrometheusSource(config), None


def decide(guard: slo.SLOSettings, policy_obj: dict[str, Any], source: Any, scope: slo.Scope,
           now: float, state: GuardInput = STORED) -> GuardStep:
    """One evaluation against ``source`` at ``now`` (epoch seconds), from ``state`` (the guard's state as the pass
    parsed it; by default ``status.slo``, parsed here); pure apart from the source's queries. ValueError for a
    stored state a newer operator wrote, which this one must not overwrite."""
    status = policy_obj.get("status") or {}
    reenable = reenable_requests(policy_obj)
    stored = status.get("slo")
    stored = stored if isinstance(stored, dict) else None
    if isinstance(state, str):
        state = slo.read_state(stored, now)
    else:
        guard_state.check_version(stored)
    decision = slo.tick(guard, state, source, scope, now, engine=status.get("engine"),
                        reenable_requests=reenable, generation=policy_obj["metadata"].get("generation"))
    step = step_of(decision, guard.interval_s, reenable)
    step.hit_ratios = hit_ratios(guard, source, scope, decision, status.get("engine"))
    return step


def hit_ratios(guard: slo.SLOSettings, source: Any, scope: slo.Scope, decision: slo.Decision,
               engine: Optional[str] = None) -> Optional[hr.HitRatios]:
    """Each enabled tier's hit ratio (and the GPU prefix cache's), asked of ``source`` after the SLO queries.

    Informational: None when not measured (an engine without these counters, a source that cannot run a query,
    an evaluation whose SLO queries failed: Prometheus is not asked again), and nothing raised here reaches the
    guard, whose decision is already taken. The queries share one query timeout (``spec.slo.prometheus.timeout``).
    """
    chosen = engine or guard.engine or "vllm"
    query = getattr(source, "query_scalar", None)
    if chosen not in hr.ENGINES or query is None or decision.state.verdict == "error":
        return None
    try:
        # Backend native or lmcache exports no per-tier counters: only the GPU prefix cache is asked.
        tiers = enabled(derive(guard.declared, guard.staged, decision.state)) if guard.tier_counters else []
        declared = (*guard.tiers, *guard.spec_disabled_tiers)
        queries = hr.build(tiers, scope, guard.window_s, guard.idle_window_s, device=hr.DEVICE_TIER not in declared)
        # One query timeout for all of them, on top of the SLO queries (each query has the same deadline).
        return hr.measure(source, queries, budget_s=guard.prometheus.timeout_s)
    except Exception:
        log.warning("hit ratios not measured", exc_info=True)
        return None


def step_of(decision: slo.Decision, interval: float, reenable: Sequence[str] = ()) -> GuardStep:
    """A decision of the engine as the pass's step: its state, conditions, Events and acknowledgements (pure)."""
    verdict = decision.state.verdict
    step = GuardStep(interval=interval, state=decision.state, verdict=verdict,
                     slo_state=SLO_STATE.get(verdict or "", "Unknown"))
    acknowledged = []
    for a in decision.actions:
        if isinstance(a, slo.SetCondition):
            step.conditions.append(Cond(a.type, a.status, a.reason, a.message))
        elif isinstance(a, slo.DisableTier):
            if a.dry_run:
                step.events.append(Event("Normal", "WouldDisableTier", a.message))
            else:
                step.events.append(Event("Warning", "TierDisabled", a.message))
                step.rollbacks.append(a.tier)
        elif isinstance(a, slo.EnableTier):
            step.events.append(Event("Normal", "WouldEnableTier" if a.dry_run else "TierEnabled", a.message))
        elif isinstance(a, slo.RecordEvent):
            step.events.append(Event(a.type, a.reason, a.message))
        elif isinstance(a, slo.AcknowledgeReenable):
            acknowledged.append(a.tier)
    if acknowledged:
        step.reenable_left = [t for t in reenable if t not in acknowledged and t != "*"]
    return step


def evaluate(kube: Kube, settings: Settings, policy_obj: dict[str, Any], spec: api.KVCachePolicySpec,
             targets: list[dict[str, Any]], source: Optional[Any] = None, *, state: GuardInput = STORED,
             now: Optional[float] = None) -> Optional[GuardStep]:
    """The guard's step for a policy with ``spec.slo``; None when there is nothing to evaluate (no Prometheus).

    ``targets``: this pass's ``status.targets`` (whose pods are measured). ``source``: a measurement source to
    use instead of the policy's Prometheus (closed by the caller). ``state``: the guard's state as the pass parsed
    it (by default ``status.slo``, parsed here); ``now``: when the pass evaluates (epoch seconds; by default now).
    """
    try:
        guard = slo.SLOSettings.from_policy_spec(spec)
    except slo.SLOSpecError as err:
        return misconfigured("; ".join(err.problems), DEFAULT_INTERVAL)
    if guard.queries and not settings.allow_query_overrides:
        # An override is arbitrary PromQL sent with the namespace's Prometheus credentials, not scoped to the
        # policy's targets, and its numbers come back in status: the admin must allow it.
        return misconfigured(QUERY_OVERRIDES_REFUSED, guard.interval_s)
    namespace = policy_obj["metadata"]["namespace"]
    scope = scope_for(namespace, {"targets": targets}, guard.model_name)
    own = source is None
    if own:
        if scope is None and guard.prometheus is not None:
            # The admin's allowlist is reported first; no Secret is read when no query will be sent.
            refused = endpoint_problem(guard.prometheus.url, settings.prometheus_allowed,
                                       settings.prometheus_allow_http)
            if refused:
                return misconfigured(refused, guard.interval_s)
        if scope is None:
            return no_targets(guard.interval_s) if guard.prometheus is not None else None
        source, refused = measurement_source(kube, settings, namespace, guard)
        if refused:
            return misconfigured(refused, guard.interval_s)
        if source is None:
            return None
    elif scope is None:
        return no_targets(guard.interval_s)
    try:
        return decide(guard, policy_obj, source, scope, time.time() if now is None else now, state)
    finally:
        if own and source is not None:
            source.close()
