"""kopf wiring: observe policies and workloads, reconcile each policy from its own daemon.

Foreign Deployments and StatefulSets get only an index-free ``on.event`` handler, which writes nothing to them
(kopf's changing handlers would annotate them: drift for GitOps). Policies get an index (kopf fills every index
before any daemon starts, so conflicts are known from the first reconcile), an event handler that wakes the
policy's daemon, the daemon that reconciles, a deletion handler behind the ``kvtier.io/finalizer`` finalizer,
and, for policies with ``spec.slo``, the SLO guard's daemon.
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
from .api.units import parse_quantity
from .kube import NODES, STRATEGIC, ApiError, Kube, config_map_path, is_transient, policy_path, workload_path
from .metrics import Metrics
from .selectors import matches, to_query
from .settings import FINALIZER, POLICY_LABEL, PREFIX, Settings
from .status import now_rfc3339, status_patch
from .workload import KINDS, Workload, removal_patch

log = logging.getLogger("kvtier.operator")
POLICY = ("kvtier.io", "v1alpha1", "kvcachepolicies")
REENABLE_ANNOTATION = f"{PREFIX}/reenable"
Key = tuple[str, str]


@dataclass
class Outcome:
    """What one reconcile did (returned to the async side, which posts the events)."""

    body: Optional[dict[str, Any]]
    events: list[rc.Event] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # workload ref -> config hash now on it
    status_written: bool = False


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    # Our own prefix everywhere kopf persists something, never kopf.zalando.org.
    s.persistence.finalizer = FINALIZER
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX,
                                                                     key="last-handled-configuration")
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
        self.triggers: dict[Key, asyncio.Event] = {}
        self.locks: dict[Key, asyncio.Lock] = {}
        self.seen: dict[Key, tuple[Any, ...]] = {}
        self.own_writes: dict[tuple[str, str, str], str] = {}  # (ns, kind, name) -> resourceVersion we produced
        self._nodes: tuple[float, Optional[int]] = (0.0, None)
        self._nodes_readable = settings.read_nodes
        # Hooks for tests and the benchmark: called after every reconcile with (key, outcome).
        self.on_reconciled: list[Callable[[Key, Outcome], None]] = []
        self.slo_hook: Optional[Callable[..., Any]] = None
        self.tier_states_fn: Optional[rc.TierStatesFn] = None  # set when the SLO guard is wired in
        self.slo_source: Optional[Callable[[str, str], Any]] = None  # test seam: measurements instead of Prometheus

    # ----------------------------------------------------------------------------------------- triggers

    def trigger(self, key: Key) -> None:
        self.triggers.setdefault(key, asyncio.Event()).set()

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: Key) -> None:
        self.triggers.pop(key, None)
        self.seen.pop(key, None)

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

    def observe_workloads(self, namespace: str, name: str, selector: Optional[dict[str, Any]]) -> list[dict]:
        out: list[dict[str, Any]] = []
        query = to_query(selector) if selector else ""
        for kind in KINDS:
            if query:
                out += self.kube.list(workload_path(kind, namespace), query)
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
                self.own_writes[(namespace, t.kind, t.name)] = result["metadata"]["resourceVersion"]
                outcome.applied[t.ref] = t.config_hash or ""
            if t.remove:
                result = self.kube.apply(path, removal_patch(Workload({"kind": t.kind, "metadata": {
                    "name": t.name, "namespace": namespace}})))
                self.metrics.api_writes.labels("workload-release").inc()
                self.own_writes[(namespace, t.kind, t.name)] = result["metadata"]["resourceVersion"]
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

    def reconcile_sync(self, namespace: str, name: str, others: list[dict[str, Any]]) -> Outcome:
        policy = self.kube.get(policy_path(namespace, name))
        if policy is None or policy["metadata"].get("deletionTimestamp"):
            return Outcome(None)
        policy.setdefault("apiVersion", "kvtier.io/v1alpha1")
        policy.setdefault("kind", "KVCachePolicy")
        selector = (policy.get("spec") or {}).get("selector")
        workloads = self.observe_workloads(namespace, name, selector)
        others_objs = [{"metadata": {"name": o["name"]}, "spec": {"selector": o.get("selector")}} for o in others]
        now = now_rfc3339()
        plan = rc.plan(policy, workloads, others_objs, now=now, node_allocatable=self.node_allocatable(),
                       cleanup_image=self.settings.cleanup_image, tier_states_fn=self.tier_states_fn)
        outcome = Outcome(policy)
        # The ConfigMap first, so pods rolled by the new hash read the new files.
        if plan.config_map is not None:
            self.kube.apply(config_map_path(namespace, plan.config_map["metadata"]["name"]), plan.config_map)
            self.metrics.api_writes.labels("configmap").inc()
        failures: dict[str, str] = {}
        for t in plan.targets:
            self._write_workload(namespace, t, failures, outcome)
        plan = rc.with_failures(plan, policy, failures, now)
        patch = status_patch(policy.get("status") or {}, plan.status)
        if patch is not None:
            # Guarded by the resourceVersion we planned from: a concurrent change is a 409, and we plan again.
            self.kube.patch(policy_path(namespace, name, status=True),
                            {"metadata": {"resourceVersion": policy["metadata"]["resourceVersion"]},
                             "status": patch})
            self.metrics.api_writes.labels("status").inc()
            outcome.status_written = True
        outcome.events = plan.events
        applied = sum(1 for t in plan.targets if t.state in (rc.APPLIED, rc.MISSING_ARG) and t.ref not in failures)
        self.metrics.applied_targets.labels(namespace, name).set(applied)
        return outcome

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
        self.kube.delete(config_map_path(namespace, rc.config_map_name(name)))
        try:
            self.metrics.applied_targets.remove(namespace, name)
        except KeyError:
            pass
        return released

    # ----------------------------------------------------------------------------------------- async side

    async def run_reconcile(self, namespace: str, name: str, others: list[dict[str, Any]]) -> Outcome:
        key = (namespace, name)
        started = time.monotonic()
        async with self.lock(key):
            outcome = await asyncio.to_thread(self.reconcile_sync, namespace, name, others)
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
        def kvtier_policies(namespace: str, name: str, spec: Any, meta: Any, **_: Any) -> dict[str, Any]:
            return {namespace: {"name": name, "selector": dict(spec).get("selector"),
                                "deleting": bool(meta.get("deletionTimestamp"))}}

        @kopf.on.event(*POLICY, id="policy-event", registry=registry)
        async def policy_event(type: str, name: str, namespace: str, meta: Any, spec: Any,
                               kvtier_policies: kopf.Index, **_: Any) -> None:
            key = (namespace, name)
            if type == "DELETED":
                op.forget(key)
                op._wake_namespace(namespace, kvtier_policies, exclude=name)
                return
            selector = json.dumps(dict(spec).get("selector"), sort_keys=True)
            fingerprint = (meta.get("generation"), (meta.get("annotations") or {}).get(REENABLE_ANNOTATION),
                           selector, bool(meta.get("deletionTimestamp")))
            before = op.seen.get(key)
            if before == fingerprint:
                return  # our own status write, kopf's finalizer, a label: nothing to re-render
            op.seen[key] = fingerprint
            op.trigger(key)
            if before is None or before[2:] != fingerprint[2:]:
                # A new, re-targeted or deleting policy changes who conflicts with whom.
                op._wake_namespace(namespace, kvtier_policies, exclude=name)

        for plural in ("deployments", "statefulsets"):
            @kopf.on.event("apps", "v1", plural, id=f"{plural}-event", registry=registry)
            async def workload_event(type: str, name: str, namespace: str, body: Any, meta: Any,
                                     kvtier_policies: kopf.Index, **_: Any) -> None:
                kind = body.get("kind") or ""
                if type != "DELETED" and op.own_writes.get((namespace, kind, name)) == meta.get("resourceVersion"):
                    return  # the echo of our own apply
                labels = dict(meta.get("labels") or {})
                wanted = {p["name"] for p in kvtier_policies.get(namespace, []) if matches(p["selector"], labels)}
                if labels.get(POLICY_LABEL):
                    wanted.add(labels[POLICY_LABEL])
                for policy_name in wanted:
                    op.trigger((namespace, policy_name))

        @kopf.daemon(*POLICY, id="reconcile", cancellation_timeout=30, registry=registry)
        async def reconcile_loop(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                                 kvtier_policies: kopf.Index, **_: Any) -> None:
            await op.policy_loop(namespace, name, stopped, logger, kvtier_policies)

        @kopf.on.delete(*POLICY, id="release", registry=registry)
        async def release(name: str, namespace: str, body: Any, logger: logging.Logger, **_: Any) -> None:
            key = (namespace, name)
            async with op.lock(key):
                try:
                    count = await asyncio.to_thread(op.release_sync, namespace, name, _plain(body))
                except kopf.TemporaryError:
                    raise
                except Exception as err:  # noqa: BLE001 - every failure is retried; the finalizer waits
                    op.metrics.errors.labels(_reason(err)).inc()
                    raise kopf.TemporaryError(f"releasing workloads failed: {err}", delay=op.settings.backoff_initial)
            logger.info("released %d workload(s)", count)
            op.forget(key)

        if self.slo_hook is not None:
            self.slo_hook(registry, self)

    def _wake_namespace(self, namespace: str, index: kopf.Index, exclude: str) -> None:
        for p in index.get(namespace, []):
            if p["name"] != exclude:
                self.trigger((namespace, p["name"]))

    async def policy_loop(self, namespace: str, name: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                          index: kopf.Index) -> None:
        key = (namespace, name)
        self.trigger(key)  # reconcile once on start (operator start or new policy)
        delay = self.settings.backoff_initial

        async def _stopped() -> None:
            await stopped.wait()

        stop_task = asyncio.ensure_future(_stopped())
        try:
            while not stopped:
                event = self.triggers.setdefault(key, asyncio.Event())
                wake = asyncio.ensure_future(event.wait())
                await asyncio.wait({wake, stop_task}, timeout=self.settings.resync_seconds,
                                   return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                if stopped:
                    break
                event.clear()
                others = [dict(p) for p in index.get(namespace, []) if p["name"] != name]
                try:
                    await self.run_reconcile(namespace, name, others)
                    delay = self.settings.backoff_initial
                except Exception as err:  # noqa: BLE001 - retried with backoff; never a crash loop
                    reason = _reason(err)
                    self.metrics.errors.labels(reason).inc()
                    self.metrics.reconciles.labels("retry").inc()
                    if is_transient(err):
                        logger.info("reconcile of %s/%s hit %s; retrying in %.1fs", namespace, name, err, delay)
                    else:
                        logger.exception("reconcile of %s/%s failed; retrying in %.1fs", namespace, name, delay)
                    await asyncio.wait({stop_task}, timeout=delay)
                    delay = min(delay * 2, self.settings.backoff_max)
                    self.trigger(key)
        finally:
            stop_task.cancel()


def _reason(err: BaseException) -> str:
    if isinstance(err, ApiError):
        return "Conflict" if err.status == 409 else f"HTTP{err.status}"
    return type(err).__name__


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
