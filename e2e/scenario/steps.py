"""The scenario, step by step, against a prepared environment (``local.LocalEnvironment``).

Each step states what should happen, waits for it while printing the status table, and checks that the policy
status, the Events, the ConfigMap, the Deployment and the configuration the running pods loaded all agree.
Any disagreement or timeout raises ScenarioError; ``diagnostics()`` then says what the cluster looked like.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import yaml

from kvtier_operator.kube import MERGE, ApiError, policy_path, workload_path
from kvtier_operator.render import CONFIG_FILE
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, REENABLE_ANNOTATION
from . import manifests, observe
from .local import LocalEnvironment, LocalOptions
from .processes import ScenarioError, Supervisor, tail, wait_until
from .report import Reporter

STEPS = 7


@dataclass
class Timings:
    """Seconds, measured in this run."""

    setup: float = 0.0
    applied: float = 0.0          # policy created -> workload carries the config hash
    breach_to_disable: float = 0.0  # latency raised -> tier Disabled in status
    disable_to_rolled: float = 0.0  # tier Disabled -> pods running the re-rendered config
    recovery: float = 0.0          # latency restored -> sloState OK
    reenable: float = 0.0          # annotation set -> tier Enabled and pods on the full config
    total: float = 0.0


class Scenario:
    def __init__(self, env: LocalEnvironment, reporter: Reporter, *, timeout_scale: float = 1.0):
        self.env = env
        self.r = reporter
        self.names = env.o.names
        self.t0 = time.monotonic()
        self.scale = timeout_scale
        self.timings = Timings()
        self._seen_events: set[str] = set()
        self._pods_running = False
        self.last: Optional[observe.Snapshot] = None

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def kube(self):
        assert self.env.kube is not None
        return self.env.kube

    @property
    def kubelet(self):
        assert self.env.kubelet is not None
        return self.env.kubelet

    def snap(self) -> observe.Snapshot:
        pods = self.kubelet.loaded_configs() if self._pods_running else {}
        self.last = observe.snapshot(self.kube, self.names.namespace, self.names.policy, self.names.workload,
                                     time.monotonic() - self.t0, pods)
        return self.last

    def tick(self) -> None:
        """Between polls: keep pods on the current ReplicaSet (as a kubelet would), print changes."""
        self.env.check_alive()
        if self._pods_running:
            self.kubelet.sync()
        self.r.table(self.snap())
        self.print_events()

    def wait(self, what: str, predicate: Callable[[observe.Snapshot], Any], timeout: float) -> observe.Snapshot:
        def check() -> Any:
            s = self.snap()
            return s if predicate(s) else None
        s = wait_until(check, timeout * self.scale, what, interval=0.5, on_tick=self.tick)
        self.r.table(s)
        self.print_events()
        return s  # type: ignore[return-value]

    def events(self) -> list[dict[str, Any]]:
        items = self.kube.list(f"/api/v1/namespaces/{self.names.namespace}/events")
        return sorted(items, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                            e["metadata"]["name"]))

    def print_events(self) -> None:
        for e in self.events():
            if (e.get("involvedObject") or {}).get("kind") != "KVCachePolicy":
                continue
            key = f"{e['metadata']['name']}/{e.get('count', 1)}"
            if key in self._seen_events:
                continue
            self._seen_events.add(key)
            self.r.event(e.get("type", ""), e.get("reason", ""), e.get("message", ""))

    def user_patch(self, path: str, body: dict[str, Any]) -> None:
        self.kube.request("PATCH", path, query=[("fieldManager", manifests.USER_FIELD_MANAGER)], body=body,
                          content_type=MERGE)

    def agree(self, s: observe.Snapshot) -> bool:
        return not s.agreement()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------------------------------ the scenario
    def run(self) -> Timings:
        n = self.names
        self.r.step(1, STEPS, "Install", "A real kube-apiserver, etcd and kube-controller-manager on loopback, the "
                    "KVCachePolicy CRD,\na real Prometheus, and the kvtier operator as a process.")
        self.env.up()
        self.timings.setup = self.elapsed()

        self.r.step(2, STEPS, "Apply a workload and a policy",
                    f"Deployment {n.workload}: vLLM, whose args name the config file once "
                    "(--config /etc/kvtier/engine.yaml).\n"
                    f"KVCachePolicy {n.policy}: tiers {n.cpu_tier} (cpu, 4Gi) then {n.fs_tier} (filesystem "
                    f"{n.fs_path}),\nSLO p99 TTFT <= {manifests.TTFT_BUDGET} and ITL <= {manifests.ITL_BUDGET}, "
                    "checked every 2s over a 6s window; 3 breaches in a row roll back the newest tier.")
        assert self.env.prometheus is not None
        self.kube.apply(workload_path("Deployment", n.namespace, n.workload), manifests.deployment(n),
                        manager=manifests.USER_FIELD_MANAGER)
        self.r.note(f"applied Deployment {n.namespace}/{n.workload} (field manager {manifests.USER_FIELD_MANAGER})")
        applied_at = time.monotonic()
        self.kube.create(policy_path(n.namespace), manifests.policy(n, self.env.prometheus.url))
        self.env.supervisor.on_close(f"policy {n.policy}", self._delete_policy)  # runs before the operator stops
        self.r.note(f"created KVCachePolicy {n.namespace}/{n.policy}")

        self.r.step(3, STEPS, "The workload carries its rendered configuration",
                    "The operator renders vLLM's engine.yaml into a ConfigMap and applies, with server-side apply\n"
                    "under its own field manager, only what it injects: volumes, mounts, a config-hash annotation.")
        s = self.wait("the policy Ready and the Deployment carrying its config hash",
                      lambda s: s.ready and s.status_hash and s.workload_hash == s.status_hash
                      and s.rendered_tiers == [n.cpu_tier, n.fs_tier], 60)
        self.timings.applied = time.monotonic() - applied_at
        self.r.ok(f"Deployment annotated {CONFIG_HASH_ANNOTATION}={s.workload_hash} "
                  f"({self.timings.applied:.1f}s after the policy was created)")
        self.r.ok("ConfigMap kvtier-{}: {} -> {}".format(n.policy, CONFIG_FILE, _kv_summary(s.rendered)))
        mounts = ", ".join(f"{path} <- {vol}" for path, vol in sorted(s.workload_mounts.items()))
        self.r.ok(f"injected mounts: {mounts}")
        self._show_args(s)

        self.r.step(4, STEPS, "Pods start on the rendered configuration",
                    "No kubelet here: a stand-in runs the pod of the Deployment's current ReplicaSet as a synthetic\n"
                    "engine, fed /etc/kvtier/engine.yaml through the same mount (it refuses a config that does not "
                    "parse),\nserving vLLM's metrics at a healthy latency. Prometheus scrapes it; the SLO guard "
                    "reads Prometheus.")
        self.kubelet.sync()
        self._pods_running = True
        for pod in self.kubelet.pods:
            self.r.note(f"pod {pod.name} (ReplicaSet {pod.replica_set}) loaded {pod.config_path.name} "
                        f"-> {_kv_summary(pod.loaded_config())}")
        s = self.wait("SLO state OK with both tiers enabled",
                      lambda s: s.slo_state == "OK" and s.enabled_tiers == [n.cpu_tier, n.fs_tier] and self.agree(s),
                      60)
        self.r.ok("status, ConfigMap, Deployment and the running pod agree: tiers "
                  f"{'+'.join(s.enabled_tiers)}")

        self.r.step(5, STEPS, "Latency rises",
                    f"We make the engine slow (p99 TTFT ~{manifests.DEGRADED['ttft']:g}s, ITL "
                    f"~{manifests.DEGRADED['itl'] * 1000:.0f}ms), as contention on the newest tier might.\n"
                    f"Expected: 3 breaches in a row, then {n.fs_tier} (the newest enabled tier) is disabled, the "
                    "config re-rendered\nwithout it, and the pods roll onto it.")
        before_hash = s.workload_hash
        raised = time.monotonic()
        self.kubelet.set_knobs(**manifests.DEGRADED)
        s = self.wait(f"tier {n.fs_tier} Disabled in status.tiers",
                      lambda s: s.tier_states.get(n.fs_tier) == "Disabled", 90)
        disabled = time.monotonic()
        self.timings.breach_to_disable = disabled - raised
        self.r.ok(f"{n.fs_tier} Disabled {self.timings.breach_to_disable:.1f}s after the latency rose (p99 crosses "
                  "as soon as 1% of the window's requests are slow;\n         then 3 evaluations 2s apart: 4-8s, "
                  "at most window 6s + 3 x 2s + 1s scrape)")
        s = self.wait("the re-rendered config on the workload and in the running pod",
                      lambda s: self.agree(s) and s.workload_hash != before_hash
                      and s.enabled_tiers == [n.cpu_tier], 60)
        self.timings.disable_to_rolled = time.monotonic() - disabled
        self._check_rollback_recorded(s)
        self.r.ok(f"status.tiers, the Warning Event, status.history, the ConfigMap ({'+'.join(s.rendered_tiers)}), "
                  f"the Deployment (hash {before_hash} -> {s.workload_hash}) and the pod agree")

        self.r.step(6, STEPS, "Latency recovers",
                    "The contention is gone (we restore the engine's latency). Within the guard's cooldown nothing "
                    "else is\nrolled back; the 6s window soon measures healthy p99s again.")
        recovered = time.monotonic()
        self.kubelet.set_knobs(**{k: manifests.HEALTHY[k] for k in manifests.DEGRADED})
        s = self.wait("SLO state OK", lambda s: s.slo_state == "OK"
                      and (s.slo_last.get("ttftP99") or 1e9) <= 0.5, 60)
        self.timings.recovery = time.monotonic() - recovered
        self.r.ok(f"SLO OK again after {self.timings.recovery:.1f}s; {n.fs_tier} stays off until a person "
                  "re-enables it (reenable mode manual)")

        self.r.step(7, STEPS, f"Re-enable {n.fs_tier}",
                    f"A person annotates the policy: kubectl annotate kvcachepolicy {n.policy} "
                    f"{REENABLE_ANNOTATION}={n.fs_tier}\nThe guard re-enables the tier at its next evaluation, "
                    "removes the annotation, and the pods roll back onto the full config.")
        hash_without = s.workload_hash
        asked = time.monotonic()
        self.user_patch(policy_path(n.namespace, n.policy),
                        {"metadata": {"annotations": {REENABLE_ANNOTATION: n.fs_tier}}})
        s = self.wait(f"tier {n.fs_tier} Enabled and every part agreeing",
                      lambda s: s.enabled_tiers == [n.cpu_tier, n.fs_tier] and self.agree(s)
                      and s.workload_hash != hash_without
                      and REENABLE_ANNOTATION not in ((s.policy or {})["metadata"].get("annotations") or {}), 60)
        self.timings.reenable = time.monotonic() - asked
        self.r.ok(f"{n.fs_tier} is back {self.timings.reenable:.1f}s after the annotation: ConfigMap, Deployment "
                  f"(hash {s.workload_hash}) and pod carry {'+'.join(s.enabled_tiers)}; the annotation was consumed")
        if s.workload_hash == before_hash:
            self.r.ok("the config hash is the original one again: same configuration, same ReplicaSet")
        self.timings.total = self.elapsed()
        return self.timings

    # ------------------------------------------------------------------------------------------ checks
    def _show_args(self, s: observe.Snapshot) -> None:
        containers = (((s.workload or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get(
            "containers") or []
        for c in containers:
            self.r.ok(f"container {c['name']} args untouched: {' '.join(c.get('args') or [])}")

    def _check_rollback_recorded(self, s: observe.Snapshot) -> None:
        n = self.names
        warnings = [e for e in self.events() if e.get("type") == "Warning" and e.get("reason") == "TierDisabled"
                    and (e.get("involvedObject") or {}).get("name") == n.policy]
        if not warnings or n.fs_tier not in warnings[-1].get("message", ""):
            raise ScenarioError(f"no Warning Event TierDisabled naming {n.fs_tier}; events: "
                                f"{[(e.get('type'), e.get('reason'), e.get('message')) for e in self.events()]}")
        history = [h for h in s.status.get("history") or [] if h.get("action") == "Disabled"
                   and h.get("tier") == n.fs_tier]
        if not history:
            raise ScenarioError(f"status.history has no Disabled entry for {n.fs_tier}: {s.status.get('history')}")
        h = history[-1]
        if h.get("value") is None or h.get("threshold") is None or not h["value"] > h["threshold"]:
            raise ScenarioError(f"status.history entry does not show a value over its threshold: {h}")
        self.r.ok(f"status.history: {h['tier']} {h['action']} at {h['time']}: {h.get('metric')} "
                  f"{h['value']:.3g}s > {h['threshold']:.3g}s")

    def _delete_policy(self) -> None:
        """Delete the policy while the operator still runs, so its finalizer releases the workload."""
        n = self.names
        if not self.kube.delete(policy_path(n.namespace, n.policy)):
            return
        deadline = time.monotonic() + 20
        while self.kube.get(policy_path(n.namespace, n.policy)) is not None and time.monotonic() < deadline:
            time.sleep(0.2)

    # ------------------------------------------------------------------------------------------ on failure
    def diagnostics(self) -> str:
        """Operator log, events, policy status, Prometheus targets and pod logs, for a failed run."""
        out = [f"== operator log (last 80 lines of {self.env.operator_log})", tail(self.env.operator_log, 80)]
        try:
            out.append("== events")
            for e in self.events():
                io = e.get("involvedObject") or {}
                out.append(f"{e.get('type')} {e.get('reason')} {io.get('kind')}/{io.get('name')}: {e.get('message')}")
            pol = self.kube.get(policy_path(self.names.namespace, self.names.policy))
            out += ["== policy status", yaml.safe_dump((pol or {}).get("status"), sort_keys=False)]
            out += ["== policy annotations", json.dumps(((pol or {}).get("metadata") or {}).get("annotations"))]
        except (ApiError, OSError) as err:
            out.append(f"(API server unreachable: {err})")
        if self.last is not None:
            out += ["== last snapshot disagreements", "\n".join(self.last.agreement()) or "(none)"]
        if self.env.prometheus is not None:
            out += ["== prometheus targets (pod -> up)", json.dumps(self.env.prometheus.scraped_pods())]
        if self.env.kubelet is not None:
            for pod in self.env.kubelet.pods + self.env.kubelet.retired[-2:]:
                out += [f"== pod {pod.name} log", tail(pod.process.log_path, 15)]
        return "\n".join(out)


def _kv_summary(config: Optional[dict[str, Any]]) -> str:
    """One line for an engine config: the connector and its tiers."""
    if not config:
        return "(empty)"
    kv = config.get("kv-transfer-config") or config.get("kv_transfer_config")
    if isinstance(kv, str):
        kv = json.loads(kv)
    if not isinstance(kv, dict):
        return f"{len(config)} keys, no kv-transfer-config (GPU only)"
    extra = kv.get("kv_connector_extra_config") or {}
    parts = [f"{kv.get('kv_connector')}/{extra.get('spec_name', '?')}"]
    if extra.get("cpu_bytes_to_use"):
        parts.append(f"cpu {int(extra['cpu_bytes_to_use']) / 2**30:g}GiB")
    for t in extra.get("secondary_tiers") or []:
        parts.append(f"{t.get('type')} {t.get('root_dir', '')}".strip())
    return ", ".join(parts)


class ScenarioFailed(ScenarioError):
    """The scenario failed; ``diagnostics`` holds what the cluster looked like at that moment."""

    def __init__(self, message: str, diagnostics: str):
        super().__init__(message)
        self.diagnostics = diagnostics


def run_local(options: LocalOptions, reporter: Reporter, supervisor: Optional["Supervisor"] = None) -> Timings:
    """Set up the local provider, run the scenario, and stop everything it started (also on Ctrl-C)."""
    supervisor = supervisor or Supervisor()
    env = LocalEnvironment(options, supervisor, reporter.note)
    scenario = Scenario(env, reporter)
    try:
        return scenario.run()
    except Exception as err:  # noqa: BLE001 - any failure: gather diagnostics while everything still runs
        diagnostics = scenario.diagnostics()
        (options.workdir / "failure.txt").write_text(f"{type(err).__name__}: {err}\n\n{diagnostics}\n")
        raise ScenarioFailed(f"{type(err).__name__}: {err}", diagnostics) from err
    finally:
        supervisor.close()
        if supervisor.errors:
            reporter.warn("clean-up problems: " + "; ".join(supervisor.errors))
