"""The scenario, step by step, against a prepared environment (``local.LocalEnvironment``).

Each step states what should happen, waits for it while printing the status table, and checks that the policy
status, the Events, the ConfigMap, the Deployment and the configuration the running pods loaded all agree.
Any disagreement or timeout raises ScenarioError; ``diagnostics()`` then says what the cluster looked like.
"""
from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import yaml
from kvtier_operator.api.units import parse_duration
from kvtier_operator.kube import MERGE, ApiError, policy_path, workload_path
from kvtier_operator.render import CONFIG_FILE, CONTROL_FILE
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, REENABLE_ANNOTATION

from . import manifests, observe
from .load import p99_back_under
from .local import LocalEnvironment, LocalOptions
from .pods import restarts_since
from .processes import ScenarioError, Supervisor, tail, wait_until
from .report import Reporter

STEPS = 7
# The real engine's run (seconds, requests): short, so `make demo` stays well under 10 minutes.
LOAD_REQUESTS = 400
LOAD_MAX_BLOCKS = 8
LOAD_RATE = 2.0
WARMUP_S = 15
HEALTHY_S = 40
SLOWED_TIMEOUT_S = 180
ROLL_TIMEOUT_S = 480
RECOVER_S = 20
# What the demo asks the trained model (SmolLM2-135M-Instruct) once its pod serves, and again after a minute of
# load through a device cache far smaller than the load's prompts (its KV by then reloaded or recomputed): the
# answer must be the same text.
QUESTION = "What is the capital of France? Answer in one sentence."


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
    # Real engine only.
    engine_start: list = None  # type: ignore[assignment]  # seconds to a healthy vllm serve, per pod
    breach_bound: float = 0.0       # the guard's own bound for breach -> Disabled
    breaker: Optional[float] = None  # slowdown -> the engine's breaker bypassing the tier (None: it did not open)
    control_delivered: float = 0.0  # tier Disabled in status -> the control file in the pod's volume
    reenable_delivered: float = 0.0  # tier Enabled in status -> the control file in the pod's volume
    p99_recovered: float = 0.0      # slowdown -> client-side p99 over the guard's window under the budget again
    engine_restarts: int = 0        # pods replaced or containers restarted during the rollback and re-enable
    first_breach_to_disable: float = 0.0  # first breaching evaluation seen -> tier Disabled
    ttft: dict = None  # type: ignore[assignment]  # phase -> PhaseStats (client-measured)
    budget: float = 0.0


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
    def pods(self):
        assert self.env.pods is not None
        return self.env.pods

    def snap(self) -> observe.Snapshot:
        pods = self.pods.loaded_configs() if self._pods_running else {}
        engine = self.engine_from_prometheus() if self.env.o.real and self._pods_running else {}
        self.last = observe.snapshot(self.kube, self.names.namespace, self.names.policy, self.names.workload,
                                     time.monotonic() - self.t0, pods, engine)
        return self.last

    def engine_from_prometheus(self) -> dict[str, Any]:
        assert self.env.prometheus is not None
        out: dict[str, Any] = {}
        for key, q in observe.engine_queries(self.names.namespace, manifests.REAL_SLO["window"]).items():
            try:
                result = self.env.prometheus.query(q)
                out[key] = float(result[0]["value"][1]) if result else None
            except (OSError, KeyError, ValueError, IndexError):
                out[key] = None
        return out

    def pod_metrics(self) -> dict[str, float]:
        """The serving pod's offload counters, read from the engine itself (exact, for the checks)."""
        from vllm_cpu.server import parse_metrics

        pods = self.pods.pods
        if not pods:
            return {}
        req = urllib.request.Request(pods[0].url + "/metrics", headers={"Accept": "text/plain;version=0.0.4"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                samples = parse_metrics(r.read().decode())
        except OSError:
            return {}

        def total(name: str, **labels: str) -> float:
            want = set(labels.items())
            return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
        return {
            "stored_bytes": total("vllm:kv_offload_store_bytes_total"),
            "loaded_bytes": total("vllm:kv_offload_load_bytes_total"),
            "load_time": total("vllm:kv_offload_load_time_total"),
            "fs_stores": total("vllm:kv_offload_kvtier_fs_stores_total"),
            "promotions": total("vllm:kv_offload_kvtier_promotions_total"),
            "cached_device": total("vllm:prompt_tokens_cached_by_source_total", source="device"),
            "cached_host": total("vllm:prompt_tokens_cached_by_source_total", source="host"),
            "cached_disk": total("vllm:prompt_tokens_cached_by_source_total", source="disk"),
            # The newest tier's bypass, by reason (docs/breaker.md): the breaker's verdict, the control file's.
            "bypassed_slow": total("vllm:kv_offload_kvtier_tier_bypassed", tier=self.names.fs_tier, reason="slow"),
            "bypassed_disabled": total("vllm:kv_offload_kvtier_tier_bypassed", tier=self.names.fs_tier,
                                       reason="disabled"),
        }

    def tick(self) -> None:
        """Between polls: follow the pods the kubelet runs (targets, knobs, the slow device's throttle on new
        containers; a crashed container fails here), print changes."""
        self.env.check_alive()
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
        if self.env.o.real:
            return self.run_real()
        n = self.names
        self.r.step(1, STEPS, "Install", "A real kube-apiserver, etcd and kube-controller-manager on loopback, a "
                    "node (containerd, runc, kubelet),\nkvtier's images loaded into it, the KVCachePolicy CRD, a real "
                    "Prometheus, and the kvtier operator as a pod, installed by its chart.")
        self.env.up()
        self.timings.setup = self.elapsed()

        self.r.step(2, STEPS, "Apply a workload and a policy",
                    f"Deployment {n.workload}: a synthetic engine serving vLLM's metrics, whose args name the config "
                    "file once\n(--config /etc/kvtier/engine.yaml), from the operator image.\n"
                    f"KVCachePolicy {n.policy}: tiers {n.cpu_tier} (cpu, 4Gi) then {n.fs_tier} (filesystem "
                    f"{n.fs_path}),\nSLO p99 TTFT <= {manifests.TTFT_BUDGET} and ITL <= {manifests.ITL_BUDGET}, "
                    "checked every 2s over a 6s window; 3 breaches in a row roll back the newest tier.")
        assert self.env.prometheus is not None
        self.kube.apply(workload_path("Deployment", n.namespace, n.workload),
                        manifests.synthetic_deployment(n, self.env.images["operator"], manifests.HEALTHY),
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
        self.r.ok(f"ConfigMap kvtier-{n.policy}: {CONFIG_FILE} -> {_kv_summary(s.rendered)}")
        mounts = ", ".join(f"{path} <- {vol}" for path, vol in sorted(s.workload_mounts.items()))
        self.r.ok(f"injected mounts: {mounts}")
        self._show_args(s)

        self.r.step(4, STEPS, "Pods start on the rendered configuration",
                    "The node's kubelet runs the pod of the Deployment's current ReplicaSet: the synthetic engine reads\n"
                    "/etc/kvtier/engine.yaml from the ConfigMap volume the operator mounted (it refuses a config that "
                    "does not parse),\nand serves vLLM's metrics at a healthy latency. Prometheus scrapes it at its pod "
                    "IP; the SLO guard reads Prometheus.")
        self.user_patch(workload_path("Deployment", n.namespace, n.workload), manifests.scale_up())
        self.r.note(f"scaled Deployment {n.workload} to 1 replica (it was applied with none, so that no pod starts "
                    "before its config is mounted)")
        self.pods.wait_ready(90)
        self._pods_running = True
        for pod in self.pods.pods:
            self.r.note(f"pod {pod.name} (ReplicaSet {pod.replica_set}, {pod.ip}) loaded /etc/kvtier/engine.yaml "
                        f"-> {_kv_summary(self.pods.loaded_config(pod))}")
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
        self.pods.set_knobs(**manifests.DEGRADED)
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
        self.r.ok(f"status.tiers, the Warning Event, status.slo.history, the ConfigMap ({'+'.join(s.rendered_tiers)}), "
                  f"the Deployment (hash {before_hash} -> {s.workload_hash}) and the pod agree")

        self.r.step(6, STEPS, "Latency recovers",
                    "The contention is gone (we restore the engine's latency). Within the guard's cooldown nothing "
                    "else is\nrolled back; the 6s window soon measures healthy p99s again.")
        recovered = time.monotonic()
        self.pods.set_knobs(**{k: manifests.HEALTHY[k] for k in manifests.DEGRADED})
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

    # ------------------------------------------------------------------------------------------ the real engine
    def _hold(self, what: str, seconds: float) -> observe.Snapshot:
        until = time.monotonic() + seconds
        return self.wait(what, lambda s: time.monotonic() >= until, seconds + 60)

    def run_real(self) -> Timings:
        """The scenario on real engines: vllm serve with kvtier's offloading spec, the filesystem tier on a device
        that really becomes slow, the load a trace replay. Fails loudly if nothing was offloaded or if the breach
        did not come from the slowed tier."""
        from .load import TraceLoad, trace_prompts

        n, total = self.names, 7
        self.timings.engine_start, self.timings.ttft = [], {}
        self.r.step(1, total, "Install", "A real kube-apiserver, etcd and kube-controller-manager on loopback, a node "
                    "(containerd, runc, kubelet)\nwith the engine image (vllm-cpu + kvtier) loaded, the KVCachePolicy "
                    "CRD, a real Prometheus, the kvtier operator as a pod (its chart),\nthe model, and the block device the "
                    "filesystem tier will live on.")
        self.env.up()
        self.timings.setup = self.elapsed()
        disk = self.env.disk
        assert disk is not None and self.env.prometheus is not None
        trace = self.env.o.trace or self.env.o.repo / "tests" / "data" / "mooncake-synthetic.jsonl"
        if not trace.is_file():
            raise ScenarioError(f"the load replays {trace}, which does not exist (pass --trace FILE, a Mooncake-format "
                                "JSONL trace)")
        prompts = trace_prompts(trace, limit=LOAD_REQUESTS, max_blocks=LOAD_MAX_BLOCKS, corpus=self.env.corpus)
        self.r.note(f"load: {len(prompts)} prefix-sharing requests replayed from {trace.name} ({LOAD_MAX_BLOCKS} "
                    "blocks of 32 tokens at most each), one at a time")

        self.r.step(2, total, "Apply a workload and a policy",
                    f"Deployment {n.workload}: vllm serve from the engine image, whose args name the config file "
                    "once (--config /etc/kvtier/engine.yaml).\n"
                    f"KVCachePolicy {n.policy}: backend kvtier, tiers {n.cpu_tier} (cpu {manifests.REAL_HOST_SIZE}) "
                    f"then {n.fs_tier} (filesystem {n.fs_path}, {manifests.REAL_FS_SIZE}), SLO on p99 TTFT\n"
                    f"every {manifests.REAL_SLO['interval']} over {manifests.REAL_SLO['window']}; "
                    f"{manifests.REAL_SLO['consecutiveBreaches']} breaches in a row roll back the newest tier.")
        assert self.env.model_dir is not None
        self.kube.apply(workload_path("Deployment", n.namespace, n.workload),
                        manifests.vllm_deployment(n, self.env.images["engine"], str(self.env.model_dir)),
                        manager=manifests.USER_FIELD_MANAGER)
        self.kube.create(policy_path(n.namespace), manifests.real_policy(n, self.env.prometheus.url,
                                                                         self.env.fs_host_path))
        self.env.supervisor.on_close(f"policy {n.policy}", self._delete_policy)
        self.r.note(f"applied Deployment {n.namespace}/{n.workload} and KVCachePolicy {n.namespace}/{n.policy}")

        self.r.step(3, total, "The workload carries its rendered configuration",
                    "The operator renders vLLM's engine.yaml (kvtier's offloading spec) into a ConfigMap and injects "
                    "only volumes, mounts\nand a config-hash annotation into the Deployment.")
        s = self.wait("the policy Ready and the Deployment carrying its config hash",
                      lambda s: s.ready and s.status_hash and s.workload_hash == s.status_hash
                      and s.rendered_tiers == [n.cpu_tier, n.fs_tier], 60)
        self.r.ok(f"ConfigMap kvtier-{n.policy}: {CONFIG_FILE} -> {_kv_summary(s.rendered)}")
        self._show_args(s)

        self.r.step(4, total, "A real engine serves, offloading to both tiers",
                    "The node's kubelet runs the pod: `vllm serve` (vllm-cpu) from the engine image on the mounted "
                    f"engine.yaml; the {n.fs_tier} volume\nis a hostPath on the slow device. Prometheus scrapes the "
                    "engine at its pod IP; the load replays the trace. TTFT is measured healthy,\nthen the SLO budget "
                    "is set from it.")
        self.user_patch(workload_path("Deployment", n.namespace, n.workload), manifests.scale_up())
        self.r.note(f"scaled Deployment {n.workload} to 1 replica (it was applied with none, so that no pod starts "
                    "before its config is mounted)")
        self._pods_running = True
        self.pods.wait_ready(ROLL_TIMEOUT_S * self.scale, on_tick=self.tick)
        self.timings.engine_start.append(self.pods.pods[0].start_seconds)
        answer = self._ask(QUESTION)
        # Asked twice: the second answer is served with the question's prefix in vLLM's own cache, as a reload
        # from a tier is (in bfloat16 a cold prefill may round differently: docs/engines.md).
        reference = self._ask(QUESTION)
        self.r.ok(f'asked the model: "{QUESTION}" -> "{answer}"')
        load = TraceLoad(prompts, url=lambda: self.pods.pods[0].url if self.pods.pods else None,
                         rate=LOAD_RATE)
        self.env.supervisor.on_close("load", load.stop)  # runs before the pods stop
        load.set_phase("warm-up")
        load.start()
        s = self.wait("SLO state OK with both tiers enabled, every part agreeing",
                      lambda s: s.slo_state == "OK" and s.enabled_tiers == [n.cpu_tier, n.fs_tier] and self.agree(s),
                      180)
        self._hold("a warm-up under load", WARMUP_S)
        load.set_phase("healthy")
        m0 = self.pod_metrics()
        self._hold("a healthy measurement", HEALTHY_S)
        m1 = self.pod_metrics()
        if not m1 or m1["stored_bytes"] <= 0 or m1["fs_stores"] <= 0:
            raise ScenarioError(f"the engine's offload counters stayed at zero: nothing was offloaded (kv_offload "
                                f"store bytes {m1.get('stored_bytes')}, kvtier fs stores {m1.get('fs_stores')}); "
                                "the tiers are not in use, so nothing below would mean anything")
        healthy = load.summary("healthy")
        if not healthy.n:
            raise ScenarioError("no request completed during the healthy measurement")
        self.timings.ttft["healthy"] = healthy
        self.r.ok(f"offloading: {m1['stored_bytes'] / 2**20:.0f} MiB stored ({m1['fs_stores']:.0f} blocks written "
                  f"to {n.fs_tier}), disk-cached tokens +{m1['cached_disk'] - m0.get('cached_disk', 0):.0f} and "
                  f"host +{m1['cached_host'] - m0.get('cached_host', 0):.0f} during the measurement")
        budget = manifests.real_budget(healthy.p99 or 0)
        self.timings.budget = budget
        self.user_patch(policy_path(n.namespace, n.policy), {"spec": {"slo": {"ttftP99": f"{int(budget * 1000)}ms"}}})
        self.r.ok(f"TTFT healthy ({healthy}); SLO budget set to {budget:.1f}s (the first TTFT bucket bound over "
                  f"{manifests.REAL_BUDGET_FACTOR:g} x the healthy p99 measured here, + 0.1 s)")
        again = self._ask(QUESTION)
        if again != reference:
            raise ScenarioError(f'asked again after the load, the model answered "{again}", not "{reference}": '
                                "the KV it reloaded is not the KV it stored")
        self.r.ok(f'asked again after {load.summary("healthy").n + load.summary("warm-up").n} requests of load: the '
                  f'same answer, "{again}"')

        self.r.step(5, total, f"The {n.fs_tier} tier's device becomes slow",
                    f"{disk.describe()}\nMechanism {disk.mechanism}: {disk.why}.\n"
                    f"Expected: loads from {n.fs_tier} cost more than recomputing; the engine's breaker bypasses it "
                    "within seconds;\np99 TTFT breaches, the guard disables "
                    f"{n.fs_tier} and its decision reaches the running engine through the control file\n"
                    "(a key of the policy's ConfigMap the kubelet refreshes in place): no new configuration, no "
                    "restart.")
        before_hash = s.workload_hash  # the config with both tiers, before anything is slow
        engine_before = self.pods.restarts()
        m_slow0 = self.pod_metrics()
        reads0 = disk.reads_served()
        slowed_at = time.monotonic()
        disk.slow()
        load.set_phase("slowed")
        seen: dict[str, Any] = {"m": m_slow0, "first_breach": None, "breaker": None}

        def watch_breaker() -> None:
            m = self.pod_metrics()
            if m:
                seen["m"] = m
                if seen["breaker"] is None and m.get("bypassed_slow", 0) >= 1:
                    seen["breaker"] = time.monotonic()

        def disabled(s: observe.Snapshot) -> bool:
            watch_breaker()
            if s.tier_states.get(n.fs_tier) == "Disabled":
                return True
            if s.breaches >= 1 and seen["first_breach"] is None:
                seen["first_breach"] = time.monotonic()
            return False
        s = self.wait(f"tier {n.fs_tier} Disabled in status.tiers", disabled, SLOWED_TIMEOUT_S)
        disabled_at = time.monotonic()
        reads = (disk.reads_served() or 0) - (reads0 or 0) if reads0 is not None else None
        self.timings.breach_to_disable = disabled_at - slowed_at
        # The breach starts when the first request over the budget completes (its TTFT enters the histogram).
        over = [x.at for x in list(load.samples) if x.phase == "slowed" and x.ttft is not None and x.ttft > budget]
        self.timings.first_breach_to_disable = disabled_at - (min(over) if over else seen["first_breach"] or slowed_at)
        self.timings.breach_bound = manifests.slo_bound_seconds()
        self._check_breach_from_tier(m0, m1, m_slow0, seen["m"], reads)
        within = "within" if self.timings.first_breach_to_disable <= self.timings.breach_bound else "OVER"
        if seen["breaker"] is not None:
            self.timings.breaker = seen["breaker"] - slowed_at
            self.r.ok(f"the engine's breaker bypassed {n.fs_tier} {self.timings.breaker:.1f}s after the device became "
                      "slow (vllm:kv_offload_kvtier_tier_bypassed{reason=\"slow\"} = 1)")
        else:
            self.r.note(f"the engine's breaker did not open before the guard acted ({n.fs_tier}'s loads never cost "
                        f"{manifests.REAL_RECOMPUTE_TOKENS_PER_S} tokens/s x 1.5 over its window)")
        self.r.ok(f"{n.fs_tier} Disabled {self.timings.breach_to_disable:.1f}s after the device became slow, "
                  f"{self.timings.first_breach_to_disable:.1f}s after the first request over the budget: {within} the "
                  f"bound window + {manifests.REAL_SLO['consecutiveBreaches']} x interval + scrape = "
                  f"{self.timings.breach_bound:.0f}s")
        self._check_rollback_recorded(s)
        s = self.wait(f"the ConfigMap's control file disabling {n.fs_tier}, every part agreeing",
                      lambda s: self.agree(s) and s.bypassed_tiers == [n.fs_tier], 30)
        if s.workload_hash != before_hash:
            raise ScenarioError(f"the rollback changed the workload's config hash ({before_hash} -> "
                                f"{s.workload_hash}): the pods roll instead of bypassing {n.fs_tier} live")
        delivered = self._wait_live(f"the kubelet delivering the control file and the engine bypassing {n.fs_tier} "
                                    "for it", n.fs_tier, disabled=True, timeout=ROLL_TIMEOUT_S)
        self.timings.control_delivered = delivered["file"] - disabled_at
        self.timings.disable_to_rolled = delivered["engine"] - disabled_at
        self.r.ok(f"control file in the pod's volume {self.timings.control_delivered:.1f}s after the guard's "
                  f"decision, the engine bypassing {n.fs_tier} for it after {self.timings.disable_to_rolled:.1f}s "
                  f"(reason disabled); config hash still {before_hash}")
        if self._restarts(engine_before):
            raise ScenarioError(f"the engine restarted during the rollback: pods before {engine_before}, now "
                                f"{self.pods.restarts()} (name: (uid, container restarts))")

        self.r.step(6, total, "TTFT recovers", f"Same load, same slow device, same engine process; {n.fs_tier} is "
                    "bypassed. The guard's window soon measures healthy p99s again.")
        load.set_phase("rolled back")
        recovered_at = time.monotonic()
        self._hold("a measurement on the engine bypassing the tier", RECOVER_S)
        s = self.wait("SLO state OK", lambda s: s.slo_state == "OK", 120)
        self.timings.recovery = time.monotonic() - recovered_at
        rolled = load.summary("rolled back")
        self.timings.ttft["slowed"] = load.summary("slowed")
        self.timings.ttft["rolled back"] = rolled
        if not rolled.n or (rolled.p99 or 0) > budget:
            raise ScenarioError(f"TTFT did not recover after the rollback: {rolled}, budget {budget:.1f}s")
        window = parse_duration(manifests.REAL_SLO["window"])
        back = p99_back_under(list(load.samples), slowed_at, budget, window)
        if back is None:
            raise ScenarioError(f"the client-side p99 over {window:.0f}s windows never came back under the budget "
                                f"{budget:.1f}s after the slowdown")
        self.timings.p99_recovered = back
        self.r.ok(f"SLO OK again on the same engine; {n.fs_tier} stays bypassed until a person re-enables it")

        self.r.step(7, total, f"Re-enable {n.fs_tier}, live",
                    f"The device is healthy again; a person annotates the policy: kubectl annotate kvcachepolicy "
                    f"{n.policy} {REENABLE_ANNOTATION}={n.fs_tier}\nThe guard re-enables the tier at its next "
                    "evaluation; the control file drops it and the engine probes it back, without a restart.")
        disk.heal()
        load.set_phase("re-enabled")
        m_back0 = self.pod_metrics()
        asked = time.monotonic()
        self.user_patch(policy_path(n.namespace, n.policy),
                        {"metadata": {"annotations": {REENABLE_ANNOTATION: n.fs_tier}}})
        s = self.wait(f"tier {n.fs_tier} Enabled, the control file empty, every part agreeing",
                      lambda s: s.enabled_tiers == [n.cpu_tier, n.fs_tier] and self.agree(s)
                      and not s.bypassed_tiers
                      and REENABLE_ANNOTATION not in ((s.policy or {})["metadata"].get("annotations") or {}), 60)
        enabled_at = time.monotonic()
        if s.workload_hash != before_hash:
            raise ScenarioError(f"the re-enable changed the workload's config hash ({before_hash} -> "
                                f"{s.workload_hash}): the pods roll instead of resuming {n.fs_tier} live")
        back_on = self._wait_live(f"the engine loading from {n.fs_tier} again", n.fs_tier, disabled=False,
                                  timeout=ROLL_TIMEOUT_S, since=m_back0)
        self.timings.reenable = back_on["engine"] - asked
        self.timings.engine_restarts = self._restarts(engine_before)
        load.stop()
        self.timings.reenable_delivered = back_on["file"] - enabled_at
        self.r.ok(f"{n.fs_tier} serves again {self.timings.reenable:.1f}s after the annotation (Enabled in status "
                  f"after {enabled_at - asked:.1f}s, the control file in the pod's volume "
                  f"{self.timings.reenable_delivered:.1f}s later); same pod, no restart, config hash {before_hash}")
        self.r.note("")
        self.r.note("Measured in this run (client-side TTFT, vllm serve on vllm-cpu):")
        for phase in ("healthy", "slowed", "rolled back"):
            self.r.note(f"  {self.timings.ttft[phase]}")
        breaker = "-" if self.timings.breaker is None else f"{self.timings.breaker:.1f}s"
        self.r.note(f"  slowdown -> breaker bypass {breaker}, -> {n.fs_tier} disabled by the guard "
                    f"{self.timings.breach_to_disable:.1f}s ({self.timings.first_breach_to_disable:.1f}s after the "
                    f"first request over the budget, bound {self.timings.breach_bound:.0f}s); disabled -> control "
                    f"file in the pod {self.timings.control_delivered:.1f}s, -> engine bypassing for it "
                    f"{self.timings.disable_to_rolled:.1f}s; re-enable -> serving from {n.fs_tier} "
                    f"{self.timings.reenable:.1f}s")
        self.r.note(f"slowdown -> p99 under the budget again: {self.timings.p99_recovered:.0f} s, engine restarts: "
                    f"{self.timings.engine_restarts}")
        if self.timings.engine_restarts:
            raise ScenarioError(f"the engine restarted {self.timings.engine_restarts} time(s) during the rollback "
                                f"and the re-enable: pods before {engine_before}, now {self.pods.restarts()}")
        self.timings.total = self.elapsed()
        return self.timings

    def _wait_live(self, what: str, tier: str, *, disabled: bool, timeout: float,
                   since: Optional[dict] = None) -> dict[str, float]:
        """Wait until every pod's kubelet-delivered control file says ``tier`` is (not) disabled and the engine acts
        on it: bypassing it for that reason, or (``disabled`` False) no longer bypassing it and loading from it
        again (prompt tokens from disk grew since ``since``). Returns when each was first seen."""
        at: dict[str, float] = {}

        def check(s: observe.Snapshot) -> bool:
            files = [self.pods.loaded_control(p, CONTROL_FILE) for p in self.pods.pods]
            if "file" not in at and files and all((tier in observe.control_tiers(f)) == disabled for f in files):
                at["file"] = time.monotonic()
            m = self.pod_metrics()
            if "file" in at and m and (
                    (disabled and m.get("bypassed_disabled", 0) >= 1)
                    or (not disabled and m.get("bypassed_slow", 0) + m.get("bypassed_disabled", 0) == 0
                        and m.get("cached_disk", 0) > (since or {}).get("cached_disk", 0))):
                at["engine"] = time.monotonic()
            return "engine" in at
        self.wait(what, check, timeout)
        return at

    def _ask(self, question: str) -> str:
        """The serving pod's greedy answer to one user message (the model's chat template)."""
        body = {"model": "model", "messages": [{"role": "user", "content": question}], "max_tokens": 48,
                "temperature": 0.0}
        req = urllib.request.Request(self.pods.pods[0].url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]

    def _restarts(self, before: dict[str, tuple[str, int]]) -> int:
        """Engine restarts since ``before``, from the API server (pods.restarts_since)."""
        return restarts_since(before, self.pods.restarts())

    def _check_breach_from_tier(self, m0: dict, m1: dict, before: dict, after: dict, reads: Optional[int]) -> None:
        """The breach must have come from the slowed tier: the engine read KV from it while it was slow."""
        n = self.names
        disk_tokens = after.get("cached_disk", 0) - before.get("cached_disk", 0)

        def per_gib(a: dict, b: dict) -> Optional[float]:
            loaded = b.get("loaded_bytes", 0) - a.get("loaded_bytes", 0)
            return (b.get("load_time", 0) - a.get("load_time", 0)) / (loaded / 2**30) if loaded > 0 else None
        healthy_rate, slow_rate = per_gib(m0, m1), per_gib(before, after)
        fmt = lambda v: "-" if v is None else f"{v:.2f}s/GiB"
        self.r.note(f"while slow: {disk_tokens:.0f} prompt tokens served from {n.fs_tier} (disk), "
                    f"promotions +{after.get('promotions', 0) - before.get('promotions', 0):.0f}, "
                    f"kv_offload load time {fmt(healthy_rate)} healthy -> {fmt(slow_rate)} slowed (host -> engine "
                    "copies only: the disk reads are the promotions, outside that timer)"
                    + (f", {reads} reads through the throttle" if reads is not None else ""))
        if disk_tokens <= 0:
            raise ScenarioError(f"the breach did not come from the slowed tier: while {n.fs_tier}'s device was slow "
                                "the engine served no prompt tokens from it (prompt_tokens_cached_by_source{source="
                                "disk} did not move), so something else made TTFT breach")
        if reads is not None and reads <= 0:
            raise ScenarioError("the breach did not come from the slowed tier: no read went through the device's "
                                "throttle while it was slow")

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
        stored = (s.status.get("slo") or {}).get("history") or []
        history = [h for h in stored if h.get("action") == "Disabled" and h.get("tier") == n.fs_tier]
        if not history:
            raise ScenarioError(f"status.slo.history has no Disabled entry for {n.fs_tier}: {stored}")
        h = history[-1]
        if h.get("value") is None or h.get("threshold") is None or not h["value"] > h["threshold"]:
            raise ScenarioError(f"status.slo.history entry does not show a value over its threshold: {h}")
        self.r.ok(f"status.slo.history: {h['tier']} {h['action']} at {h['time']}: {h.get('metric')} "
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
        self.env.save_operator_log()
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
        if self.env.pods is not None:
            try:
                items = self.kube.list(f"/api/v1/namespaces/{self.names.namespace}/pods")
            except (ApiError, OSError):
                items = []
            for p in items:
                name = p["metadata"]["name"]
                out += [f"== pod {name}: {json.dumps((p.get('status') or {}).get('containerStatuses'))}",
                        self.env.pods.log(name, lines=15)]
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
    for t in extra.get("tiers") or []:  # kvtier's own spec, in the policy's order
        config = t.get("config") or {}
        parts.append(f"{t.get('name')} ({t.get('medium')} {config.get('root_dir') or config.get('url') or ''})")
    return ", ".join(parts)


class ScenarioFailed(ScenarioError):
    """The scenario failed; ``diagnostics`` holds what the cluster looked like at that moment."""

    def __init__(self, message: str, diagnostics: str):
        super().__init__(message)
        self.diagnostics = diagnostics


def run_local(options: LocalOptions, reporter: Reporter, supervisor: Optional[Supervisor] = None) -> Timings:
    """Set up the local provider, run the scenario, and stop everything it started (also on Ctrl-C)."""
    supervisor = supervisor or Supervisor()
    env = LocalEnvironment(options, supervisor, reporter.note)
    scenario = Scenario(env, reporter)
    try:
        return scenario.run()
    except Exception as err:
        diagnostics = scenario.diagnostics()
        (options.workdir / "failure.txt").write_text(f"{type(err).__name__}: {err}\n\n{diagnostics}\n")
        raise ScenarioFailed(f"{type(err).__name__}: {err}", diagnostics) from err
    finally:
        supervisor.close()
        if supervisor.errors:
            reporter.warn("clean-up problems: " + "; ".join(supervisor.errors))
