"""The SLO guard (``kvtier_operator.slo``) wired into the operator.

One kopf daemon per policy with ``spec.slo`` evaluates every ``spec.slo.interval`` (kopf timers have one interval
per handler, a daemon can read it from each object's spec). Each evaluation reads the stored guard state from
``status.slo``, runs ``slo.tick`` against Prometheus in the policy's own thread (``lanes``: a slow Prometheus
delays only its own policy, never the reconciles or other policies), and writes the fields the guard owns in one
conflict-checked status write (``status_writer``): its state, ``sloState``, its conditions and ``history``. Tier
states are not the guard's to write: when the evaluation changes what ``tiers.tier_states`` derives from its
state, it wakes the policy's reconcile, which writes them and renders only Enabled tiers. Rollbacks are Warning
Events and count in ``kvtier_operator_tier_rollbacks_total``.

This module depends on the operator only through :class:`GuardHost`; ``main`` registers it next to the
reconcile's handlers. Importing it fails when the ``slo`` package is absent; ``main`` then runs without the guard.
"""
from __future__ import annotations

import base64
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import kopf

from . import parsed, slo
from .api import v1alpha1 as api
from .api.units import parse_duration
from .api.validation import PolicyInvalid
from .kube import Kube, error_reason, policy_path
from .lanes import Lanes
from .metrics import Metrics
from .reconcile import Event
from .settings import REENABLE_ANNOTATION, Settings
from .slo.client import PrometheusClientConfig, PrometheusSource, Unavailable, resolve_client_config
from .status import GUARD_CONDITION_TYPES, Cond, merge_conditions, now_rfc3339
from .status_writer import write_status
from .tiers import tier_states
from .trust import endpoint_problem

log = logging.getLogger("kvtier.slo")
POLICY = (api.GROUP, api.VERSION, api.PLURAL)
# The API's default spec.slo.interval, used until the spec can be read.
DEFAULT_INTERVAL = parse_duration(api.SLOSpec.model_fields["interval"].default)
QUERY_OVERRIDES_REFUSED = ("spec.slo.queries: query overrides are not allowed by the operator's admin (operator "
                           "setting allowQueryOverrides); remove spec.slo.queries to use the built-in queries, "
                           "which are scoped to this policy's targets")
SLO_STATE = {"ok": "OK", "breach": "Breaching", "error": "Unknown", "noData": "NoData", "lowTraffic": "NoData"}


class GuardHost(Protocol):
    """What the guard needs from the operator process (``handlers.Operator`` provides it)."""

    settings: Settings
    kube: Kube
    metrics: Metrics
    # Test seam: a scripted measurement source per (namespace, name) instead of Prometheus.
    slo_source: Optional[Callable[[str, str], Any]]

    def trigger(self, key: tuple[str, str]) -> None: ...


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


def scope_for(namespace: str, status: dict[str, Any], model_name: Optional[str]) -> "slo.Scope":
    """The target pods: ``spec.slo.modelName`` when set, else the pods of the targets carrying the configuration.

    With neither (no target applied yet, or every one in conflict), nothing matches: the guard must never judge
    a policy by the other pods of its namespace (no data, so no verdict).
    """
    if model_name:
        return slo.Scope(namespace=namespace, model_name=model_name)
    patterns = sorted({re.escape(t["name"]) + _POD_SUFFIX.get(t.get("kind", ""), "-.+")
                       for t in status.get("targets") or [] if t.get("state") in ("Applied", "MissingConfigArgument")})
    return slo.Scope(namespace=namespace, pod_regex="|".join(patterns) if patterns else MATCH_NOTHING)


# ---------------------------------------------------------------------------------------------- one tick

def guard_status(status: dict[str, Any], decision: "slo.Decision", generation: Optional[int],
                 now: str) -> dict[str, Any]:
    """The status fields one evaluation owns (``status.GUARD_FIELDS``); pure, so tests check it directly.

    Conditions of other types (Ready, Conflict, ...) are kept; ``lastTransitionTime`` moves only on a flip.
    """
    state = decision.state
    conds = [Cond(a.type, a.status, a.reason, a.message) for a in decision.actions if isinstance(a, slo.SetCondition)]
    return {
        "slo": state,
        "sloState": SLO_STATE.get(state.get("verdict") or "", "Unknown"),
        "conditions": merge_conditions(status.get("conditions") or [], conds, generation, now),
        # The guard keeps its history in the API's HistoryEntry shape (trimmed to api.HISTORY_LIMIT by evaluate);
        # status.history mirrors it.
        "history": list(state.get("history") or []),
    }


@dataclass
class TickResult:
    interval: float
    tiers_changed: bool = False
    events: list[Event] = field(default_factory=list)
    body: Optional[dict[str, Any]] = None
    rollbacks: list[str] = field(default_factory=list)
    verdict: Optional[str] = None


def _same_guard_basis(pol: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """A fresh object the guard's patch still applies to: same spec generation and same stored guard state (a
    reconcile wrote its own fields in between)."""
    generation, state = pol["metadata"].get("generation"), (pol.get("status") or {}).get("slo")
    return lambda fresh: (fresh["metadata"].get("generation") == generation
                          and (fresh.get("status") or {}).get("slo") == state)


def guard_tick_sync(host: GuardHost, namespace: str, name: str,
                    source: Optional[Any] = None) -> Optional[TickResult]:
    pol = host.kube.get(policy_path(namespace, name))
    if pol is None or pol["metadata"].get("deletionTimestamp"):
        return None
    status = pol.get("status") or {}
    if not (pol.get("spec") or {}).get("slo"):
        return None
    try:
        spec = parsed.parse(parsed.key(pol)).spec
        settings = slo.SLOSettings.from_policy_spec(spec)
    except PolicyInvalid as err:
        return _misconfigured(host, pol, "; ".join(str(p) for p in err.problems), DEFAULT_INTERVAL)
    result = TickResult(interval=settings.interval_s, body=pol)
    reenable = [t.strip() for t in (pol["metadata"].get("annotations") or {}).get(REENABLE_ANNOTATION, "").split(",")
                if t.strip()]
    if settings.queries and not host.settings.allow_query_overrides:
        # An override is arbitrary PromQL sent with the namespace's Prometheus credentials, not scoped to the
        # policy's targets, and its numbers come back in status: the admin must allow it (issue 24, class F).
        return _misconfigured(host, pol, QUERY_OVERRIDES_REFUSED, settings.interval_s)
    if source is None and host.slo_source is not None:
        source = host.slo_source(namespace, name)
    own_source = source is None
    if own_source:
        if settings.prometheus is None:
            return result
        # Before any Secret is read: credentials go only to endpoints the admin allowed (docs/install.md).
        refused = endpoint_problem(settings.prometheus.url, host.settings.prometheus_allowed,
                                  host.settings.prometheus_allow_http)
        if refused:
            return _misconfigured(host, pol, refused, settings.interval_s)
        try:
            config = client_config(host.kube, namespace, settings.prometheus)
        except ValueError:
            # A missing, forbidden or malformed Secret reads exactly like an unreachable endpoint: same reason,
            # same words (class F: whether a Secret exists is not told).
            source = Unavailable(settings.prometheus.url)
        else:
            source = PrometheusSource(config)
    try:
        decision = slo.tick(settings, status.get("slo"), source, scope_for(namespace, status, settings.model_name),
                            time.time(), engine=status.get("engine"), reenable_requests=reenable,
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
    new = guard_status(status, decision, generation, now)
    # The reconcile owns status.tiers; it must run when the tiers it derives from this state differ.
    result.tiers_changed = tier_states(spec, {**status, "slo": new["slo"]}, now) != (status.get("tiers") or [])
    write_status(host.kube, host.metrics, pol, new, _same_guard_basis(pol), conditions=GUARD_CONDITION_TYPES)
    if acknowledged:
        left = [t for t in reenable if t not in acknowledged and t != "*"]
        host.kube.patch(policy_path(namespace, name),
                        {"metadata": {"annotations": {REENABLE_ANNOTATION: ",".join(left) if left else None}}})
    return result


def _misconfigured(host: GuardHost, pol: dict[str, Any], message: str, interval: float) -> TickResult:
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
    host.metrics.errors.labels("slo-InvalidConfiguration").inc()
    # A new or changed problem: one status write and one Event, not one per interval.
    if write_status(host.kube, host.metrics, pol, new, _same_guard_basis(pol), conditions=GUARD_CONDITION_TYPES):
        result.events.append(Event("Warning", "InvalidSLOConfiguration", message))
        log.warning("SLO guard of %s/%s cannot evaluate: %s", meta["namespace"], meta["name"], message)
    return result


def register_slo(registry: kopf.OperatorRegistry, host: GuardHost) -> None:
    lanes = Lanes("kvtier-slo")

    @kopf.daemon(*POLICY, id="slo-guard", when=lambda spec, **_: bool(spec.get("slo")), cancellation_timeout=10,
                 registry=registry)
    async def slo_guard(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                        **_: Any) -> None:
        key = (namespace, name)
        interval, delay = DEFAULT_INTERVAL, host.settings.backoff_initial
        try:
            while not stopped:
                try:
                    result = await lanes.run(key, guard_tick_sync, host, namespace, name)
                    delay = host.settings.backoff_initial
                except Exception as err:  # noqa: BLE001 - retried soon (a 409 is routine), never a crash loop
                    host.metrics.errors.labels("slo-" + error_reason(err)).inc()
                    logger.info("SLO evaluation of %s/%s failed (%s); retrying in %.1fs", namespace, name, err,
                                delay)
                    await stopped.wait(min(delay, interval))
                    delay = min(delay * 2, host.settings.backoff_max)
                    continue
                if result is not None:
                    interval = result.interval
                    if result.verdict:
                        host.metrics.slo_evaluations.labels(result.verdict).inc()
                    for tier in result.rollbacks:
                        host.metrics.rollbacks.labels(namespace, name, tier).inc()
                    for ev in result.events:
                        kopf.event(result.body, type=ev.type, reason=ev.reason, message=ev.message[:1000])
                    if result.tiers_changed:
                        host.trigger(key)
                await stopped.wait(interval)
        finally:
            lanes.close(key)
