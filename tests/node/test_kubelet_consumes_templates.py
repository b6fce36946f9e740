"""What the operator writes into pod templates, consumed by a real kubelet and container runtime: the things the
former Python stand-in for the kubelet could not show. The operator (installed by its chart, tests/plugins/node.py)
writes every template here; the workloads run a small python3 "engine" (the base image) that does what vLLM does
with the tiers (fills the cpu tier's mmap in /dev/shm, writes into filesystem tiers) and reports what it saw as
one JSON line.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from plugins.node import NODE_RUN, NodeCluster, wait_until
from plugins.tier_sync import store_blocks

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.slow]

BASE_IMAGE = "kvtier.local/base:bookworm"
CONFIG_ARGS = ["--config", "/etc/kvtier/engine.yaml"]
POD_TIMEOUT_S = 180
Mi = 2**20

# The stand-in engine. Env: ANON_MB (anonymous memory it keeps, like a model's weights), SHM_MB (bytes it writes
# into its cpu tier file /dev/shm/vllm_offload_0.mmap, as vLLM's mmap does), WRITE_DIRS (directories it must be
# able to write: tier paths), TOKEN (call the API server with the service-account token).
ENGINE = r"""
import json, os, sys, time, ssl, urllib.request
r = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
r["config"] = open(sys.argv[sys.argv.index("--config") + 1]).read()
r["shm_at_start"] = sorted(os.listdir("/dev/shm"))
anon = bytearray(int(os.environ.get("ANON_MB", "0")) * 2**20)
for i in range(0, len(anon), 4096):
    anon[i] = 1
shm_mb = int(os.environ.get("SHM_MB", "0"))
if shm_mb:
    with open("/dev/shm/vllm_offload_0.mmap", "wb") as f:
        for _ in range(shm_mb):
            f.write(b"\1" * 2**20)
    with open("/dev/shm/keep.txt", "w") as f:
        f.write("not the engine's mmap")
r["shm_written_mb"] = shm_mb
r["writable"] = {}
for d in filter(None, os.environ.get("WRITE_DIRS", "").split(",")):
    try:
        with open(os.path.join(d, "probe-%d" % os.getpid()), "w") as f:
            f.write("kvtier")
        r["writable"][d] = "ok"
    except OSError as e:
        r["writable"][d] = e.strerror
if os.environ.get("TOKEN"):
    sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
    ctx = ssl.create_default_context(cafile=sa + "ca.crt")
    req = urllib.request.Request("https://%s:%s/api" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]),
                                 headers={"Authorization": "Bearer " + open(sa + "token").read()})
    try:
        r["api_status"] = urllib.request.urlopen(req, context=ctx, timeout=10).status
    except urllib.error.HTTPError as e:
        r["api_status"] = e.code
print(json.dumps(r), flush=True)
time.sleep(100000)
"""


def policy(name: str, namespace: str, tiers: list[dict[str, Any]], headroom: str = "16Mi") -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCachePolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "engine": "vllm",
            "blockSize": 16,
            "backend": "kvtier",
            "hostMemoryHeadroom": headroom,
            "tiers": tiers,
        },
    }


def deployment(name: str, namespace: str, env: dict[str, str], memory: str | None = None,
               limit: str | None = None, security: dict[str, Any] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "engine",
        "image": BASE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", ENGINE],
        "args": CONFIG_ARGS,
        "env": [{"name": k, "value": v} for k, v in env.items()],
    }
    if memory:
        container["resources"] = {"requests": {"memory": memory}, "limits": {"memory": limit or memory}}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    if security:
        spec["securityContext"] = security
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name, "kvtier.io/opt-in": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


class Cluster:
    def __init__(self, nc: NodeCluster, api: client.ApiClient) -> None:
        self.nc = nc
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def create_policy(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object("kvtier.io", "v1alpha1", body["metadata"]["namespace"], "kvcachepolicies", body)

    def applied_template(self, namespace: str, name: str) -> dict[str, Any]:
        """The Deployment once the operator has written its template (the config-hash annotation) and the
        rollout of that template has finished."""
        def done():
            d = self.api.sanitize_for_serialization(self.apps.read_namespaced_deployment(name, namespace))
            annotations = d["spec"]["template"].get("metadata", {}).get("annotations") or {}
            status = d.get("status") or {}
            rolled = (status.get("observedGeneration", 0) >= d["metadata"]["generation"]
                      and status.get("updatedReplicas", 0) == 1 and status.get("replicas", 0) == 1)
            return "kvtier.io/config-hash" in annotations and rolled and d
        return wait_until(done, POD_TIMEOUT_S, f"the operator's template on {namespace}/{name}")

    def pods(self, namespace: str, name: str) -> list[client.V1Pod]:
        return [p for p in self.core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
                if p.metadata.deletion_timestamp is None]

    def report(self, namespace: str, pod: str) -> dict[str, Any]:
        """The engine's latest JSON report from the pod's log, waiting for it."""
        def read():
            try:
                log = self.core.read_namespaced_pod_log(pod, namespace, container="engine")
            except ApiException:
                return None
            lines = [line for line in log.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None
        return wait_until(read, POD_TIMEOUT_S, f"the engine's report in {namespace}/{pod}")


@pytest.fixture
def cluster(node_cluster: NodeCluster):
    with node_cluster.cp.api_client() as api:
        yield Cluster(node_cluster, api)


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest):
    name = "kvt-" + request.node.name.replace("_", "-")[5:40].strip("-").lower()
    cluster.core.create_namespace({"metadata": {"name": name}})
    wait_until(lambda: cluster.core.list_namespaced_service_account(name).items, 30, "default ServiceAccount")
    yield name
    cluster.core.delete_namespace(name)


def rendered_engine_yaml(body: dict[str, Any], tmp_path: Path) -> str:
    """What `kvtier render` prints for the policy: '# engine.yaml' and then the file's content."""
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(body))
    out = subprocess.run([str(Path(sys.executable).parent / "kvtier"), "render", str(path)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    header, _, content = out.partition("\n")
    assert header == "# engine.yaml" and "\n# " not in content, out
    return content


def terminated(pod: client.V1Pod) -> client.V1ContainerStateTerminated | None:
    statuses = pod.status.container_statuses or []
    if not statuses:
        return None
    return statuses[0].state.terminated or (statuses[0].last_state.terminated if statuses[0].last_state else None)


def policy_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj = cluster.custom.get_namespaced_custom_object("kvtier.io", "v1alpha1", namespace, "kvcachepolicies", name)
    return obj.get("status") or {}


def test_cpu_tier_filled_to_its_size_survives_with_kvtiers_limit_and_is_oom_killed_without_it(
        cluster: Cluster, ns: str, tmp_path: Path) -> None:
    tier_mb, headroom_mb, request_mb, anon_mb = 64, 16, 64, 24
    need_mb = request_mb + tier_mb + headroom_mb
    pol = policy("shm", ns, [{"name": "host", "medium": "cpu", "size": f"{tier_mb}Mi"}], headroom=f"{headroom_mb}Mi")
    env = {"ANON_MB": str(anon_mb), "SHM_MB": str(tier_mb)}
    # The owner's manifest with a limit equal to the request: the operator refuses it and says what it needs.
    cluster.apps.create_namespaced_deployment(ns, deployment("shm", ns, env, memory=f"{request_mb}Mi"))
    cluster.create_policy(pol)
    message = wait_until(lambda: next((t.get("message") for t in policy_status(cluster, ns, "shm").get("targets") or []
                                       if t.get("state") == "Refused"), None), 60, "the operator's refusal")
    assert f"at least {need_mb}Mi" in message
    # The owner raises the limit as asked: the operator applies (the memory-backed /dev/shm sized to the cpu
    # tier plus headroom) and the pods roll.
    cluster.apps.patch_namespaced_deployment("shm", ns, {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "resources": {"limits": {"memory": f"{need_mb}Mi"}}}]}}}})
    d = cluster.applied_template(ns, "shm")
    template = d["spec"]["template"]
    assert template["spec"]["containers"][0]["resources"]["limits"]["memory"] == f"{need_mb}Mi"
    shm = next(v for v in template["spec"]["volumes"] if v["name"] == "kvtier-shm")
    assert shm["emptyDir"]["medium"] == "Memory" and int(shm["emptyDir"]["sizeLimit"]) == (tier_mb + headroom_mb) * Mi

    [pod] = wait_until(lambda: (p := cluster.pods(ns, "shm")) and len(p) == 1 and p, POD_TIMEOUT_S, "one pod")
    report = cluster.report(ns, pod.metadata.name)
    assert report["shm_written_mb"] == tier_mb
    # The file at the mounted config path is what `kvtier render` prints for this policy.
    assert report["config"] == rendered_engine_yaml(pol, tmp_path)
    time.sleep(3)  # an OOM kill lands right after the writes, if at all
    status = cluster.core.read_namespaced_pod(pod.metadata.name, ns).status
    assert status.phase == "Running" and status.container_statuses[0].restart_count == 0, status.container_statuses

    # The counter-case: the same template (same /dev/shm volume, same engine) with the limit the owner had,
    # without the increase kvtier asked for. Filling the same tier gets it OOM-killed.
    counter = copy.deepcopy(template)
    counter["spec"]["containers"][0]["resources"]["limits"]["memory"] = f"{request_mb}Mi"
    counter["spec"]["restartPolicy"] = "Never"
    counter["metadata"] = {"name": "shm-without-increase", "labels": {"test": "counter"}}
    cluster.core.create_namespaced_pod(ns, {"apiVersion": "v1", "kind": "Pod", **counter})
    state = wait_until(lambda: terminated(cluster.core.read_namespaced_pod("shm-without-increase", ns)),
                       POD_TIMEOUT_S, "the counter-case pod to be killed")
    assert state.reason == "OOMKilled" and state.exit_code == 137, state


def sandbox_id(cluster: Cluster, pod_uid: str) -> str:
    out = subprocess.run(
        [str(NODE_RUN), "ctr", str(cluster.nc.node.cp_dir), "containers", "ls", "-q",
         f'labels."io.kubernetes.pod.uid"=={pod_uid},labels."io.cri-containerd.kind"==sandbox'],
        capture_output=True, text=True, check=True, timeout=30).stdout.split()
    assert len(out) == 1, out
    return out[0]


def test_the_init_container_removes_a_stale_cpu_tier_file_when_the_pod_sandbox_restarts(cluster: Cluster, ns: str) -> None:
    cluster.apps.create_namespaced_deployment(ns, deployment("restart", ns, {"SHM_MB": "4"}))
    cluster.create_policy(policy("restart", ns, [{"name": "host", "medium": "cpu", "size": "8Mi"}]))
    d = cluster.applied_template(ns, "restart")
    assert [c["name"] for c in d["spec"]["template"]["spec"]["initContainers"]] == ["kvtier-shm-cleanup"]
    [pod] = wait_until(lambda: (p := cluster.pods(ns, "restart")) and len(p) == 1 and p, POD_TIMEOUT_S, "one pod")
    first = cluster.report(ns, pod.metadata.name)
    assert first["shm_at_start"] == []
    init = cluster.core.read_namespaced_pod(pod.metadata.name, ns).status.init_container_statuses[0]
    assert init.state.terminated.exit_code == 0
    # Kill the pod's sandbox (as a node crash or runtime restart would): the kubelet makes a new one, runs the
    # init containers again and restarts the engine on the same memory-backed /dev/shm volume, which still holds
    # the mmap the dead engine left.
    subprocess.run([str(NODE_RUN), "ctr", str(cluster.nc.node.cp_dir), "tasks", "kill", "-s", "SIGKILL",
                    sandbox_id(cluster, pod.metadata.uid)], check=True, timeout=30)

    def second_report():
        status = cluster.core.read_namespaced_pod(pod.metadata.name, ns).status
        if not status.container_statuses or status.container_statuses[0].restart_count < 1:
            return None
        log = cluster.core.read_namespaced_pod_log(pod.metadata.name, ns, container="engine")
        lines = [line for line in log.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    second = wait_until(second_report, POD_TIMEOUT_S, "the engine's start in the new sandbox")
    # The stale mmap is gone, the volume is the same (another file survived): the clean-up ran, and only it.
    assert second["shm_at_start"] == ["keep.txt"]


def test_tier_directories_on_the_node(cluster: Cluster, ns: str) -> None:
    """A hostPath tier under the allowed prefix, an emptyDir tier and the cpu tier, for a root engine and for a
    non-root one with fsGroup; and the service-account token still works in a pod with tiers."""
    prefix = cluster.nc.hostpath_prefix
    tiers = [
        {"name": "host", "medium": "cpu", "size": "8Mi"},
        {"name": "disk", "medium": "filesystem", "size": "16Mi", "path": "/mnt/kvcache-disk", "volume": {"emptyDir": {}}},
        {"name": "local", "medium": "filesystem", "size": "16Mi", "path": "/mnt/kvcache-local",
         "volume": {"hostPath": {"path": f"{prefix}/{ns}", "type": "DirectoryOrCreate"}}},
    ]
    dirs = "/dev/shm,/mnt/kvcache-disk,/mnt/kvcache-local"
    cluster.apps.create_namespaced_deployment(ns, deployment("root", ns, {"WRITE_DIRS": dirs, "TOKEN": "1"}))
    nonroot = {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000, "runAsNonRoot": True}
    cluster.apps.create_namespaced_deployment(ns, deployment("nonroot", ns, {"WRITE_DIRS": dirs}, security=nonroot))
    cluster.create_policy(policy("root", ns, tiers))
    cluster.create_policy(policy("nonroot", ns, tiers))
    for name in ("root", "nonroot"):
        cluster.applied_template(ns, name)
    reports = {}
    for name in ("root", "nonroot"):
        [pod] = wait_until(lambda name=name: (p := cluster.pods(ns, name)) and len(p) == 1 and p, POD_TIMEOUT_S, f"{name} pod")
        reports[name] = cluster.report(ns, pod.metadata.name)

    root = reports["root"]
    assert root["writable"] == {d: "ok" for d in dirs.split(",")}
    # The hostPath tier is the node's directory under the allowed prefix.
    assert [p.read_text() for p in (prefix / ns).glob("probe-*")] == ["kvtier"]
    # The token the kubelet mounted is readable and authenticates: no tier shadows it.
    assert root["api_status"] == 200

    nonroot_report = reports["nonroot"]
    assert (nonroot_report["uid"], nonroot_report["gid"]) == (1000, 1000) and 2000 in nonroot_report["groups"]
    writable = nonroot_report["writable"]
    # fsGroup makes the memory-backed /dev/shm and the emptyDir tier group-writable for the engine's user.
    assert writable["/dev/shm"] == "ok" and writable["/mnt/kvcache-disk"] == "ok"
    # The kubelet applies fsGroup to neither the ownership nor the mode of a hostPath directory: one it creates
    # (DirectoryOrCreate) is root's, 0755. A non-root engine needs the directory prepared on the node.
    assert writable["/mnt/kvcache-local"] == "Permission denied"


def test_a_tier_cannot_shadow_the_service_account_token(cluster: Cluster, ns: str) -> None:
    for path in ("/var/run/secrets", "/var/run", "/var", "/run"):
        body = policy("shadow", ns, [
            {"name": "host", "medium": "cpu", "size": "8Mi"},
            {"name": "disk", "medium": "filesystem", "size": "16Mi", "path": path, "volume": {"emptyDir": {}}},
        ])
        with pytest.raises(ApiException) as refused:
            cluster.create_policy(body)
        assert refused.value.status == 422 and "spec.tiers[1].path" in refused.value.body, (path, refused.value.body)


def test_an_emptydir_tier_filled_by_kvtiers_filesystem_tier_stays_under_its_size_limit(cluster: Cluster, ns: str) -> None:
    import torch
    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.fs.tier import FilesystemTier

    cluster.apps.create_namespaced_deployment(ns, deployment("fill", ns, {}))
    cluster.create_policy(policy("fill", ns, [
        {"name": "host", "medium": "cpu", "size": "8Mi"},
        {"name": "disk", "medium": "filesystem", "size": "32Mi", "path": "/mnt/kvcache-disk", "volume": {"emptyDir": {}}},
    ]))
    d = cluster.applied_template(ns, "fill")
    [volume] = [v for v in d["spec"]["template"]["spec"]["volumes"] if v.get("emptyDir") and v["name"] != "kvtier-shm"]
    [pod] = wait_until(lambda: (p := cluster.pods(ns, "fill")) and len(p) == 1 and p, POD_TIMEOUT_S, "one pod")
    rendered = yaml.safe_load(cluster.report(ns, pod.metadata.name)["config"])
    [entry] = rendered["kv-transfer-config"]["kv_connector_extra_config"]["tiers"]
    tier = entry["config"]
    assert entry["medium"] == "filesystem" and tier["root_dir"] == "/mnt/kvcache-disk"
    # The pod's emptyDir as the kubelet sees it on the node; kvtier's own tier code (the engine's, run here on
    # the host for want of torch in the base image) fills it to the capacity the operator rendered.
    host_dir = (cluster.nc.node.kubelet_root / "pods" / pod.metadata.uid / "volumes"
                / "kubernetes.io~empty-dir" / volume["name"])
    assert host_dir.is_dir()
    fs_tier = FilesystemTier(FilesystemTierConfig(root_dir=str(host_dir), capacity_bytes=tier["capacity_bytes"],
                                                  n_read_threads=2, n_write_threads=2), (2, 16, 8, 64), torch.float16)
    block = torch.ones((2, 16, 8, 64), dtype=torch.float16)
    for _ in range(80):  # 4000 blocks of 32 KiB: the tier fills and evicts, as a serving engine's does
        store_blocks(fs_tier, [os.urandom(16) for _ in range(50)], [block] * 50)
    # The kubelet measures volumes every 10 s on this node (volumeStatsAggPeriod) and evicts at the next check.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = cluster.core.read_namespaced_pod(pod.metadata.name, ns).status
        assert status.reason != "Evicted", status.message
        time.sleep(2)
