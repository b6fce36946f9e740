"""The reconcile, as a pure function: a policy and what was observed in, everything to write out.

No I/O here: ``handlers`` reads the cluster, calls ``plan`` and performs what it returns, so every decision
(conflicts, refusals, missing arguments, removals, conditions, events) is unit-tested without a cluster.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from kvtier_runtime.config import control_file_json

from . import parsed
from .api import v1alpha1 as api
from .api.guard_state import SLOGuardState
from .api.times import parse_time
from .api.validation import PolicyInvalid, Problem, parse_policy
from .printable import printable
from .render import CONFIG_DIR, CONFIG_FILE, CONTROL_FILE, RenderedConfig, RenderError, detect_engine, render
from .render.vllm import events_topic_args
from .reports import Cond, Event
from .selectors import matches
from .settings import FIELD_MANAGER, POLICY_LABEL
from .status import merge_conditions, transitions
from .tiers import STORED, GuardInput, enabled, guard_disabled, stored_guard, tier_states
from .trust import (
    host_path_problems,
    not_opted_in_message,
    opted_in,
    pvc_problems,
    remote_secret_problems,
    remote_store_problems,
    secret_namespace_problems,
)
from .workload import (
    Workload,
    already_applied,
    apply_patch,
    args_update,
    facts_of,
    has_config_args,
    plan_memory,
    with_config_args,
    without_config_args,
)

# Target states (status.targets[].state).
APPLIED = "Applied"
MISSING_ARG = "MissingConfigArgument"
CONFLICT = "Conflict"
REFUSED = "Refused"
NOT_OPTED_IN = "NotOptedIn"
ERROR = "Error"
RELEASED = "Released"


@dataclass
class TargetPlan:
    kind: str
    name: str
    state: str
    message: str = ""
    config_hash: Optional[str] = None
    apply: Optional[dict[str, Any]] = None  # server-side apply body (None: leave the workload alone)
    args_update: Optional[dict[str, Any]] = None  # managed args: strategic-merge patch with resourceVersion
    remove: bool = False  # release everything FIELD_MANAGER owns on it
    unchanged: bool = False  # the workload already carries exactly this: nothing to write

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    def status(self) -> dict[str, Any]:
        out = {"kind": self.kind, "name": self.name, "state": self.state, "message": _short(printable(self.message))}
        if self.config_hash:
            out["configHash"] = self.config_hash
        return out


@dataclass(frozen=True)
class Observed:
    """What a plan's status was computed from, so ``with_failures`` recomputes it from the same inputs."""

    tier_states: list[dict[str, Any]]
    enabled_tiers: list[str]
    engine: Optional[str]
    workloads: list[Workload]
    # The remote tier's size once per workload configured with it (None without an enabled remote tier).
    remote_budget_bytes: Optional[int] = None
    # The policy has an SLO guard (which measures hit ratios); without one, stored figures are cleared.
    measured: bool = False


@dataclass
class Plan:
    config_map: Optional[dict[str, Any]]
    targets: list[TargetPlan]
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    invalid: bool = False
    context: Optional[Observed] = None
    # Delete the ConfigMap kvtier made for this policy (a revocation: no workload may read it any more).
    release_config_map: bool = False


def control_generation(guard: Optional[SLOGuardState]) -> int:
    """The control file's generation: the newest guard decision's time in epoch milliseconds (0 before any, or
    without a guard), so it grows with every decision and the same state always writes the same bytes. An entry
    whose time does not read (a hand edit) is skipped: it cannot void the file."""
    newest = 0
    for entry in guard.history if guard is not None else ():
        when = parse_time(entry.time)  # a time that does not validate reads as None (api.guard_state)
        if when is not None and when > 0:
            newest = max(newest, round(when * 1000))
    return newest


def config_map_name(policy_name: str) -> str:
    return f"kvtier-{policy_name}"


def _owner_reference(policy_obj: dict[str, Any]) -> dict[str, Any]:
    meta = policy_obj["metadata"]
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def config_map_body(policy_obj: dict[str, Any], files: dict[str, str]) -> dict[str, Any]:
    meta = policy_obj["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(meta["name"]),
            "namespace": meta["namespace"],
            "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER, POLICY_LABEL: meta["name"]},
            "ownerReferences": [_owner_reference(policy_obj)],
        },
        "data": dict(files),
    }


def _unique(workloads: Iterable[dict[str, Any]]) -> list[Workload]:
    seen: dict[tuple[str, str], Workload] = {}
    for obj in workloads:
        w = Workload(obj)
        seen.setdefault((w.kind, w.name), w)
    return sorted(seen.values(), key=lambda w: (w.kind, w.name))


def _selector_of(policy_obj: dict[str, Any]) -> Optional[dict[str, Any]]:
    return (policy_obj.get("spec") or {}).get("selector")


def _config_args_for(spec: api.KVCachePolicySpec, container: dict[str, Any], namespace: str) -> list[str]:
    """The arguments that point the engine at our file (and, with spec.events, name its KV event topic), for the
    declared or detected engine."""
    engine: Optional[str] = spec.engine
    if engine is None:
        try:
            engine = detect_engine(facts_of(container))
        except RenderError:
            engine = "vllm"
    if engine == "trtllm":
        return ["--extra_llm_api_options", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    events = spec.events if spec.events is not None and spec.events.enabled else None
    return ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}",
            *(events_topic_args(events, namespace) if events is not None else [])]


def _release(w: Workload, spec: Optional[api.KVCachePolicySpec], reason: str) -> TargetPlan:
    t = TargetPlan(w.kind, w.name, RELEASED, reason, remove=True)
    if spec is not None and spec.injection.args == "managed":
        # Managed args were ours: take back exactly the argument we added.
        c = w.container(spec.container)
        config_args = _config_args_for(spec, c, w.namespace) if c is not None else None
        if c is not None and config_args and config_args[0] in (c.get("args") or []):
            t.args_update = args_update(w, c["name"], without_config_args(list(c.get("args") or []), config_args))
    return t


def _target(policy: api.KVCachePolicy, doc_key: str, w: Workload, enabled_tiers: list[str],
            bypassed_tiers: list[str], *, node_allocatable: Optional[int],
            cleanup_image: str) -> tuple[TargetPlan, Optional[RenderedConfig]]:
    spec, name = policy.spec, policy.metadata["name"]
    container = w.container(spec.container)
    if container is None:
        names = ", ".join(c.get("name", "?") for c in w.containers) or "none"
        return TargetPlan(w.kind, w.name, ERROR, f"{w.ref}: spec.container {spec.container!r} not found "
                                                 f"(containers: {names})"), None
    try:
        if spec.engine is None:
            # Validate with the detected engine here (cached per spec) so render() need not re-parse the policy.
            policy = parsed.with_engine(doc_key, detect_engine(facts_of(container)))
        rendered = render(policy, facts_of(container), enabled_tiers=enabled_tiers, bypassed_tiers=bypassed_tiers,
                          config_map_name=config_map_name(name))
    except RenderError as err:
        return TargetPlan(w.kind, w.name, ERROR, f"{w.ref}: {err}"), None
    except PolicyInvalid as err:
        problems = "; ".join(str(p) for p in err.problems)
        return TargetPlan(w.kind, w.name, ERROR, f"{w.ref}: {problems}"), None
    memory = plan_memory(w, container, rendered, node_allocatable)
    if memory.refused:
        return TargetPlan(w.kind, w.name, REFUSED, f"{w.ref}: {memory.refused}"), rendered
    digest = rendered.config_hash()
    bypassed = f"; bypassed live: {','.join(rendered.bypassed)}" if rendered.bypassed else ""
    plan = TargetPlan(w.kind, w.name, APPLIED, f"{w.ref}: configuration {digest} (tiers: "
                                               f"{','.join(rendered.tiers) or 'none'}{bypassed})", config_hash=digest)
    plan.apply = apply_patch(w, container["name"], rendered, policy=name, config_hash=digest,
                             cleanup_image=cleanup_image, memory_limit=memory.apply_limit)
    if already_applied(w, plan.apply):
        plan.apply, plan.unchanged = None, True
    if not has_config_args(container, rendered.config_args):
        wanted = " ".join(rendered.config_args)
        if spec.injection.args == "managed":
            plan.args_update = args_update(w, container["name"],
                                           with_config_args(list(container.get("args") or []), rendered.config_args))
        else:
            # Nothing is applied until the workload's owner passes the argument: the argument is their consent
            # to this configuration, on top of the opt-in label.
            plan.state = MISSING_ARG
            plan.apply, plan.unchanged, plan.config_hash = None, False, None
            plan.message = (f"{w.ref}: add the argument \"{wanted}\" to the args of container "
                            f"{container['name']!r} (or set spec.injection.args: managed); nothing is applied "
                            "until then")
    return plan, rendered


def plan(policy_obj: dict[str, Any], workloads: Iterable[dict[str, Any]], other_policies: Iterable[dict[str, Any]],
         *, now: str, node_allocatable: Optional[int] = None, cleanup_image: str = "busybox:1.37.0",
         server_validated: bool = False, host_path_prefixes: Iterable[str] = (),
         pvc_allowed: Iterable[str] = (), remote_stores_allowed: Iterable[str] = (),
         secrets: Optional[Mapping[str, Optional[Mapping[str, Any]]]] = None,
         secret_namespaces: Optional[Iterable[str]] = None, guard: GuardInput = STORED) -> Plan:
    """Everything one reconcile of ``policy_obj`` must write.

    ``workloads``: Deployments and StatefulSets of the namespace that match the selector or carry our policy
    label. ``other_policies``: the namespace's other live policies (for conflicts). Tier states come from
    ``tiers.tier_states`` (the spec and the SLO guard's state). ``guard``: that state as the pass holds it (typed;
    None: no guard state); by default ``status.slo``, parsed here.
    ``server_validated``: the object comes from the API server, which already ran the CRD's CEL rules.
    ``host_path_prefixes``: node paths the admin lets tiers mount (operator settings); default none.
    ``pvc_allowed``: claims the admin lets tiers mount (NAMESPACE/CLAIM, '*' for either part); default none.
    ``remote_stores_allowed``: Valkey/Redis stores remote tiers may use (trust.remote_store_problems); default none.
    ``secrets``: the Secrets remote tiers name, as read by the operator (None where missing or unreadable); each
    must consent to its store (trust.remote_secret_problems). None: not checked (offline rendering only; the
    operator always passes them).
    ``secret_namespaces``: namespaces whose Secrets remote tiers may name (operator.remoteSecretNamespaces); None:
    not checked (offline rendering only; the operator always passes them).
    """
    meta = policy_obj["metadata"]
    name = meta["name"]
    old = policy_obj.get("status") or {}
    ws = _unique(workloads)
    doc_key = parsed.key(policy_obj)
    try:
        policy = parsed.parse(doc_key, server_validated)
        if len(name) > api.MAX_POLICY_NAME:
            # Stored before the CRD refused such names: the name cannot become a label value, so nothing can
            # be applied; say so instead of failing every write.
            raise PolicyInvalid([Problem("metadata.name", f"must be at most {api.MAX_POLICY_NAME} characters (it "
                                                          "is the kvtier.io/policy label's value); recreate the "
                                                          "policy under a shorter name")])
        refused = host_path_problems(policy.spec, host_path_prefixes, meta.get("namespace", ""))
        claims = pvc_problems(policy.spec, meta.get("namespace", ""), pvc_allowed)
        stores = remote_store_problems(policy.spec, remote_stores_allowed)
        consent: list[str] = []
        if not stores and secret_namespaces is not None:
            consent = secret_namespace_problems(policy.spec, meta.get("namespace", ""), secret_namespaces)
        if not stores and not consent and secrets is not None:
            consent = remote_secret_problems(policy.spec, secrets)
    except PolicyInvalid as err:
        refused = [str(p) for p in err.problems]
        reason = "InvalidPolicy"
    else:
        reason = ("HostPathNotAllowed" if refused else "PersistentVolumeClaimNotAllowed" if claims
                  else "RemoteStoreNotAllowed" if stores else "SecretNotAllowed")
        refused += claims + stores + consent
    if refused:
        if reason in TRUST_REASONS:
            # Trust (the admin's settings) no longer admits this policy: what an earlier pass applied under it (a
            # mount, a Secret projection, a store URL) is taken back, not left in place.
            return revocation(policy_obj, policy.spec, ws, reason, "; ".join(refused), now)
        return refusal(policy_obj, reason, "; ".join(refused), now)

    spec = policy.spec
    state = stored_guard(spec, old, now) if isinstance(guard, str) else guard
    states = tier_states(spec, old, now, state)
    on, off = enabled(states), guard_disabled(states)
    others = [p for p in other_policies if p["metadata"]["name"] != name]
    targets: list[TargetPlan] = []
    rendered_by_target: dict[str, RenderedConfig] = {}
    for w in ws:
        if not matches(spec.selector.model_dump(by_alias=True, exclude_none=True), w.labels):
            if w.applied_by == name:
                targets.append(_release(w, spec, f"{w.ref} no longer matches the selector"))
            continue
        # Opt-in first: a policy the workload's owner did not opt in to has no say over it, so it can
        # neither conflict with the policy the owner chose nor freeze it.
        if not opted_in(w.labels, name):
            # The policy's author may not be allowed to edit this workload; its owner must consent.
            if w.applied_by == name:
                targets.append(_release(w, spec, f"{w.ref} no longer opts in ({not_opted_in_message(w.ref, name)})"))
            else:
                targets.append(TargetPlan(w.kind, w.name, NOT_OPTED_IN, not_opted_in_message(w.ref, name)))
            continue
        rivals = sorted(p["metadata"]["name"] for p in others
                        if matches(_selector_of(p), w.labels) and opted_in(w.labels, p["metadata"]["name"]))
        if rivals:
            targets.append(TargetPlan(w.kind, w.name, CONFLICT,
                                      f"{w.ref} is also selected by KVCachePolicy {', '.join(rivals)}, which it "
                                      f"opted in to too; no policy changes it until only one selects it"))
            continue
        t, rendered = _target(policy, doc_key, w, on, off, node_allocatable=node_allocatable,
                              cleanup_image=cleanup_image)
        targets.append(t)
        if rendered is not None and (t.apply is not None or t.unchanged):
            rendered_by_target[t.ref] = rendered

    # One ConfigMap per policy: every target must read the same files (same engine).
    files: Optional[dict[str, str]] = None
    first: Optional[RenderedConfig] = None
    engine: Optional[str] = spec.engine
    for t in targets:
        r = rendered_by_target.get(t.ref)
        if r is None:
            continue
        if first is None:
            first, files, engine = r, r.files, r.engine
        elif r.files != files:
            t.state, t.apply, t.args_update, t.config_hash, t.unchanged = ERROR, None, None, None, False
            t.message = (f"{t.ref}: runs engine {r.engine}, other targets run {engine}; one policy configures one "
                         f"engine: set spec.engine or split the selector")
    if first is None and spec.engine:
        first = render(policy, enabled_tiers=on, bypassed_tiers=off, config_map_name=config_map_name(name))
        files = first.files
    if first is not None and first.live_control and files is not None:
        # The guard's decisions for every engine of the policy, read live (the fleet shares one ConfigMap).
        files = {**files, CONTROL_FILE: control_file_json(first.bypassed, control_generation(state))}
    config_map = config_map_body(policy_obj, files) if files is not None else None

    observed = Observed(states, on, engine, ws, _remote_budget(spec, on, ws, rendered_by_target),
                        measured=spec.slo is not None)
    status, events = _summarize(policy_obj, observed, targets, now)
    return Plan(config_map, targets, status, events, context=observed)


def _remote_budget(spec: api.KVCachePolicySpec, enabled: list[str], workloads: list[Workload],
                   rendered: dict[str, RenderedConfig]) -> Optional[int]:
    """The most the pods this policy configures may hold in the shared store. The runtime bounds each model's
    chunks by the tier's size, shared by the model's replicas (one index per model in the store), and a workload
    serves one model: the size once per workload the tier is rendered into."""
    tier = next((t for t in spec.tiers if t.medium == "remote" and t.name in enabled), None)
    if tier is None:
        return None
    return tier.size_bytes * sum(1 for w in workloads if w.ref in rendered)


# Refusals by the admin's trust settings (operator flags), not by the policy's own validity: an operator restarted
# without the allowlist entry that once admitted a tier must release what it applied under it.
TRUST_REASONS = ("HostPathNotAllowed", "PersistentVolumeClaimNotAllowed", "RemoteStoreNotAllowed", "SecretNotAllowed")


# Said in the conditions of every trust refusal, whether or not something was applied before: the same words on
# the pass that releases and on every later one (the message would otherwise change once the release is done).
TRUST_RELEASE_NOTE = ("; kvtier applies nothing under this policy and releases what it applied before (its volumes, "
                      "Secret projections and configuration)")


def revocation(policy_obj: dict[str, Any], spec: api.KVCachePolicySpec, workloads: list[Workload], reason: str,
               problems: str, now: str) -> Plan:
    """A trust refusal: nothing is applied, and every workload that carries this policy's configuration is released
    (the same release as a deleted policy's), with its owned ConfigMap. One Event says why and what was released;
    the next pass finds nothing left to release and posts none."""
    name = policy_obj["metadata"]["name"]
    why = problems + TRUST_RELEASE_NOTE
    what_fixes = "the policy is fixed or the admin allows it again"
    gone = [w for w in workloads if w.applied_by == name]
    if not gone:
        return refusal(policy_obj, reason, why, now, what_fixes)
    targets = [_release(w, spec, f"{w.ref}: released: {reason}") for w in gone]
    out = refusal(policy_obj, reason, why, now, what_fixes)
    out.targets = targets
    out.status["targets"] = []
    out.release_config_map = True
    released = f"released {bounded_refs([w.ref for w in gone])}: "
    out.events = [Event("Warning", reason, _short(released + problems, 1000))]
    return out


# kstatus' terminal condition (sigs.k8s.io/cli-utils, which Flux's health checks and `kubectl wait` tools read):
# True when nothing more happens until a person acts. Without it a refused policy reads as "in progress" to them
# (Ready False), so Flux waited its whole timeout and then reported a timeout instead of the refusal.
STALLED = "Stalled"


def refusal(policy_obj: dict[str, Any], reason: str, problems: str, now: str,
            what_fixes: str = "the policy is fixed") -> Plan:
    """A plan that writes nothing but status: Ready False and Degraded True with ``reason`` (Events follow from
    the transitions)."""
    generation, old = policy_obj["metadata"].get("generation"), policy_obj.get("status") or {}
    problems = _short(problems, 8192)
    conds = [Cond("Ready", "False", reason, problems), Cond("Degraded", "True", reason, problems),
             Cond("Progressing", "False", reason, f"nothing is applied until {what_fixes}"),
             Cond(STALLED, "True", reason, problems)]
    status = {"observedGeneration": generation,
              "conditions": merge_conditions(old.get("conditions") or [], conds, generation, now)}
    return Plan(None, [], status, _events(old.get("conditions") or [], status["conditions"], [], old), invalid=True)


def _summarize(policy_obj: dict[str, Any], observed: Observed, targets: list[TargetPlan],
               now: str) -> tuple[dict[str, Any], list[Event]]:
    meta, old = policy_obj["metadata"], policy_obj.get("status") or {}
    generation = meta.get("generation")
    selected = [t for t in targets if t.state != RELEASED]
    conds = _conditions(selected, observed.workloads, meta.get("namespace", ""))
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions") or [], conds, generation, now),
        "engine": observed.engine,
        "activeTiers": ",".join(observed.enabled_tiers) or "none",
        "tiers": observed.tier_states,
        "targets": [t.status() for t in selected],
        "remoteStoreBudgetBytes": observed.remote_budget_bytes,
    }
    if not observed.measured:
        # spec.slo removed: the guard's hit-ratio figures would otherwise stay in status forever.
        status.update({k: None for k in ("hitRatios", "deviceHitRatio") if k in old})
    return status, _events(old.get("conditions") or [], status["conditions"], targets, old)


def with_failures(result: Plan, policy_obj: dict[str, Any], failures: dict[str, str], now: str) -> Plan:
    """The plan after some writes were refused (e.g. a field another manager owns): those targets become
    errors with the server's words, and conditions and events are recomputed from that."""
    if not failures or result.context is None:
        return result
    for t in result.targets:
        if t.ref in failures:
            t.state, t.message, t.config_hash = ERROR, failures[t.ref], None
    status, events = _summarize(policy_obj, result.context, result.targets, now)
    return Plan(result.config_map, result.targets, status, events, context=result.context)


# Condition messages name at most this many targets, each message at most TARGET_MESSAGE_CHARS, plus counts:
# the CRD bounds a message (32 KiB), and a message joined over every target of a large policy outgrew it and
# was refused (422) on every retry.
MESSAGE_TARGETS = 5
TARGET_MESSAGE_CHARS = 512


def _short(text: str, limit: int = TARGET_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded_messages(chosen: list[TargetPlan]) -> str:
    """The first few targets' messages, then counts by state for the rest."""
    head = "; ".join(_short(t.message) for t in chosen[:MESSAGE_TARGETS])
    rest = chosen[MESSAGE_TARGETS:]
    if not rest:
        return head
    counts: dict[str, int] = {}
    for t in rest:
        counts[t.state] = counts.get(t.state, 0) + 1
    more = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"{head}; and {len(rest)} more ({more}; see status.targets)"


def bounded_refs(refs: list[str]) -> str:
    head = ", ".join(refs[:MESSAGE_TARGETS])
    return head if len(refs) <= MESSAGE_TARGETS else f"{head} and {len(refs) - MESSAGE_TARGETS} more"


def _conditions(targets: list[TargetPlan], workloads: list[Workload], namespace: str) -> list[Cond]:
    def msgs(states: set[str]) -> str:
        return bounded_messages([t for t in targets if t.state in states])

    by_ref = {w.ref: w for w in workloads}
    conflicts = [t for t in targets if t.state == CONFLICT]
    refused = [t for t in targets if t.state in (REFUSED, NOT_OPTED_IN)]
    errors = [t for t in targets if t.state == ERROR]
    missing = [t for t in targets if t.state == MISSING_ARG]
    applied = [t for t in targets if t.state == APPLIED]
    out: list[Cond] = []
    if not targets:
        out.append(Cond("Ready", "False", "NoTargets",
                        f"no Deployment or StatefulSet in namespace {namespace} matches spec.selector"))
    elif len(applied) == len(targets):
        out.append(Cond("Ready", "True", "Applied", f"applied to {len(applied)} workload(s): " + msgs({APPLIED})))
    else:
        first = (conflicts or refused or errors or missing)[0].state
        out.append(Cond("Ready", "False", first, msgs({CONFLICT, REFUSED, NOT_OPTED_IN, ERROR, MISSING_ARG})))
    if refused or errors or missing:
        reason = (refused or errors or missing)[0].state
        out.append(Cond("Degraded", "True", reason, msgs({REFUSED, NOT_OPTED_IN, ERROR, MISSING_ARG})))
    else:
        out.append(Cond("Degraded", "False", "AsExpected", ""))
    if conflicts:
        out.append(Cond("Conflict", "True", "SelectedByAnotherPolicy", msgs({CONFLICT})))
    else:
        out.append(Cond("Conflict", "False", "NoConflict", ""))
    # What waits for a person (an opt-in, the config argument, one policy per workload) and not for a retry.
    waits = [t for t in targets if t.state in (REFUSED, NOT_OPTED_IN, MISSING_ARG, CONFLICT)]
    if waits:
        out.append(Cond(STALLED, "True", waits[0].state, msgs({REFUSED, NOT_OPTED_IN, MISSING_ARG, CONFLICT})))
    else:
        out.append(Cond(STALLED, "False", "AsExpected", ""))
    rolling = []
    for t in targets:
        if t.config_hash is None:
            continue
        w = by_ref.get(t.ref)
        if w is None or w.config_hash != t.config_hash or not w.rolled_out():
            rolling.append(t.ref)
    if rolling:
        out.append(Cond("Progressing", "True", "RollingOut", "waiting for the new pod template on: " +
                        bounded_refs(rolling)))
    else:
        out.append(Cond("Progressing", "False", "RolledOut" if targets else "NoTargets", ""))
    return out


_BAD_WHEN_TRUE = {"Degraded", "Conflict"}


def _events(old_conds: list[dict[str, Any]], new_conds: list[dict[str, Any]], targets: list[TargetPlan],
            old_status: dict[str, Any]) -> list[Event]:
    """Events for user-visible transitions: Ready flips, problems appearing or clearing, new config hashes."""
    previous = {c.get("type"): c for c in old_conds}
    events: list[Event] = []
    for c in transitions(old_conds, new_conds):
        before = previous.get(c["type"])
        if c["type"] == "Ready":
            events.append(Event("Normal" if c["status"] == "True" else "Warning", c["reason"], c["message"]))
        elif c["type"] in _BAD_WHEN_TRUE and c["status"] == "True":
            events.append(Event("Warning", c["reason"], c["message"]))
        elif c["type"] in _BAD_WHEN_TRUE and before is not None and before.get("status") == "True":
            events.append(Event("Normal", "Resolved", f"{c['type']} cleared: {before.get('reason')}"))
    old_hashes = {(t.get("kind"), t.get("name")): t.get("configHash") for t in old_status.get("targets") or []}
    for t in targets:
        if t.config_hash and old_hashes.get((t.kind, t.name)) != t.config_hash:
            events.append(Event("Normal", "ConfigApplied", t.message))
        if t.state == RELEASED:
            events.append(Event("Normal", "Released", t.message))
    # A refusal turns Ready False and Degraded True with the same reason and message: one Event says it.
    return list(dict.fromkeys(events))


def release_plan(policy_obj: dict[str, Any], workloads: Iterable[dict[str, Any]]) -> list[TargetPlan]:
    """What deleting the policy undoes: every workload that carries its label is released."""
    name = policy_obj["metadata"]["name"]
    try:
        spec: Optional[api.KVCachePolicySpec] = parse_policy(policy_obj).spec
    except PolicyInvalid:
        spec = None
    return [_release(w, spec, f"policy {name} deleted")
            for w in _unique(workloads) if w.applied_by == name]


def prime() -> None:
    """Run one plan per engine on made-up objects, before the operator starts: the first real reconciles then do
    not pay for building validators, the CRD schema walk and first-call code paths (a cold operator that meets
    a burst of new policies would otherwise start behind)."""
    for image in ("vllm/vllm-openai", "nvcr.io/nvidia/tensorrt-llm/release"):
        policy = {"apiVersion": api.API_VERSION, "kind": api.KIND,
                  "metadata": {"name": "prime", "namespace": "prime", "uid": "prime", "generation": 1},
                  "spec": {"selector": {"matchLabels": {"app": "prime"}},
                           "tiers": [{"name": "cpu", "medium": "cpu", "size": "1Gi"}]}}
        workload = {"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "prime", "namespace": "prime", "labels": {"app": "prime"}},
                    "spec": {"template": {"spec": {"containers": [{"name": "engine", "image": image}]}}}}
        plan(policy, [workload], [], now="1970-01-01T00:00:00Z", server_validated=True)
