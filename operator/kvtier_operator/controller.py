"""One policy's pass, and the state of one operator process that passes share.

A pass (``Operator.run_pass``, blocking, run in a thread by the policy's daemon in ``handlers``):

1. read the policy and its workloads, parse the SLO guard's state (``status.slo``) once, ``reconcile.plan`` (pure)
   what to write from that state;
2. when the SLO guard is due (``spec.slo``), evaluate it once (``slo_tick.evaluate``) from that state against the
   targets of this plan; when its new state (typed, as the guard returned it) changes the tiers
   ``tiers.tier_states`` derives, plan again with that state (pure), so the rendered configuration and the control
   file follow the verdict in the same pass;
3. write the ConfigMap and the workloads the plan names;
4. write the status once: ``status.compose`` of the plan's fields and the guard's (its state dumped once here),
   serialised once, compared with the stored one and sent only when it differs (``status_writer``).

Nothing here talks to kopf: ``handlers`` posts the Events a pass returns and owns the daemon, the retries and the
wake-ups.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from . import parsed
from . import reconcile as rc
from .api import guard_state
from .api.guard_state import SLOGuardState
from .api.times import format_time
from .api.units import parse_quantity
from .api.validation import PolicyInvalid
from .kube import NODES, STRATEGIC, ApiError, Kube, config_map_path, policy_path, secret_path, workload_path
from .metrics import Metrics
from .reports import Cond, Event
from .selectors import to_query
from .settings import POLICY_LABEL, REENABLE_ANNOTATION, Settings
from .slo import hit_ratios as hr
from .slo_tick import DEFAULT_INTERVAL, GuardStep, evaluate, misconfigured
from .status import compose, condition, merge_conditions, now_rfc3339
from .status_writer import write_status
from .tiers import stored_guard, tier_states
from .trust import foreign_holder_message, owns_config_map, remote_secret_names
from .workload import KINDS, Workload, removal_patch

log = logging.getLogger("kvtier.operator")
Key = tuple[str, str]
CONFIG_MAP_TTL = 30.0
FOREIGN_OBJECT = "ForeignObject"  # Ready/Degraded reason: an object kvtier names is held by someone else


@dataclass
class Outcome:
    """What one pass did (returned to the async side, which posts the events and counts)."""

    body: Optional[dict[str, Any]]
    events: list[Event] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # workload ref -> config hash now on it
    guard: Optional[GuardStep] = None  # the SLO guard's step, when it evaluated in this pass


def guard_fields(step: GuardStep, conditions: list[dict[str, Any]], generation: Optional[int],
                 now: str, tiers: Optional[list[dict[str, Any]]] = None,
                 stored_device: Optional[float] = None) -> dict[str, Any]:
    """The status fields a guard step sets, its conditions merged into the pass's (pure).

    With hit ratios measured and the pass's ``tiers`` (status.tiers): each tier's ``hitRatio``, the ``hitRatios``
    summary, ``deviceHitRatio`` (``stored_device``, the stored one, kept when its query did not answer) and,
    when every query answered, the ``TierIdle`` condition. Figures are informational: they change no verdict.
    """
    new = list(step.conditions)
    out: dict[str, Any] = {"sloState": step.slo_state}
    measured = step.hit_ratios
    if measured is not None and tiers is not None:
        out["tiers"] = hr.with_figures(tiers, measured)
        device = measured.window.get(hr.DEVICE_TIER, stored_device)
        out["deviceHitRatio"] = device
        out["hitRatios"] = hr.summary(out["tiers"], device)
        if measured.error is None:
            new.append(Cond("TierIdle", *hr.idle_condition(out["tiers"], measured, now)))
    out["conditions"] = merge_conditions(conditions, new, generation, now)
    if step.state is not None:
        out["slo"] = guard_state.dump(step.state)  # the pass's one dump of the guard's state
    return out


def tier_idle_event(before: dict[str, Any], after: dict[str, Any]) -> Optional[Event]:
    """One Event when ``TierIdle`` turns True (not on every evaluation it stays True)."""
    was, now = condition(before, "TierIdle") or {}, condition(after, "TierIdle") or {}
    if now.get("status") == "True" and was.get("status") != "True":
        return Event("Normal", "TierIdle", str(now.get("message") or ""))
    return None


def _versions(secrets: dict[str, Optional[dict[str, Any]]]) -> dict[str, Optional[str]]:
    """Each Secret's resourceVersion (None: missing or unreadable): what changes when its data or its mark does."""
    return {name: (obj or {}).get("metadata", {}).get("resourceVersion") if obj is not None else None
            for name, obj in secrets.items()}


class Operator:
    """What the passes of one operator process share: settings, the API client, metrics, caches."""

    def __init__(self, settings: Settings, kube: Kube, metrics: Optional[Metrics] = None):
        self.settings = settings
        self.kube = kube
        self.metrics = metrics or Metrics()
        self.applied_config_maps: dict[tuple[str, str], tuple[float, str]] = {}
        # (namespace, policy) -> {Secret name: resourceVersion or None}, as the last pass read them.
        self.secret_versions: dict[tuple[str, str], dict[str, Optional[str]]] = {}
        self._nodes: tuple[float, Optional[int]] = (0.0, None)
        self._nodes_readable = settings.read_nodes
        self.written: Any = None  # set by handlers: called with (key, resourceVersion) after each workload write

    # ----------------------------------------------------------------------------------------- seams

    def measurement_source(self, namespace: str, name: str) -> Optional[Any]:
        """A measurement source for the policy's guard instead of its Prometheus; None: its Prometheus."""
        return None

    def reconciled(self, key: Key, outcome: Outcome) -> None:
        """Called after every pass (on the event loop)."""

    # ----------------------------------------------------------------------------------------- reads

    def node_allocatable(self) -> Optional[int]:
        """Largest node allocatable memory (cached a minute); None when nodes are unknown or unreadable."""
        if not self._nodes_readable:
            return None
        at, value = self._nodes
        if time.monotonic() - at < 60:
            return value
        try:
            nodes = self.kube.list(NODES)
        except ApiError as err:
            if err.status in (401, 403):
                log.warning("cannot list nodes (%s); headroom is checked against container limits only", err.status)
                self._nodes_readable = False
                return None
            raise
        sizes = [parse_quantity(n["status"]["allocatable"]["memory"]) for n in nodes
                 if (n.get("status") or {}).get("allocatable", {}).get("memory")]
        value = max(sizes) if sizes else None
        self._nodes = (time.monotonic(), value)
        return value

    def observe_workloads(self, namespace: str, name: str, selector: Optional[dict[str, Any]],
                          hints: Optional[dict[str, tuple[bool, bool]]] = None) -> list[dict[str, Any]]:
        """Workloads matching the selector or carrying our label, read in full from the API server.

        ``hints`` (kind -> (some match the selector, some carry our label only)), from the workload indexes,
        skip the lists that cannot return anything; without hints every list is made.
        """
        out: list[dict[str, Any]] = []
        query = to_query(selector) if selector else ""
        for kind in KINDS:
            by_selector, by_label = (hints or {}).get(kind, (True, True))
            if query and by_selector:
                out += self.kube.list(workload_path(kind, namespace), query)
            if by_label:
                out += self.kube.list(workload_path(kind, namespace), f"{POLICY_LABEL}={name}")
        return out

    # ----------------------------------------------------------------------------------------- writes

    def _write_workload(self, namespace: str, t: rc.TargetPlan, failures: dict[str, str],
                        outcome: Outcome) -> None:
        path = workload_path(t.kind, namespace, t.name)
        try:
            if t.args_update is not None:
                result = self.kube.patch(path, t.args_update, STRATEGIC)
                self.metrics.api_writes.labels("workload-args").inc()
            if t.apply is not None:
                result = self.kube.apply(path, t.apply)
                self.metrics.api_writes.labels("workload").inc()
                self._wrote(namespace, t.kind, t.name, result)
                outcome.applied[t.ref] = t.config_hash or ""
            if t.remove:
                result = self.kube.apply(path, removal_patch(Workload({"kind": t.kind, "metadata": {
                    "name": t.name, "namespace": namespace}})))
                self.metrics.api_writes.labels("workload-release").inc()
                self._wrote(namespace, t.kind, t.name, result)
        except ApiError as err:
            if err.field_conflict:
                failures[t.ref] = (f"{t.ref}: another field manager owns a field kvtier applies, and kvtier never "
                                   f"forces: {err.message}")
            elif err.status == 404:
                log.info("%s is gone; nothing to do", t.ref)
            elif err.status in (400, 422):
                failures[t.ref] = f"{t.ref}: the API server rejected the change: {err.message}"
            else:
                raise

    def _wrote(self, namespace: str, kind: str, name: str, result: dict[str, Any]) -> None:
        if self.written is not None:
            self.written((namespace, kind, name), result["metadata"]["resourceVersion"])

    def _apply_config_map(self, policy: dict[str, Any], plan: rc.Plan, now: str) -> rc.Plan:
        """The ConfigMap first, so pods rolled by the new hash read the new files; a foreign holder refuses."""
        if plan.config_map is None:
            return plan
        meta = policy["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        cm_key = (namespace, plan.config_map["metadata"]["name"])
        body = json.dumps(plan.config_map, sort_keys=True)
        at, last = self.applied_config_maps.get(cm_key, (0.0, ""))
        # The same ConfigMap applied moments ago is not re-sent (bursts of events); after the TTL it is, so a
        # deleted or edited ConfigMap heals on the next pass.
        if last == body and time.monotonic() - at <= CONFIG_MAP_TTL:
            return plan
        # Whose is it? A server-side apply would merge our labels, owner reference and keys into a ConfigMap of
        # the same name made by someone else, and deleting the policy would then delete it (adopting a foreign object). A foreign
        # holder is reported and left alone, and no workload is pointed at it.
        path = config_map_path(namespace, cm_key[1])
        existing = self.kube.get(path)
        if existing is not None and not owns_config_map(existing, name, meta.get("uid")):
            self.applied_config_maps.pop(cm_key, None)
            return rc.refusal(policy, FOREIGN_OBJECT, foreign_holder_message("ConfigMap", cm_key[1]), now,
                              "that ConfigMap is gone or the policy is renamed")
        to_apply = plan.config_map
        if existing is not None:
            # A precondition: replaced by someone else since it was read, the apply is refused (409) and the
            # next attempt reads the new holder, instead of merging into it.
            to_apply = {**plan.config_map, "metadata": {
                **plan.config_map["metadata"], "resourceVersion": existing["metadata"]["resourceVersion"]}}
        self.kube.apply(path, to_apply)
        self.metrics.api_writes.labels("configmap").inc()
        self.applied_config_maps[cm_key] = (time.monotonic(), body)
        return plan

    # ----------------------------------------------------------------------------------------- the pass

    def _plan(self, policy: dict[str, Any], workloads: list[dict[str, Any]], others: list[dict[str, Any]],
              now: str, guard: Optional[SLOGuardState]) -> rc.Plan:
        return rc.plan(policy, workloads, others, now=now, guard=guard, node_allocatable=self.node_allocatable(),
                       cleanup_image=self.settings.cleanup_image, server_validated=True,
                       host_path_prefixes=self.settings.host_path_prefixes, pvc_allowed=self.settings.pvc_allowed,
                       remote_stores_allowed=self.settings.remote_stores_allowed,
                       secrets=self._remote_secrets(policy),
                       secret_namespaces=self.settings.remote_secret_namespaces)

    def _remote_secrets(self, policy: dict[str, Any]) -> dict[str, Optional[dict[str, Any]]]:
        """The Secrets the policy's remote tiers name, each read by name (a get, never a list); None where missing
        or not readable. Nothing is read outside the namespaces the admin lists (operator.remoteSecretNamespaces):
        the plan refuses those tiers on that list alone, whatever Role would let the read through. What was read is
        remembered (``secret_versions``) for the recheck between passes (``secrets_changed``)."""
        meta = policy["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            spec = parsed.parse(parsed.key(policy), True).spec
        except PolicyInvalid:
            self.secret_versions.pop(key, None)
            return {}
        out = self._read_secrets(meta["namespace"], remote_secret_names(spec))
        self.secret_versions[key] = _versions(out)
        return out

    def _read_secrets(self, namespace: str, names: list[str]) -> dict[str, Optional[dict[str, Any]]]:
        if not names or namespace not in self.settings.remote_secret_namespaces:
            return {}
        out: dict[str, Optional[dict[str, Any]]] = {}
        for name in names:
            try:
                out[name] = self.kube.get(secret_path(namespace, name))
            except ApiError as err:
                if err.status != 403:
                    raise
                out[name] = None
        return out

    def secrets_changed(self, namespace: str, name: str) -> bool:
        """Whether a Secret the policy's last pass read has changed since (a new resourceVersion, deleted, or no
        longer readable): a get by name for each, the cheap recheck that lets consent taken back or a Secret deleted
        take effect within ``settings.secret_recheck_seconds`` without a list or a watch on Secrets."""
        seen = self.secret_versions.get((namespace, name))
        if not seen:
            return False
        return _versions(self._read_secrets(namespace, list(seen))) != seen

    def _guard(self, policy: dict[str, Any], plan: rc.Plan, state: Optional[SLOGuardState],
               at: float) -> Optional[GuardStep]:
        meta = policy["metadata"]
        try:
            spec = parsed.parse(parsed.key(policy)).spec
        except PolicyInvalid as err:
            return misconfigured("; ".join(str(p) for p in err.problems), DEFAULT_INTERVAL)
        targets = plan.status.get("targets")
        if targets is None:  # a refusal computed none: measure what the stored status names
            targets = (policy.get("status") or {}).get("targets") or []
        source = self.measurement_source(meta["namespace"], meta["name"])
        return evaluate(self.kube, self.settings, policy, spec, targets, source, state=state, now=at)

    @staticmethod
    def _stored_guard(policy: dict[str, Any], at: float) -> Optional[SLOGuardState]:
        """``status.slo`` parsed, once per pass, at the time the guard evaluates (None: the policy is invalid, has
        no ``spec.slo`` or no stored state)."""
        try:
            spec = parsed.parse(parsed.key(policy), True).spec
        except PolicyInvalid:
            return None
        return stored_guard(spec, policy.get("status") or {}, format_time(at))

    def run_pass(self, namespace: str, name: str, others: list[dict[str, Any]],
                 hints: Optional[dict[str, tuple[bool, bool]]] = None, guard_due: bool = False) -> Outcome:
        policy = self.kube.get(policy_path(namespace, name))
        if policy is None or policy["metadata"].get("deletionTimestamp"):
            return Outcome(None)
        policy.setdefault("apiVersion", "kvtier.io/v1alpha1")
        policy.setdefault("kind", "KVCachePolicy")
        selector = (policy.get("spec") or {}).get("selector")
        workloads = self.observe_workloads(namespace, name, selector, hints)
        others_objs = [{"metadata": {"name": o["name"]}, "spec": {"selector": o.get("selector")}} for o in others]
        now, at = now_rfc3339(), time.time()
        guard = self._stored_guard(policy, at)
        plan = self._plan(policy, workloads, others_objs, now, guard)
        outcome = Outcome(policy)
        step = self._guard(policy, plan, guard, at) if guard_due and (policy.get("spec") or {}).get("slo") else None
        if step is not None and step.state is not None and not plan.invalid:
            guard = step.state
            spec = parsed.parse(parsed.key(policy)).spec
            if tier_states(spec, policy.get("status") or {}, now, guard) != plan.status.get("tiers"):
                plan = self._plan(policy, workloads, others_objs, now, guard)  # the verdict, rendered now
        plan = self._apply_config_map(policy, plan, now)
        failures: dict[str, str] = {}
        for t in plan.targets:
            self._write_workload(namespace, t, failures, outcome)
        plan = rc.with_failures(plan, policy, failures, now)
        if plan.release_config_map and not failures:
            self._delete_config_map(namespace, name, policy["metadata"].get("uid"))
        fields = dict(plan.status)
        if step is not None:
            fields.update(guard_fields(step, fields["conditions"], policy["metadata"].get("generation"), now,
                                       fields.get("tiers"), (policy.get("status") or {}).get("deviceHitRatio")))
        status = compose(policy.get("status") or {}, fields)
        write_status(self.kube, self.metrics, policy, status)
        outcome.events = list(plan.events)
        if step is not None:
            outcome.guard = step
            if step.problem is not None:
                self.metrics.errors.labels("slo-InvalidConfiguration").inc()
                before = condition(policy.get("status") or {}, "SLOUnknown") or {}
                if (before.get("status"), before.get("reason"), before.get("message")) == (
                        "True", "InvalidConfiguration", step.problem):
                    # The same problem as last time: one Event per new or changed problem, not one per interval.
                    step.events = [e for e in step.events if e.reason != "InvalidSLOConfiguration"]
                else:
                    log.warning("SLO guard of %s/%s cannot evaluate: %s", namespace, name, step.problem)
            outcome.events += step.events
            idle = tier_idle_event(policy.get("status") or {}, status)
            if idle is not None:
                outcome.events.append(idle)
            if step.reenable_left is not None:
                left = step.reenable_left
                self.kube.patch(policy_path(namespace, name),
                                {"metadata": {"annotations": {REENABLE_ANNOTATION: ",".join(left) if left else None}}})
        applied = sum(1 for t in plan.targets if t.state in (rc.APPLIED, rc.MISSING_ARG) and t.ref not in failures)
        self.metrics.applied_targets.labels(namespace, name).set(applied)
        return outcome

    def _delete_config_map(self, namespace: str, name: str, uid: Optional[str]) -> None:
        """Delete the ConfigMap kvtier made for this policy; a user's own kvtier-<name> is left alone."""
        cm_path = config_map_path(namespace, rc.config_map_name(name))
        try:
            existing = self.kube.get(cm_path)
        except ApiError as err:
            if err.status != 403:
                raise
            existing = None  # cannot tell whose it is: leave it to the garbage collector's owner reference
        if owns_config_map(existing, name, uid):
            self.kube.delete(cm_path)
        self.applied_config_maps.pop((namespace, rc.config_map_name(name)), None)

    def release(self, namespace: str, name: str, body: dict[str, Any]) -> int:
        """Undo everything applied for a deleted policy; returns how many workloads were released. Raises
        ``ReleaseRefused`` when a workload could not be released (the finalizer must wait)."""
        self.secret_versions.pop((namespace, name), None)
        workloads = []
        for kind in KINDS:
            workloads += self.kube.list(workload_path(kind, namespace), f"{POLICY_LABEL}={name}")
        released = 0
        outcome = Outcome(body)
        for t in rc.release_plan(body, workloads):
            failures: dict[str, str] = {}
            self._write_workload(namespace, t, failures, outcome)
            if failures:
                raise ReleaseRefused("; ".join(failures.values()))
            released += 1
        # The owner reference lets the garbage collector do this too; deleting it here does not depend on one.
        self._delete_config_map(namespace, name, (body.get("metadata") or {}).get("uid"))
        try:
            self.metrics.applied_targets.remove(namespace, name)
        except KeyError:
            pass
        return released


class ReleaseRefused(Exception):
    """A workload of a deleted policy could not be released (e.g. another manager owns a field)."""
