"""The SLO guard (``kvtier_operator.slo``) wired into the operator.

One kopf daemon per policy with ``spec.slo`` evaluates every ``spec.slo.interval`` (kopf timers have one interval
per handler, a daemon can read it from each object's spec). Each evaluation reads the stored guard state from
``status.slo``, runs ``slo.tick`` against Prometheus, and writes back in one status write: the new state, the tier
states it implies, the SLO conditions, ``sloState`` and ``history``. A tier change wakes the policy's reconcile,
which renders only Enabled tiers (``guarded_tier_states``). Rollbacks are Warning Events and count in
``kvtier_operator_tier_rollbacks_total``. Evaluation and reconcile share the policy's lock, and every status write
is guarded by the resourceVersion it was computed from.

Importing this module fails when the ``slo`` package is absent; ``main`` then runs without the guard.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import kopf

from . import slo
from .api import v1alpha1 as api
from .handlers import POLICY, Operator, _reason
from .kube import Kube, policy_path
from .settings import REENABLE_ANNOTATION
from .reconcile import Event
from .slo.client import PrometheusClientConfig, PrometheusSource, resolve_client_config
from .status import Cond, merge_conditions, now_rfc3339, status_patch
from .tiers import SPEC_DISABLED, enabled, tier_states
from .trust import endpoint_problem

log = logging.getLogger("kvtier.slo")
HISTORY_LIMIT = 50
DEFAULT_INTERVAL = 30.0  # the API's default spec.slo.interval, used until the spec can be read
SLO_STATE = {"ok": "OK", "breach": "Breaching", "error": "Unknown", "noData": "NoData", "lowTraffic": "NoData"}


def guarded_tier_states(spec: api.KVCachePolicySpec, policy_obj: dict[str, Any], now: str) -> list[dict[str, Any]]:
    """Tier states for the reconcile: the spec's seeding, overridden by the guard's state once it has one."""
    status = policy_obj.get("status") or {}
    base = tier_states(spec, status.get("tiers") or [], now)
    if spec.slo is None or not status.get("slo"):
        return base
    try:
        settings = slo.SLOSettings.from_spec(policy_obj.get("spec") or {})
    except slo.SLOSpecError:
        return base
    guard = {t["name"]: t for t in slo.tier_states(settings, status["slo"])}
    return [_combine(b, guard.get(b["name"]), now) for b in base]


def _combine(base: dict[str, Any], guard: Optional[dict[str, Any]], now: str) -> dict[str, Any]:
    if guard is None or base.get("reason") == SPEC_DISABLED:
        return base
    entry = {"name": base["name"], "state": guard["state"], "reason": guard.get("reason") or guard["state"]}
    same = base.get("state") == entry["state"] and base.get("reason") == entry["reason"]
    entry["since"] = guard.get("since") or (base.get("since") if same else None) or now
    return entry


# ---------------------------------------------------------------------------------------------- secrets

def client_config(kube: Kube, namespace: str, prom: "slo.PrometheusSettings") -> PrometheusClientConfig:
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

    # requests verifies TLS against a file; /tmp is writable in the chart's pod.
    return resolve_client_config(prom, read_secret, os.path.join(tempfile.gettempdir(), "kvtier-ca"))


# ---------------------------------------------------------------------------------------------- scope

# Pod names their controllers give: Deployment pods are ``<name>-<template hash, 1-10>-<suffix, 5>``, both drawn
# from Kubernetes' safe alphabet (k8s.io/apimachinery util/rand), StatefulSet pods ``<name>-<ordinal>``. Exact
# shapes, so a workload ``llm`` never claims the pods of ``llm-big``.
_SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
_POD_SUFFIX = {"Deployment": f"-{_SAFE}{{1,10}}-{_SAFE}{{5}}", "StatefulSet": "-[0-9]+"}
MATCH_NOTHING = "$^"


def scope_for(namespace: str, status: dict[str, Any], spec: dict[str, Any]) -> "slo.Scope":
    """The target pods: ``spec.slo.modelName`` when set, else the pods of the targets carrying the configuration.

    With neither (no target applied yet, or every one in conflict), nothing matches: the guard must never judge
    a policy by the other pods of its namespace (no data, so no verdict).
    """
    model = (spec.get("slo") or {}).get("modelName")
    if model:
        return slo.Scope(namespace=namespace, model_name=model)
    patterns = sorted({re.escape(t["name"]) + _POD_SUFFIX.get(t.get("kind", ""), "-.+")
                       for t in status.get("targets") or [] if t.get("state") in ("Applied", "MissingConfigArgument")})
    return slo.Scope(namespace=namespace, pod_regex="|".join(patterns) if patterns else MATCH_NOTHING)


# ---------------------------------------------------------------------------------------------- one tick

def guard_status(spec: dict[str, Any], status: dict[str, Any], decision: "slo.Decision", generation: Optional[int],
                 now: str) -> dict[str, Any]:
    """The status fields one evaluation owns, merged with the stored ones; pure, so tests check it directly.

    Conditions of other types (Ready, Conflict, ...) are kept; ``lastTransitionTime`` moves only on a flip.
    """
    state = decision.state
    conds = [Cond(a.type, a.status, a.reason, a.message) for a in decision.actions if isinstance(a, slo.SetCondition)]
    parsed = api.KVCachePolicySpec.model_validate(spec)
    return {
        "slo": state,
        "sloState": SLO_STATE.get(state.get("verdict") or "", "Unknown"),
        "tiers": guarded_tier_states(parsed, {"spec": spec, "status": {**status, "slo": state}}, now),
        "conditions": merge_conditions(status.get("conditions") or [], conds, generation, now),
        # The guard keeps its history in the API's HistoryEntry shape; status.history mirrors it (bounded).
        "history": list(state.get("history") or [])[-HISTORY_LIMIT:],
    }


@dataclass
class TickResult:
    interval: float
    tiers_changed: bool = False
    events: list[Event] = field(default_factory=list)
    body: Optional[dict[str, Any]] = None
    rollbacks: list[str] = field(default_factory=list)
    verdict: Optional[str] = None


def guard_tick_sync(op: Operator, namespace: str, name: str, source: Optional[Any] = None) -> Optional[TickResult]:
    pol = op.kube.get(policy_path(namespace, name))
    if pol is None or pol["metadata"].get("deletionTimestamp"):
        return None
    spec, status = pol.get("spec") or {}, pol.get("status") or {}
    if not spec.get("slo"):
        return None
    try:
        settings = slo.SLOSettings.from_spec(spec)
    except slo.SLOSpecError as err:
        return _misconfigured(op, pol, "; ".join(err.problems), DEFAULT_INTERVAL)
    result = TickResult(interval=settings.interval_s, body=pol)
    reenable = [t.strip() for t in (pol["metadata"].get("annotations") or {}).get(REENABLE_ANNOTATION, "").split(",")
                if t.strip()]
    if source is None and op.slo_source is not None:
        source = op.slo_source(namespace, name)  # injected by tests: a scripted measurement source
    own_source = source is None
    if own_source:
        if settings.prometheus is None:
            return result
        # Before any Secret is read: credentials go only to endpoints the admin allowed (docs/install.md).
        refused = endpoint_problem(settings.prometheus.url, op.settings.prometheus_allowed,
                                  op.settings.prometheus_allow_http)
        if refused:
            return _misconfigured(op, pol, refused, settings.interval_s)
        try:
            config = client_config(op.kube, namespace, settings.prometheus)
        except ValueError as err:  # a missing Secret or key, a bad CA bundle: the message names the field
            return _misconfigured(op, pol, str(err), settings.interval_s)
        source = PrometheusSource(config)
    try:
        decision = slo.tick(settings, status.get("slo"), source, scope_for(namespace, status, spec), time.time(),
                            engine=status.get("engine"), reenable_requests=reenable,
                            generation=pol["metadata"].get("generation"))
    finally:
        if own_source:
            source.close()
    now = now_rfc3339()
    result.verdict = decision.state.get("verdict")
    generation = pol["metadata"].get("generation")
    acknowledged = []
    for a in decision.actions:
        if isinstance(a, slo.DisableTier):
            if a.dry_run:
                result.events.append(Event("Normal", "WouldDisableTier", a.message))
            else:
                result.events.append(Event("Warning", "TierDisabled", a.message))
                result.rollbacks.append(a.tier)
        elif isinstance(a, slo.EnableTier):
            result.events.append(Event("Normal", "WouldEnableTier" if a.dry_run else "TierEnabled", a.message))
        elif isinstance(a, slo.RecordEvent):
            result.events.append(Event(a.type, a.reason, a.message))
        elif isinstance(a, slo.AcknowledgeReenable):
            acknowledged.append(a.tier)
    new = guard_status(spec, status, decision, generation, now)
    result.tiers_changed = enabled(new["tiers"]) != enabled(status.get("tiers") or [])
    patch = status_patch(status, new)
    if patch:
        op.kube.patch(policy_path(namespace, name, status=True),
                      {"metadata": {"resourceVersion": pol["metadata"]["resourceVersion"]}, "status": patch})
        op.metrics.api_writes.labels("status").inc()
    if acknowledged:
        left = [t for t in reenable if t not in acknowledged and t != "*"]
        op.kube.patch(policy_path(namespace, name),
                      {"metadata": {"annotations": {REENABLE_ANNOTATION: ",".join(left) if left else None}}})
    return result


def _misconfigured(op: Operator, pol: dict[str, Any], message: str, interval: float) -> TickResult:
    """An SLO configuration the guard cannot act on is ``SLOUnknown`` in status, not only a log line.

    Nothing else changes: the stored guard state and tier states stay as they were, so fixing the Secret or the
    spec resumes counting where it stopped.
    """
    status, meta = pol.get("status") or {}, pol["metadata"]
    new = {
        "sloState": "Unknown",
        "conditions": merge_conditions(status.get("conditions") or [],
                                       [Cond("SLOUnknown", "True", "InvalidConfiguration", message)],
                                       meta.get("generation"), now_rfc3339()),
    }
    result = TickResult(interval=interval, body=pol, verdict="error")
    op.metrics.errors.labels("slo-InvalidConfiguration").inc()
    patch = status_patch(status, new)
    if patch:  # a new or changed problem: one status write and one Event, not one per interval
        op.kube.patch(policy_path(meta["namespace"], meta["name"], status=True),
                      {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch})
        op.metrics.api_writes.labels("status").inc()
        result.events.append(Event("Warning", "InvalidSLOConfiguration", message))
        log.warning("SLO guard of %s/%s cannot evaluate: %s", meta["namespace"], meta["name"], message)
    return result


def register_slo(registry: kopf.OperatorRegistry, op: Operator) -> None:
    op.tier_states_fn = guarded_tier_states

    @kopf.daemon(*POLICY, id="slo-guard", when=lambda spec, **_: bool(spec.get("slo")), cancellation_timeout=10,
                 registry=registry)
    async def slo_guard(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                        **_: Any) -> None:
        key = (namespace, name)
        interval, delay = DEFAULT_INTERVAL, op.settings.backoff_initial
        while not stopped:
            try:
                async with op.lock(key):
                    result = await asyncio.to_thread(guard_tick_sync, op, namespace, name)
                delay = op.settings.backoff_initial
            except Exception as err:  # noqa: BLE001 - retried soon (a 409 is routine), never a crash loop
                op.metrics.errors.labels("slo-" + _reason(err)).inc()
                logger.info("SLO evaluation of %s/%s failed (%s); retrying in %.1fs", namespace, name, err, delay)
                await stopped.wait(min(delay, interval))
                delay = min(delay * 2, op.settings.backoff_max)
                continue
            if result is not None:
                interval = result.interval
                if result.verdict:
                    op.metrics.slo_evaluations.labels(result.verdict).inc()
                for tier in result.rollbacks:
                    op.metrics.rollbacks.labels(namespace, name, tier).inc()
                for ev in result.events:
                    kopf.event(result.body, type=ev.type, reason=ev.reason, message=ev.message[:1000])
                if result.tiers_changed:
                    op.trigger(key)
            await stopped.wait(interval)
