#!/usr/bin/env python3
"""How fast the operator configures many workloads: N policies, each with its own target Deployment.

For each N: create N Deployments (server-side apply as a GitOps tool would), start the operator, create the N
policies back to back, and watch the Deployments until each carries its ``kvtier.io/config-hash``. Prints, per N:
latency from a policy's creation to its workload carrying the hash (p50/p99/max), reconciles per policy and per
second, the part of the latency until the policy's first reconcile finished, and the reference measured in the
same run: the latency of one direct server-side apply of the same patch (the floor any operator pays), with the
ratio p50 / reference.

The operator runs as it ships, in its own process (``kvtier operator``), so the benchmark's own work (creating
policies, decoding the watch) does not share the operator's interpreter lock; its counters are read from its
metrics endpoint. ``--operator thread`` runs it in a thread of the benchmark instead (the tests' harness), which
also reports when each policy's first reconcile finished.

``--mode cold``: each N runs in a fresh Python process (nothing imported, parsed or connected before the
operator starts, as after a pod start). ``--mode warm``: one process; a warm-up round of 20 policies in its own
namespace first, then each N with a fresh operator (the process's imports and caches are warm).

    python bench/operator_scale.py --sizes 10,100,500 --mode cold   # starts a control plane (e2e/controlplane/run)
    python bench/operator_scale.py --kubeconfig KUBECONFIG ...        # or uses a running one (CRDs applied)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "tests"), str(ROOT)]  # ROOT: bench.tables

from kubernetes import client, config, watch  # noqa: E402
from kvtier_operator.kube import Kube, policy_path, workload_path  # noqa: E402
from kvtier_operator.labels import OPT_IN_LABEL  # noqa: E402
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION, Settings  # noqa: E402
from plugins.operator_thread import OperatorThread  # noqa: E402  (the tests' harness: the operator in a thread)

from bench.tables import SMOKE_HELP, require_rows  # noqa: E402


def deployment(name: str, ns: str) -> dict:
    labels = {"app": name}
    # The workload's owner opts in to the policy of the same name (trust.opted_in): without the label the operator
    # reports NotOptedIn and configures nothing, and the benchmark would time nothing.
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns,
                                                                       "labels": {**labels, OPT_IN_LABEL: name}},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                         "name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                         "args": ["--model", "m", "--config", "/etc/kvtier/engine.yaml"],
                         "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "64Gi"}}}]}}}}


def policy(name: str, ns: str, i: int) -> dict:
    # Every policy has its own size, so no two specs are alike (no cache hits flatter the figures).
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "tiers": [{"name": "cpu", "medium": "cpu", "size": f"{16384 + i}Mi"}]}}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def reference_apply_latency(kube: Kube, ns: str, samples: int = 30) -> float:
    """p50 of a direct server-side apply of a volume+annotation patch to a Deployment (the floor)."""
    name = "reference"
    kube.apply(workload_path("Deployment", ns, name), deployment(name, ns), manager="bench-user")
    times = []
    for i in range(samples):
        patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
                 "spec": {"template": {"metadata": {"annotations": {CONFIG_HASH_ANNOTATION: f"h{i}"}},
                                       "spec": {"containers": [{"name": "vllm", "volumeMounts": [
                                           {"name": "x", "mountPath": "/x"}]}],
                                                "volumes": [{"name": "x", "emptyDir": {}}]}}}}
        t0 = time.perf_counter()
        kube.apply(workload_path("Deployment", ns, name), patch, manager="bench-reference")
        times.append(time.perf_counter() - t0)
    kube.delete(workload_path("Deployment", ns, name))
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OperatorProcess:
    """``kvtier operator`` in its own process, watching one namespace; ready once its liveness probe answers."""

    def __init__(self, kubeconfig: str, ns: str, log: Path, profile: str | None = None):
        self.metrics_port, live = _free_port(), _free_port()
        self.live_url = f"http://127.0.0.1:{live}/healthz"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "runtime")])}
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        profiler = ["-m", "cProfile", "-o", profile] if profile else []
        self.proc = subprocess.Popen(
            [sys.executable, *profiler, "-m", "kvtier_operator", "operator", "--namespace", ns, "--standalone",
             "--liveness", self.live_url, "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
             "--no-read-nodes", "--kubeconfig", kubeconfig], env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def start(self, timeout: float = 60) -> OperatorProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.live_url, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("the operator did not get ready")

    def value(self, name: str, labels: dict[str, str]) -> float:
        """A counter from the operator's metrics endpoint (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def cpu_seconds(self) -> float:
        """User + system CPU the operator has used so far: less sensitive to other load than wall time."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def wait_for_watch_cache(api: client.ApiClient, ns: str, timeout: float = 60) -> float:
    """Seconds until a watch of policies is served. A fresh API server answers watches of a just-created CRD with
    429 "storage is (re)initializing" for a while; kopf retries after 1 s, which would time the control plane's
    start, not the operator (a running cluster's caches are long initialised)."""
    custom = client.CustomObjectsApi(api)
    start = time.monotonic()
    while True:
        try:
            response: Any = custom.list_namespaced_custom_object("kvtier.io", "v1alpha1", ns, "kvcachepolicies",
                                                                 watch=True, timeout_seconds=1, _preload_content=False)
            response.release_conn()  # not read: a raw urllib3 response (_preload_content=False)
            return time.monotonic() - start
        except client.ApiException as err:
            if err.status != 429 or time.monotonic() - start > timeout:
                raise
            time.sleep(0.2)


def run_size(kubeconfig: str, n: int, timeout: float, settings: dict | None = None,
             in_thread: bool = False, rate: float = 0.0) -> dict:
    kube = Kube(kubeconfig)
    ns = f"bench-{n}-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    reference = reference_apply_latency(kube, ns)
    for i in range(n):
        kube.apply(workload_path("Deployment", ns, f"w{i}"), deployment(f"w{i}", ns), manager="bench-user")

    seen: dict[str, float] = {}
    done = threading.Event()
    api = config.new_client_from_config(config_file=kubeconfig)
    apps = client.AppsV1Api(api)
    cache_wait = wait_for_watch_cache(api, ns)

    def watcher() -> None:
        # Plain dicts ("object"), not client models: decoding a V1Deployment per event costs milliseconds of CPU.
        w = watch.Watch(return_type="object")
        for event in w.stream(apps.list_namespaced_deployment, ns, timeout_seconds=int(timeout) + 30):
            obj = event["object"]
            ann = ((obj.get("spec") or {}).get("template") or {}).get("metadata", {}).get("annotations") or {}
            name = obj["metadata"]["name"]
            if CONFIG_HASH_ANNOTATION in ann and name not in seen:
                seen[name] = time.monotonic()
                if len(seen) >= n:
                    w.stop()
            if done.is_set():
                w.stop()

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    reconciled: dict[str, float] = {}
    if in_thread:
        runner = OperatorThread(Settings(namespaces=(ns,), standalone=True, liveness_endpoint=None,
                                         metrics_port=None, read_nodes=False, kubeconfig=kubeconfig,
                                         **(settings or {})), Kube(kubeconfig))
        runner.op.on_reconciled.append(lambda key, outcome: reconciled.setdefault(key[1], time.monotonic()))
        runner.start()
        counter = runner.op.metrics.value
    else:
        if settings:
            raise SystemExit("--settings needs --operator thread (the process takes the flags it ships with)")
        runner = OperatorProcess(kubeconfig, ns, Path(tempfile.gettempdir()) / f"kvtier-bench-{ns}.log",
                                 os.environ.get("KVTIER_BENCH_PROFILE")).start()
        counter = runner.value
        cpu_at_start = runner.cpu_seconds()
    created: dict[str, float] = {}
    start = time.monotonic()
    for i in range(n):
        if rate:  # paced arrivals: policy i is due at start + i / rate
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        created[f"w{i}"] = time.monotonic()
        kube.create(policy_path(ns), policy(f"w{i}", ns, i))
    create_s = time.monotonic() - start
    deadline = time.monotonic() + timeout
    while len(seen) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    end = max(seen.values()) if seen else time.monotonic()
    # A workload carries its hash before its reconcile has written status and returned: let the reconciles that
    # configured the last workloads finish before reading the counters (bounded).
    settle = time.monotonic() + 30
    while ((in_thread and len(reconciled) < len(seen)) or time.monotonic() - end < 2) and time.monotonic() < settle:
        time.sleep(0.1)
    reconciles = counter("kvtier_operator_reconciles_total", {"result": "ok"})
    writes = {k: counter("kvtier_operator_api_writes_total", {"kind": k}) for k in ("workload", "configmap", "status")}
    retries = counter("kvtier_operator_reconciles_total", {"result": "retry"})
    cpu = None if in_thread else runner.cpu_seconds() - cpu_at_start
    done.set()
    runner.stop()
    if in_thread:
        runner.op.kube.close()
    latencies = [seen[k] - created[k] for k in seen]
    to_reconcile = [reconciled[k] - created[k] for k in seen if k in reconciled]
    # Leave nothing behind: release the finalizers (the operator is stopped) and drop the namespace.
    for i in range(n):
        try:
            kube.patch(policy_path(ns, f"w{i}"), {"metadata": {"finalizers": None}})
        except Exception:
            pass
    kube.delete(f"/api/v1/namespaces/{ns}")
    kube.close()
    return {"n": n, "done": len(seen), "create_s": create_s, "p50": pct(latencies, 0.5) if latencies else None,
            "p99": pct(latencies, 0.99) if latencies else None, "max": max(latencies) if latencies else None,
            "reconciled_p99": pct(to_reconcile, 0.99) if to_reconcile else None,
            "reconciles": reconciles, "reconciles_per_s": reconciles / max(end - start, 1e-9),
            "retries": retries, "writes": writes, "watch_cache_wait_s": cache_wait, "operator_cpu_s": cpu,
            "reference": reference}


def start_controlplane() -> tuple[str, Path]:
    state = Path(tempfile.mkdtemp(prefix="kvtier-bench-cp-"))
    run = ROOT / "e2e" / "controlplane" / "run"
    out = subprocess.run([str(run), "start", str(state)], capture_output=True, text=True, check=True)
    kubeconfig = out.stdout.strip().splitlines()[-1]
    subprocess.run([str(run), "kubectl", str(state), "apply", "--server-side", "-f", str(ROOT / "crds")],
                   check=True, capture_output=True)
    subprocess.run([str(run), "kubectl", str(state), "wait", "--for=condition=Established", "--timeout=60s",
                    "crd/kvcachepolicies.kvtier.io"], check=True, capture_output=True)
    return kubeconfig, state


def cold(kubeconfig: str, n: int, timeout: float, settings: str, operator: str, rate: float) -> dict:
    """One size in a fresh interpreter: the operator starts with nothing imported or cached."""
    out = subprocess.run([sys.executable, __file__, "--kubeconfig", kubeconfig, "--one", str(n), "--timeout",
                          str(timeout), "--settings", settings, "--operator", operator, "--rate", str(rate)],
                         capture_output=True,
                         text=True, timeout=timeout + 300)
    if out.returncode != 0:
        raise RuntimeError(f"N={n} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,500")
    parser.add_argument("--mode", choices=("cold", "warm"), default="cold")
    parser.add_argument("--kubeconfig", default=os.environ.get("KVTIER_CONTROLPLANE_KUBECONFIG"))
    parser.add_argument("--timeout", type=float, default=300.0, help="per size, seconds")
    parser.add_argument("--settings", default="{}", help="operator Settings overrides, JSON (for experiments; "
                                                          "with --operator thread)")
    parser.add_argument("--rate", type=float, default=20.0,
                        help="policies created per second (default 20, the arrival rate of issue 27's measurement); "
                             "0: back to back, as fast as the API server takes them")
    parser.add_argument("--operator", choices=("process", "thread"), default="process",
                        help="run the operator in its own process, as it ships (default), or in a thread of the "
                             "benchmark (the tests' harness; also times each policy's first reconcile)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one size, JSON on stdout
    parser.add_argument("--smoke", action="store_true", help=f"N=2 on a fresh control plane: {SMOKE_HELP}")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.mode, args.timeout = "2", "cold", 120.0
    if args.one:
        print(json.dumps(run_size(args.kubeconfig, args.one, args.timeout, json.loads(args.settings),
                                  in_thread=args.operator == "thread", rate=args.rate)))
        return 0
    state = None
    kubeconfig = args.kubeconfig
    if not kubeconfig:
        kubeconfig, state = start_controlplane()
    try:
        sizes = [int(n) for n in args.sizes.split(",")]
        if args.mode == "cold":
            rows = [cold(kubeconfig, n, args.timeout, args.settings, args.operator, args.rate) for n in sizes]
        else:
            thread = args.operator == "thread"
            run_size(kubeconfig, 20, args.timeout, json.loads(args.settings), thread, args.rate)  # warm-up
            rows = [run_size(kubeconfig, n, args.timeout, json.loads(args.settings), thread, args.rate)
                    for n in sizes]
    finally:
        if state is not None:
            subprocess.run([str(ROOT / "e2e" / "controlplane" / "run"), "stop", str(state)], capture_output=True)
    print(f"mode {args.mode}, operator in a {args.operator}, policies at "
          f"{f'{args.rate:g}/s' if args.rate else 'full speed'}, settings {args.settings}")
    print(f"{'N':>5} {'done':>5} {'create s':>9} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'1st rec p99':>11} "
          f"{'rec/pol':>7} {'rec/s':>7} {'ref apply s':>11} {'p50/ref':>8}")
    for r in rows:
        fmt = (lambda v: f"{v:7.3f}" if v is not None else "    n/a")
        ratio = f"{r['p50'] / r['reference']:8.1f}" if r["p50"] is not None else "     n/a"
        print(f"{r['n']:>5} {r['done']:>5} {r['create_s']:9.2f} {fmt(r['p50'])} {fmt(r['p99'])} {fmt(r['max'])} "
              f"{fmt(r['reconciled_p99']):>11} {r['reconciles'] / r['n']:7.2f} {r['reconciles_per_s']:7.1f} "
              f"{r['reference']:11.4f} {ratio}")
    print()
    for r in rows:
        print(f"N={r['n']}: {r['reconciles']:.0f} reconciles ({r['reconciles'] / r['n']:.1f} per policy), "
              f"{r['retries']:.0f} retried; writes: " + ", ".join(f"{k} {v:.0f}" for k, v in r["writes"].items())
              + f"; waited {r['watch_cache_wait_s']:.1f} s for the API server's policy watch cache before starting"
              + ("" if r["operator_cpu_s"] is None else
                 f"; operator CPU {r['operator_cpu_s']:.1f} s ({r['operator_cpu_s'] / r['n'] * 1e3:.0f} ms per policy)"))
    require_rows(len(rows), "operator at scale")
    problems = failures(rows)
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


def failures(rows: list[dict]) -> list[str]:
    """What makes a run measure nothing or too little: a size whose workloads were not all configured, or whose
    operator wrote no workload at all (a timing of nothing is not a result)."""
    out = []
    for r in rows:
        if r["writes"].get("workload", 0) == 0:
            out.append(f"N={r['n']}: the operator configured no workload (writes: workload 0); nothing was measured")
        if r["done"] < r["n"]:
            out.append(f"N={r['n']}: only {r['done']} of {r['n']} workloads carried {CONFIG_HASH_ANNOTATION} "
                       f"within --timeout")
    return out


if __name__ == "__main__":
    sys.exit(main())
