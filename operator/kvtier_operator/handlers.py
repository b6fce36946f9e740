"""kopf wiring: observe policies and workloads, reconcile each policy from its own daemon.

Foreign Deployments and StatefulSets get only an index-free ``on.event`` handler, which writes nothing to them
(kopf's changing handlers would annotate them: drift for GitOps). Policies get an index (kopf fills every index
before any daemon starts, so conflicts are known from the first reconcile), an event handler that wakes the
policy's daemon, the daemon that reconciles, and a deletion handler behind the ``kvtier.io/finalizer`` finalizer.
The SLO guard's daemon is registered by ``main`` from ``slo_timer`` (which does not import this module).

The handlers are adapters: ``event_filter`` decides whether an event means work, ``wakeups`` wakes the policy's
daemon, ``reconcile.plan`` decides everything, and this module only reads the cluster and performs the plan
(status through ``status_writer``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import kopf

from . import reconcile as rc
from .api import v1alpha1 as api
from .api.units import parse_quantity
from .event_filter import EventFilter
from .kube import (
    NODES,
    STRATEGIC,
    ApiError,
    Kube,
    config_map_path,
    error_reason,
    is_transient,
    policy_path,
    workload_path,
)
from .metrics import Metrics
from .selectors import matches, to_query
from .settings import FINALIZER, OPT_IN_ANY, OPT_IN_LABEL, POLICY_LABEL, PREFIX, Settings
from .status import CONDITION_TYPES, now_rfc3339
from .status_writer import write_status
from .trust import foreign_holder_message, owns_config_map
from .wakeups import Wakeups, backoff
from .workload import KINDS, Workload, removal_patch

log = logging.getLogger("kvtier.operator")
POLICY = (api.GROUP, api.VERSION, api.PLURAL)
Key = tuple[str, str]
CONFIG_MAP_TTL = 30.0
KOPF_PROGRESS_FIELD = "status.kopf.progress"
KOPF_TOUCH_FIELD = "status.kopf.dummy"
KOPF_DIFFBASE_FIELD = "status.kopf.lastHandledConfiguration"
FOREIGN_OBJECT = "ForeignObject"  # Ready/Degraded reason: an object kvtier names is held by someone else
STATUS_ONLY_DELAY = 0.5  # coalesces the controller's status updates after a rollout


@dataclass
class Outcome:
    """What one reconcile did (returned to the async side, which posts the events)."""

    body: Optional[dict[str, Any]]
    events: list[rc.Event] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # workload ref -> config hash now on it


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    # Our own prefix everywhere kopf persists something, never kopf.zalando.org.
    s.persistence.finalizer = FINALIZER
    # kopf's progress (which handlers ran; the release handler's "done") and its diff base live in status.kopf,
    # written through the status subresource: a policy author may edit the policy (annotations included) but not
    # its status (the chart's aggregated edit role grants kvcachepolicies only), so forged progress cannot skip
    # the release (class E). Annotations with these keys left by older versions are ignored.
    s.persistence.progress_storage = kopf.StatusProgressStorage(name="kopf", field=KOPF_PROGRESS_FIELD,
                                                                touch_field=KOPF_TOUCH_FIELD)
    s.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(name="kopf", field=KOPF_DIFFBASE_FIELD)
    s.posting.level = logging.WARNING  # kopf's own log lines are not user-facing Events; ours are posted explicitly
    s.posting.reporting_component = "kvtier-operator"
    s.posting.event_name_prefix = "kvtier-"
    s.watching.server_timeout = 300
    s.watching.connect_timeout = 10
    return s


class Operator:
    """State shared by the handlers of one operator process."""

    def __init__(self, settings: Settings, kube: Kube, metrics: Optional[Metrics] = None):
        self.settings = settings
        self.kube = kube
        self.metrics = metrics or Metrics()
        self.wakeups = Wakeups()
        self.locks: dict[Key, asyncio.Lock] = {}
        self.events = EventFilter()
        self.applied_config_maps: dict[tuple[str, str], tuple[float, str]] = {}
        self._nodes: tuple[float, Optional[int]] = (0.0, None)
        self._nodes_readable = settings.read_nodes
        # Observers for tests and the benchmark: called after every reconcile with (key, outcome).
        self.on_reconciled: list[Callable[[Key, Outcome], None]] = []
        self.slo_source: Optional[Callable[[str, str], Any]] = None  # test seam: measurements instead of Prometheus

    # ----------------------------------------------------------------------------------------- triggers

    def trigger(self, key: Key) -> None:
        self.wakeups.trigger(key)

    def trigger_later(self, key: Key, delay: float) -> None:
        """One deferred wake-up per policy: a burst of status updates costs one reconcile."""
        self.wakeups.trigger_later(key, delay)

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    # ----------------------------------------------------------------------------------------- sync I/O

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
                          hints: Optional[dict[str, tuple[bool, bool]]] = None) -> list[dict]:
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
                self.events.wrote((namespace, t.kind, t.name), result["metadata"]["resourceVersion"])
                outcome.applied[t.ref] = t.config_hash or ""
            if t.remove:
                result = self.kube.apply(path, removal_patch(Workload({"kind": t.kind, "metadata": {
                    "name": t.name, "namespace": namespace}})))
                self.metrics.api_writes.labels("workload-release").inc()
                self.events.wrote((namespace, t.kind, t.name), result["metadata"]["resourceVersion"])
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

    def reconcile_sync(self, namespace: str, name: str, others: list[dict[str, Any]],
                       hints: Optional[dict[str, tuple[bool, bool]]] = None) -> Outcome:
        policy = self.kube.get(policy_path(namespace, name))
        if policy is None or policy["metadata"].get("deletionTimestamp"):
            return Outcome(None)
        policy.setdefault("apiVersion", "kvtier.io/v1alpha1")
        policy.setdefault("kind", "KVCachePolicy")
        selector = (policy.get("spec") or {}).get("selector")
        workloads = self.observe_workloads(namespace, name, selector, hints)
        others_objs = [{"metadata": {"name": o["name"]}, "spec": {"selector": o.get("selector")}} for o in others]
        now = now_rfc3339()
        plan = rc.plan(policy, workloads, others_objs, now=now, node_allocatable=self.node_allocatable(),
                       cleanup_image=self.settings.cleanup_image, server_validated=True,
                       host_path_prefixes=self.settings.host_path_prefixes,
                       pvc_allowed=self.settings.pvc_allowed)
        outcome = Outcome(policy)
        # The ConfigMap first, so pods rolled by the new hash read the new files.
        if plan.config_map is not None:
            cm_key = (namespace, plan.config_map["metadata"]["name"])
            body = json.dumps(plan.config_map, sort_keys=True)
            at, last = self.applied_config_maps.get(cm_key, (0.0, ""))
            # The same ConfigMap applied moments ago is not re-sent (bursts of events); after the TTL it is,
            # so a deleted or edited ConfigMap heals on the next reconcile.
            if last != body or time.monotonic() - at > CONFIG_MAP_TTL:
                # Whose is it? A server-side apply would merge our labels, owner reference and keys into a
                # ConfigMap of the same name made by someone else, and deleting the policy would then delete it
                # (class B). A foreign holder is reported and left alone, and no workload is pointed at it.
                path = config_map_path(namespace, cm_key[1])
                existing = self.kube.get(path)
                if existing is not None and not owns_config_map(existing, name, policy["metadata"].get("uid")):
                    self.applied_config_maps.pop(cm_key, None)
                    plan = rc.refusal(policy, FOREIGN_OBJECT, foreign_holder_message("ConfigMap", cm_key[1]), now,
                                      "that ConfigMap is gone or the policy is renamed")
                else:
                    body_to_apply = plan.config_map
                    if existing is not None:
                        # A precondition: replaced by someone else since it was read, the apply is refused (409)
                        # and the next attempt reads the new holder, instead of merging into it.
                        body_to_apply = {**plan.config_map, "metadata": {
                            **plan.config_map["metadata"],
                            "resourceVersion": existing["metadata"]["resourceVersion"]}}
                    self.kube.apply(path, body_to_apply)
                    self.metrics.api_writes.labels("configmap").inc()
                    self.applied_config_maps[cm_key] = (time.monotonic(), body)
        failures: dict[str, str] = {}
        for t in plan.targets:
            self._write_workload(namespace, t, failures, outcome)
        plan = rc.with_failures(plan, policy, failures, now)
        self._write_status(namespace, name, policy, plan.status)
        outcome.events = plan.events
        applied = sum(1 for t in plan.targets if t.state in (rc.APPLIED, rc.MISSING_ARG) and t.ref not in failures)
        self.metrics.applied_targets.labels(namespace, name).set(applied)
        return outcome

    def _write_status(self, namespace: str, name: str, policy: dict[str, Any], status: dict[str, Any]) -> None:
        """The reconcile's fields, conflict-checked. A 409 from a change that left the spec and the guard's state
        alone (kopf adding its finalizer, a label, the guard's verdict) does not invalidate the plan; anything
        else raises it and the caller plans again."""
        generation, guard = policy["metadata"].get("generation"), (policy.get("status") or {}).get("slo")
        write_status(self.kube, self.metrics, policy, status,
                     lambda fresh: (fresh["metadata"].get("generation") == generation
                                    and (fresh.get("status") or {}).get("slo") == guard),
                     conditions=CONDITION_TYPES)

    def release_sync(self, namespace: str, name: str, body: dict[str, Any]) -> int:
        """Undo everything applied for a deleted policy; returns how many workloads were released."""
        workloads = []
        for kind in KINDS:
            workloads += self.kube.list(workload_path(kind, namespace), f"{POLICY_LABEL}={name}")
        released = 0
        outcome = Outcome(body)
        for t in rc.release_plan(body, workloads):
            failures: dict[str, str] = {}
            self._write_workload(namespace, t, failures, outcome)
            if failures:
                raise kopf.TemporaryError("; ".join(failures.values()), delay=self.settings.backoff_max)
            released += 1
        # The owner reference lets the garbage collector do this too; deleting it here does not depend on one.
        # Only a ConfigMap kvtier made for this policy: a user's own kvtier-<name> is left alone.
        cm_path = config_map_path(namespace, rc.config_map_name(name))
        try:
            existing = self.kube.get(cm_path)
        except ApiError as err:
            if err.status != 403:
                raise
            existing = None  # cannot tell whose it is: leave it to the garbage collector's owner reference
        if owns_config_map(existing, name, (body.get("metadata") or {}).get("uid")):
            self.kube.delete(cm_path)
        self.applied_config_maps.pop((namespace, rc.config_map_name(name)), None)
        try:
            self.metrics.applied_targets.remove(namespace, name)
        except KeyError:
            pass
        return released

    # ----------------------------------------------------------------------------------------- async side

    async def release_orphans(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        """Release what a deleted policy left applied (its finalizer removed by someone else); never raises."""
        async with self.lock((namespace, name)):
            try:
                count = await asyncio.to_thread(self.release_sync, namespace, name, body)
            except Exception as err:  # noqa: BLE001 - logged and counted; the next resync of others is unaffected
                self.metrics.errors.labels(error_reason(err)).inc()
                log.warning("releasing workloads of deleted policy %s/%s failed: %s", namespace, name, err)
                return
        if count:
            log.warning("policy %s/%s was deleted without its release (finalizer removed); released %d "
                        "workload(s)", namespace, name, count)

    async def run_reconcile(self, namespace: str, name: str, others: list[dict[str, Any]],
                            hints: Optional[dict[str, tuple[bool, bool]]] = None) -> Outcome:
        key = (namespace, name)
        started = time.monotonic()
        async with self.lock(key):
            outcome = await asyncio.to_thread(self.reconcile_sync, namespace, name, others, hints)
        self.metrics.duration.observe(time.monotonic() - started)
        self.metrics.reconciles.labels("ok").inc()
        if outcome.body is not None:
            for ev in outcome.events:
                kopf.event(outcome.body, type=ev.type, reason=ev.reason, message=ev.message[:1000])
        for hook in self.on_reconciled:
            hook(key, outcome)
        return outcome

    def register(self, registry: kopf.OperatorRegistry) -> None:
        op = self

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return connection_info(op.kube)

        @kopf.index(*POLICY, id="kvtier_policies", registry=registry)  # the id is the kwarg name
        async def kvtier_policies(namespace: str, name: str, spec: Any, meta: Any, **_: Any) -> dict[str, Any]:
            return {namespace: {"name": name, "selector": dict(spec).get("selector"),
                                "deleting": bool(meta.get("deletionTimestamp"))}}

        # Workload labels, indexed (kopf fills indexes before any daemon starts): they route events to the
        # policies concerned and tell a reconcile which lists can return something. Indexing writes nothing.
        # The index functions are async on purpose: kopf runs a sync handler in its thread executor, and at a
        # few hundred policies that hand-off (for every watch event of every Deployment) cost kopf's event
        # workers more than the indexing itself, delaying the daemons' start (bench/operator_scale.py, profiled).
        @kopf.index("apps", "v1", "deployments", id="kvtier_deployments", registry=registry)
        async def kvtier_deployments(namespace: str, name: str, labels: Any, **_: Any) -> dict[str, Any]:
            return {namespace: {"name": name, "labels": dict(labels)}}

        @kopf.index("apps", "v1", "statefulsets", id="kvtier_statefulsets", registry=registry)
        async def kvtier_statefulsets(namespace: str, name: str, labels: Any, **_: Any) -> dict[str, Any]:
            return {namespace: {"name": name, "labels": dict(labels)}}

        @kopf.on.event(*POLICY, id="policy-event", registry=registry)
        async def policy_event(type: str, name: str, namespace: str, meta: Any, spec: Any, body: Any,
                               kvtier_policies: kopf.Index, kvtier_deployments: kopf.Index,
                               kvtier_statefulsets: kopf.Index, **_: Any) -> None:
            key = (namespace, name)
            selector = dict(spec).get("selector") if type != "DELETED" else None
            change = op.events.policy(key, type, meta, selector)
            if change is None:
                return  # our own status write, kopf's finalizer, a label: nothing to re-render
            if type == "DELETED":
                op.wakeups.forget(key)
                # Backstop for the finalizer (class E): an author may remove kvtier's finalizer before deleting,
                # which skips the release handler. Whatever still carries this policy's label is released now,
                # unless a policy of that name is back already.
                if not any(p["name"] == name and not p.get("deleting") for p in kvtier_policies.get(namespace, [])):
                    await op.release_orphans(namespace, name, _plain(body))
                if not change.known:  # never seen (e.g. deleted while the operator was down): wake the namespace
                    for p in kvtier_policies.get(namespace, []):
                        op.trigger((namespace, p["name"]))
                    return
            else:
                op.trigger(key)
            if change.retargeted:
                # A new, re-targeted or deleting policy changes who conflicts with whom, on the workloads it
                # selects (or selected): wake the other policies selecting those.
                workloads = op._workload_labels(namespace, kvtier_deployments, kvtier_statefulsets)
                op._wake_neighbours(namespace, name, change.old_selector, selector, kvtier_policies, workloads)

        for plural in ("deployments", "statefulsets"):
            @kopf.on.event("apps", "v1", plural, id=f"{plural}-event", registry=registry)
            async def workload_event(type: str, name: str, namespace: str, body: Any, meta: Any,
                                     kvtier_policies: kopf.Index, **_: Any) -> None:
                change = op.events.workload((namespace, body.get("kind") or "", name), type, meta,
                                            rolled_out=Workload(body).rolled_out())
                if change in ("echo", "quiet"):
                    return
                labels = dict(meta.get("labels") or {})
                wanted = {p["name"] for p in kvtier_policies.get(namespace, []) if matches(p["selector"], labels)}
                if labels.get(POLICY_LABEL):
                    wanted.add(labels[POLICY_LABEL])
                for policy_name in wanted:
                    if change == "status":
                        op.trigger_later((namespace, policy_name), STATUS_ONLY_DELAY)
                    else:
                        op.trigger((namespace, policy_name))

        @kopf.daemon(*POLICY, id="reconcile", cancellation_timeout=30, registry=registry)
        async def reconcile_loop(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                                 kvtier_policies: kopf.Index, kvtier_deployments: kopf.Index,
                                 kvtier_statefulsets: kopf.Index, **_: Any) -> None:
            indexes = {"Deployment": kvtier_deployments, "StatefulSet": kvtier_statefulsets}
            await op.policy_loop(namespace, name, stopped, logger, kvtier_policies, indexes)

        @kopf.on.delete(*POLICY, id="release", registry=registry)
        async def release(name: str, namespace: str, body: Any, logger: logging.Logger, retry: int,
                          **_: Any) -> None:
            key = (namespace, name)
            async with op.lock(key):
                try:
                    count = await asyncio.to_thread(op.release_sync, namespace, name, _plain(body))
                except kopf.TemporaryError:
                    raise
                except Exception as err:  # noqa: BLE001 - every failure is retried; the finalizer waits
                    op.metrics.errors.labels(error_reason(err)).inc()
                    raise kopf.TemporaryError(f"releasing workloads failed: {err}",
                                              delay=backoff_delay(op.settings, retry))
            logger.info("released %d workload(s)", count)
            op.wakeups.forget(key)  # what it selected is forgotten on the DELETED event


    @staticmethod
    def _workload_labels(namespace: str, deployments: kopf.Index,
                         statefulsets: kopf.Index) -> list[dict[str, str]]:
        return [w["labels"] for index in (deployments, statefulsets) for w in index.get(namespace, [])]

    def _wake_neighbours(self, namespace: str, name: str, old_selector: Optional[dict[str, Any]],
                         new_selector: Optional[dict[str, Any]], policies: kopf.Index,
                         workloads: list[dict[str, str]]) -> None:
        """Wake the other policies that select a workload this policy selects or selected.

        Only a workload opted in to any policy (``OPT_IN_ANY``) can make two policies rivals (``reconcile.plan``
        counts a rival only where the workload opted in to it too); one opted in to a single policy by name
        leaves every other policy's plan alone. Skipping the rest keeps a new policy's event from costing
        O(policies x workloads) matches: at 500 policies in a namespace that was quadratic work on kopf's
        event loop, delaying every daemon's start (bench/operator_scale.py, profiled).
        """
        touched = [labels for labels in workloads
                   if labels.get(OPT_IN_LABEL) == OPT_IN_ANY
                   and (matches(old_selector, labels) or matches(new_selector, labels)
                        or labels.get(POLICY_LABEL) == name)]
        if not touched:
            return
        for p in policies.get(namespace, []):
            if p["name"] != name and any(matches(p["selector"], labels) or labels.get(POLICY_LABEL) == p["name"]
                                         for labels in touched):
                self.trigger((namespace, p["name"]))

    @staticmethod
    def _hints(name: str, selector: Optional[dict[str, Any]],
               indexes: dict[str, kopf.Index], namespace: str) -> dict[str, tuple[bool, bool]]:
        hints = {}
        for kind, index in indexes.items():
            items = list(index.get(namespace, []))
            by_selector = any(matches(selector, w["labels"]) for w in items)
            by_label = any(w["labels"].get(POLICY_LABEL) == name and not matches(selector, w["labels"])
                           for w in items)
            hints[kind] = (by_selector, by_label)
        return hints

    async def policy_loop(self, namespace: str, name: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                          index: kopf.Index, workload_indexes: Optional[dict[str, kopf.Index]] = None) -> None:
        key = (namespace, name)
        self.trigger(key)  # reconcile once on start (operator start or new policy)
        failures = 0

        async def _stopped() -> None:
            await stopped.wait()

        stop_task = asyncio.ensure_future(_stopped())
        try:
            while not stopped:
                await self.wakeups.wait(key, self.settings.resync_seconds, stop_task)
                if stopped:
                    break
                others = [dict(p) for p in index.get(namespace, []) if p["name"] != name]
                mine = next((p for p in index.get(namespace, []) if p["name"] == name), None)
                hints = (self._hints(name, mine["selector"], workload_indexes, namespace)
                         if workload_indexes and mine else None)
                try:
                    await self.run_reconcile(namespace, name, others, hints)
                    failures = 0
                except Exception as err:  # noqa: BLE001 - retried with backoff; never a crash loop
                    failures += 1
                    delay = backoff(self.settings.backoff_initial, self.settings.backoff_max, failures)
                    reason = error_reason(err)
                    self.metrics.errors.labels(reason).inc()
                    self.metrics.reconciles.labels("retry").inc()
                    if is_transient(err):
                        logger.info("reconcile of %s/%s hit %s; retrying in %.1fs", namespace, name, err, delay)
                    else:
                        logger.exception("reconcile of %s/%s failed; retrying in %.1fs", namespace, name, delay)
                    await asyncio.wait({stop_task}, timeout=delay)
                    self.trigger(key)
        finally:
            stop_task.cancel()


def backoff_delay(settings: Settings, retry: int) -> float:
    """Exponential backoff for kopf's retries (``retry`` counts the failures so far), capped at backoff_max."""
    return backoff(settings.backoff_initial, settings.backoff_max, retry + 1)


def _plain(body: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dict(body), default=lambda o: dict(o) if hasattr(o, "keys") else list(o)))


def connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """kopf logs in with exactly the credentials our own client uses."""
    cfg = kube.api.configuration
    token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if token and token.lower().startswith("bearer "):
        token = token.split(" ", 1)[1]
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl, token=token,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file, username=cfg.username or None,
        password=cfg.password or None)
