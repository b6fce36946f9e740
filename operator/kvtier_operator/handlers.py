"""kopf wiring: module-level handlers, each a few lines; the work is in ``controller`` and the pure modules.

- Policies: an index (kopf fills every index before any daemon starts, so conflicts are known from the first
  pass), an event handler that wakes the policy's daemon, the daemon (one loop per policy: a pass, then sleep
  until woken, the resync or the SLO guard's next evaluation) and a deletion handler behind the
  ``kvtier.io/finalizer`` finalizer.
- Foreign Deployments and StatefulSets: an index and an event handler only, which write nothing to them (kopf's
  changing handlers would annotate them: drift for GitOps).

``event_filter`` decides whether an event means work, ``wakeups`` wakes the policy's daemon (kopf runs a handler
for an object's own changes only; a policy must also react to its workloads'), ``controller`` runs the pass.
The process's shared state reaches the handlers as kopf's ``memo`` (:class:`Shared`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import kopf

from .api import v1alpha1 as api
from .controller import Operator, Outcome, ReleaseRefused
from .event_filter import EventFilter
from .kube import Kube, error_reason, is_transient
from .labels import OPT_IN_ANY, OPT_IN_LABEL
from .lanes import Lanes
from .printable import printable
from .selectors import matches
from .settings import FINALIZER, POLICY_LABEL, Settings
from .slo_tick import DEFAULT_INTERVAL
from .wakeups import Wakeups
from .workload import Workload

log = logging.getLogger("kvtier.operator")
POLICY = (api.GROUP, api.VERSION, api.PLURAL)
REGISTRY = kopf.OperatorRegistry()
Key = tuple[str, str]
# kopf's in-memory indexes as the index handlers below fill them: namespace -> the entries they return.
# kopf's handler protocols want every argument keyword-only and typed as kopf passes it; these handlers take only
# what they use, so each registration is marked (the arguments kopf passes are what they name).
Index = kopf.Index[str, dict[str, Any]]
KOPF_PROGRESS_FIELD = "status.kopf.progress"
KOPF_TOUCH_FIELD = "status.kopf.dummy"
KOPF_DIFFBASE_FIELD = "status.kopf.lastHandledConfiguration"
STATUS_ONLY_DELAY = 0.5  # coalesces the controller's status updates after a rollout


@dataclass
class Shared:
    """What the handlers of one operator process share (kopf's ``memo``)."""

    op: Operator
    wakeups: Wakeups = field(default_factory=Wakeups)
    events: EventFilter = field(default_factory=EventFilter)
    # A pass of a policy with spec.slo runs in the policy's own thread: its Prometheus can be slow (a client
    # timeout bounds each read, not a server that drips bytes), and on the shared executor a few slow ones would
    # hold every worker and stall every other policy's passes.
    lanes: Lanes = field(default_factory=lambda: Lanes("kvtier-slo"))
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.op.written = self.events.wrote

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    # Our own prefix everywhere kopf persists something, never kopf.zalando.org.
    s.persistence.finalizer = FINALIZER
    # kopf's progress (which handlers ran; the release handler's "done") and its diff base live in status.kopf,
    # written through the status subresource: a policy author may edit the policy (annotations included) but not
    # its status (the chart's aggregated edit role grants kvcachepolicies only), so forged progress cannot skip
    # the release (a policy author escaping clean-up). Annotations with these keys left by older versions are ignored.
    s.persistence.progress_storage = kopf.StatusProgressStorage(name="kopf", field=KOPF_PROGRESS_FIELD,
                                                                touch_field=KOPF_TOUCH_FIELD)
    s.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(name="kopf", field=KOPF_DIFFBASE_FIELD)
    s.posting.level = logging.WARNING  # kopf's own log lines are not user-facing Events; ours are posted explicitly
    s.posting.reporting_component = "kvtier-operator"
    s.posting.event_name_prefix = "kvtier-"
    s.watching.server_timeout = 300
    s.watching.connect_timeout = 10
    return s


def backoff_delay(settings: Settings, retry: int) -> float:
    """The one backoff: the delay before retry number ``retry`` (0: the first), initial x 2^retry, capped at
    backoff_max. The release handler hands it to kopf (TemporaryError, kopf counts ``retry``); a policy's loop
    counts its failures in a row itself (kopf's daemon retry count never resets while the daemon lives)."""
    return float(min(settings.backoff_initial * 2 ** min(max(retry, 0), 32), settings.backoff_max))


# ---------------------------------------------------------------------------------------------- handlers

@kopf.on.login(registry=REGISTRY)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(memo.shared.op.kube)


@kopf.index(*POLICY, id="kvtier_policies", registry=REGISTRY)  # type: ignore[arg-type]  # the id is the kwarg name
async def kvtier_policies(namespace: str, name: str, spec: Any, meta: Any, **_: Any) -> dict[str, Any]:
    tiers = dict(spec).get("tiers") or []
    return {namespace: {"name": name, "selector": dict(spec).get("selector"), "slo": bool(dict(spec).get("slo")),
                        "remote": any(isinstance(t, Mapping) and t.get("remote") for t in tiers),
                        "deleting": bool(meta.get("deletionTimestamp"))}}


# Workload labels, indexed: they route events to the policies concerned and tell a pass which lists can return
# something. Indexing writes nothing. The index functions are async on purpose: kopf runs a sync handler in its
# thread executor, and at a few hundred policies that hand-off (for every watch event of every Deployment) cost
# kopf's event loop more than the indexing itself, delaying the daemons' start (bench/operator_scale.py, profiled).
@kopf.index("apps", "v1", "deployments", id="kvtier_deployments", registry=REGISTRY)  # type: ignore[arg-type]
async def kvtier_deployments(namespace: str, name: str, labels: Any, **_: Any) -> dict[str, Any]:
    return {namespace: {"name": name, "labels": dict(labels)}}


@kopf.index("apps", "v1", "statefulsets", id="kvtier_statefulsets", registry=REGISTRY)  # type: ignore[arg-type]
async def kvtier_statefulsets(namespace: str, name: str, labels: Any, **_: Any) -> dict[str, Any]:
    return {namespace: {"name": name, "labels": dict(labels)}}


@kopf.on.event(*POLICY, id="policy-event", registry=REGISTRY)  # type: ignore[arg-type]
async def policy_event(type: str, name: str, namespace: str, meta: Any, spec: Any, body: Any, memo: kopf.Memo,
                       kvtier_policies: Index, kvtier_deployments: Index,
                       kvtier_statefulsets: Index, **_: Any) -> None:
    shared: Shared = memo.shared
    selector = dict(spec).get("selector") if type != "DELETED" else None
    change = shared.events.policy((namespace, name), type, meta, selector)
    if change is None:
        return  # our own status write, kopf's finalizer, a label: nothing to re-render
    policies = list(kvtier_policies.get(namespace, []))
    # Only a re-targeted policy looks at workloads (its neighbours); listing them for every event was O(workloads)
    # on kopf's event loop per policy event.
    workloads = [w["labels"] for index in (kvtier_deployments, kvtier_statefulsets)
                 for w in index.get(namespace, [])] if change.retargeted else []
    if type == "DELETED":
        shared.wakeups.forget((namespace, name))
        # Backstop for the finalizer: an author may remove kvtier's finalizer before deleting, which skips
        # the release handler. Whatever still carries this policy's label is released now, unless a policy of that
        # name is back already.
        if not any(p["name"] == name and not p.get("deleting") for p in policies):
            await release_orphans(shared, namespace, name, _plain(body))
    for other in to_wake(name, type, change.known, change.retargeted, change.old_selector, selector, policies,
                         workloads):
        shared.wakeups.trigger((namespace, other))


@kopf.on.event("apps", "v1", "deployments", id="deployments-event", registry=REGISTRY)
@kopf.on.event("apps", "v1", "statefulsets", id="statefulsets-event", registry=REGISTRY)  # type: ignore[arg-type]
async def workload_event(type: str, name: str, namespace: str, body: Any, meta: Any, memo: kopf.Memo,
                         kvtier_policies: Index, **_: Any) -> None:
    shared: Shared = memo.shared
    change = shared.events.workload((namespace, body.get("kind") or "", name), type, meta,
                                    rolled_out=Workload(body).rolled_out())
    if change in ("echo", "quiet"):
        return
    for policy in concerned(change, dict(meta.get("labels") or {}), list(kvtier_policies.get(namespace, []))):
        if change == "status":
            shared.wakeups.trigger_later((namespace, policy), STATUS_ONLY_DELAY)
        else:
            shared.wakeups.trigger((namespace, policy))


@kopf.daemon(*POLICY, id="reconcile", cancellation_timeout=30, registry=REGISTRY)  # type: ignore[arg-type]
async def policy_daemon(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                        memo: kopf.Memo, kvtier_policies: Index, kvtier_deployments: Index,
                        kvtier_statefulsets: Index, **_: Any) -> None:
    indexes = {"Deployment": kvtier_deployments, "StatefulSet": kvtier_statefulsets}
    await policy_loop(memo.shared, namespace, name, stopped, logger, kvtier_policies, indexes)


@kopf.on.delete(*POLICY, id="release", registry=REGISTRY)  # type: ignore[arg-type]
async def release(name: str, namespace: str, body: Any, logger: logging.Logger, retry: int, memo: kopf.Memo,
                  **_: Any) -> None:
    shared: Shared = memo.shared
    async with shared.lock((namespace, name)):
        try:
            count = await asyncio.to_thread(shared.op.release, namespace, name, _plain(body))
        except Exception as err:
            shared.op.metrics.errors.labels(error_reason(err)).inc()
            delay = shared.op.settings.backoff_max if isinstance(err, ReleaseRefused) else \
                backoff_delay(shared.op.settings, retry)
            raise kopf.TemporaryError(f"releasing workloads failed: {err}", delay=delay) from err
    logger.info("released %d workload(s)", count)
    shared.wakeups.forget((namespace, name))  # what it selected is forgotten on the DELETED event


# ---------------------------------------------------------------------------------------------- the loop

async def policy_loop(shared: Shared, namespace: str, name: str, stopped: kopf.DaemonStopped,
                      logger: logging.Logger, index: Index,
                      workload_indexes: Optional[dict[str, Index]] = None) -> None:
    """One loop per policy: a pass (reconcile, the SLO guard when due, one status write), then sleep until woken,
    the resync, or the guard's next evaluation. A failed pass is retried with backoff; never a crash loop."""
    key = (namespace, name)
    op = shared.op
    shared.wakeups.trigger(key)  # a pass on start (operator start or new policy)
    failures, guard_at = 0, 0.0  # guard_at: monotonic time the SLO guard is next due
    # resync_at: the next pass nothing else asked for; recheck_at: the next re-read of the Secrets remote tiers name.
    resync_at = recheck_at = time.monotonic()
    stop_task = asyncio.ensure_future(stopped.wait())
    try:
        while not stopped:
            now = time.monotonic()
            mine = next((p for p in index.get(namespace, []) if p["name"] == name), None)
            has_slo, has_remote = bool(mine and mine.get("slo")), bool(mine and mine.get("remote"))
            due = [resync_at] + ([guard_at] if has_slo else []) + ([recheck_at] if has_remote else [])
            woken = await shared.wakeups.wait(key, max(0.0, min(due) - now), stop_task)
            if stopped:
                break
            now = time.monotonic()
            if has_remote and now >= recheck_at:
                recheck_at = now + op.settings.secret_recheck_seconds
                if not woken and now < resync_at and not (has_slo and now >= guard_at) and \
                        not await secrets_changed(op, namespace, name):
                    continue  # only the recheck was due, and the Secrets are as the last pass read them
            resync_at = now + op.settings.resync_seconds
            mine = next((p for p in index.get(namespace, []) if p["name"] == name), None)
            # The index's entries are the dicts kvtier_policies returned, replaced (never changed) on each event:
            # read as they are, not copied (copying all of them for every pass was quadratic in policies).
            others = [p for p in index.get(namespace, []) if p["name"] != name]
            hints = hints_for(name, mine["selector"], workload_indexes, namespace) if workload_indexes and mine \
                else None
            guard_due = time.monotonic() >= guard_at
            try:
                outcome = await run_pass(shared, key, others, hints, guard_due, bool(mine and mine.get("slo")))
                failures = 0
            except Exception as err:
                failures += 1
                delay = backoff_delay(op.settings, failures - 1)
                op.metrics.errors.labels(error_reason(err)).inc()
                op.metrics.reconciles.labels("retry").inc()
                if is_transient(err):
                    logger.info("pass of %s/%s hit %s; retrying in %.1fs", namespace, name, err, delay)
                else:
                    logger.exception("pass of %s/%s failed; retrying in %.1fs", namespace, name, delay)
                await asyncio.wait({stop_task}, timeout=delay)
                shared.wakeups.trigger(key)
                continue
            if outcome.guard is not None:
                guard_at = time.monotonic() + outcome.guard.interval
            elif guard_due:
                guard_at = time.monotonic() + DEFAULT_INTERVAL
    finally:
        stop_task.cancel()
        shared.lanes.close(key)


async def secrets_changed(op: Operator, namespace: str, name: str) -> bool:
    """``Operator.secrets_changed`` off kopf's event loop; a failed read counts as a change, so a pass reads the
    Secrets again and reports (or retries) what failed."""
    try:
        return await asyncio.to_thread(op.secrets_changed, namespace, name)
    except Exception as err:
        log.info("re-reading the Secrets of %s/%s failed (%s); running a pass", namespace, name, err)
        return True


async def run_pass(shared: Shared, key: Key, others: list[dict[str, Any]],
                   hints: Optional[dict[str, tuple[bool, bool]]], guard_due: bool, in_lane: bool) -> Outcome:
    op = shared.op
    started = time.monotonic()
    async with shared.lock(key):
        args = (key[0], key[1], others, hints, guard_due)
        if in_lane:
            outcome = await shared.lanes.run(key, op.run_pass, *args)
        else:
            outcome = await asyncio.to_thread(op.run_pass, *args)
    op.metrics.duration.observe(time.monotonic() - started)
    op.metrics.reconciles.labels("ok").inc()
    step = outcome.guard
    if step is not None:
        if step.verdict:
            op.metrics.slo_evaluations.labels(step.verdict).inc()
        for tier in step.rollbacks:
            op.metrics.rollbacks.labels(key[0], key[1], tier).inc()
    if outcome.body is not None:
        for ev in outcome.events:
            post_event(outcome.body, key, ev)
    op.reconciled(key, outcome)
    return outcome


def post_event(body: dict[str, Any], key: Key, ev: Any) -> None:
    """One Event, its message escaped (user input may carry control characters) and bounded. The transitions a
    user sees as Events also reach the log (kopf's per-event lines are off unless --verbose): one line per
    transition, not per watch event."""
    message = printable(ev.message)[:1000]
    kopf.event(cast(kopf.Body, body), type=ev.type, reason=ev.reason, message=message)
    log.log(logging.WARNING if ev.type == "Warning" else logging.INFO, "%s/%s: %s: %s",
            key[0], key[1], ev.reason, message)


async def release_orphans(shared: Shared, namespace: str, name: str, body: dict[str, Any]) -> None:
    """Release what a deleted policy left applied (its finalizer removed by someone else); never raises."""
    async with shared.lock((namespace, name)):
        try:
            count = await asyncio.to_thread(shared.op.release, namespace, name, body)
        except Exception as err:
            shared.op.metrics.errors.labels(error_reason(err)).inc()
            log.warning("releasing workloads of deleted policy %s/%s failed: %s", namespace, name, err)
            return
    if count:
        log.warning("policy %s/%s was deleted without its release (finalizer removed); released %d workload(s)",
                    namespace, name, count)


# ---------------------------------------------------------------------------------------------- routing (pure)

def to_wake(name: str, event_type: str, known: bool, retargeted: bool, old_selector: Optional[dict[str, Any]],
            new_selector: Optional[dict[str, Any]], policies: list[dict[str, Any]],
            workloads: list[dict[str, str]]) -> list[str]:
    """The policies a policy's event wakes: itself (unless deleted), and, when it appeared, was re-targeted or
    went away, the other policies sharing a workload with it (their conflicts may change). A deletion never seen
    before (e.g. while the operator was down) wakes the namespace."""
    if event_type == "DELETED" and not known:
        return [p["name"] for p in policies]
    out = [] if event_type == "DELETED" else [name]
    if retargeted:
        out += neighbours(name, old_selector, new_selector, policies, workloads)
    return out


def neighbours(name: str, old_selector: Optional[dict[str, Any]], new_selector: Optional[dict[str, Any]],
               policies: list[dict[str, Any]], workloads: list[dict[str, str]]) -> list[str]:
    """The other policies that select a workload this policy selects or selected.

    Only a workload opted in to any policy (``OPT_IN_ANY``) can make two policies rivals (``reconcile.plan``
    counts a rival only where the workload opted in to it too); one opted in to a single policy by name leaves
    every other policy's plan alone. Skipping the rest keeps a new policy's event from costing O(policies x
    workloads) matches: at 500 policies in a namespace that was quadratic work on kopf's event loop, delaying
    every daemon's start (bench/operator_scale.py, profiled).
    """
    touched = [labels for labels in workloads
               if labels.get(OPT_IN_LABEL) == OPT_IN_ANY
               and (matches(old_selector, labels) or matches(new_selector, labels)
                    or labels.get(POLICY_LABEL) == name)]
    if not touched:
        return []
    return [p["name"] for p in policies
            if p["name"] != name and any(matches(p["selector"], labels) or labels.get(POLICY_LABEL) == p["name"]
                                         for labels in touched)]


def concerned(change: str, labels: dict[str, str], policies: list[dict[str, Any]]) -> list[str]:
    """The policies a workload's event concerns. A change of its spec or labels, or its deletion: those selecting
    it, and the one whose label it carries. A status-only change (a rollout finished or restarted): only the one
    whose label it carries, since ``Progressing`` is reported for configured targets only; matching every policy
    of the namespace on each of the controller's status updates was O(policies) per event, quadratic over a
    burst of new policies."""
    mine = labels.get(POLICY_LABEL)
    if change == "status":
        return [mine] if mine else []
    wanted = sorted({p["name"] for p in policies if matches(p["selector"], labels)} | ({mine} if mine else set()))
    return wanted


def hints_for(name: str, selector: Optional[dict[str, Any]], indexes: dict[str, Index],
              namespace: str) -> dict[str, tuple[bool, bool]]:
    """Per kind: (some workload matches the selector, some carries this policy's label without matching)."""
    hints = {}
    for kind, index in indexes.items():
        items = list(index.get(namespace, []))
        by_selector = any(matches(selector, w["labels"]) for w in items)
        by_label = any(w["labels"].get(POLICY_LABEL) == name and not matches(selector, w["labels"]) for w in items)
        hints[kind] = (by_selector, by_label)
    return hints


def _plain(body: Any) -> dict[str, Any]:
    plain: dict[str, Any] = json.loads(json.dumps(dict(body), default=lambda o: dict(o) if hasattr(o, "keys")
                                                   else list(o)))
    return plain


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
