"""The Deployment's pods as the node's kubelet runs them, seen from the scenario.

The scenario starts no pod itself: the Deployment controller makes ReplicaSets, the scheduler binds their pods to
the node, and the node's kubelet (containerd, runc) runs them from kvtier's images, with the volumes, mounts,
memory limits and init container the operator wrote into the template. This module only watches: which pods of
the Deployment run and are Ready, at which IP; it keeps Prometheus' targets on them (Prometheus scrapes pod IPs
on the node's bridge), applies the synthetic engine's latency knobs to new pods, and reads back the
configuration each pod loaded. A container that restarts or fails fails the scenario with its log.
"""
from __future__ import annotations

import calendar
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import yaml
from kvtier_operator.kube import Kube

from .processes import ScenarioError
from .prometheus import PrometheusProcess

CONFIG_FLAGS = ("--config", "--extra_llm_api_options", "--extra-llm-api-options")
REVISION = "deployment.kubernetes.io/revision"
ENGINE_PORT = 8000


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
    volume: str = ""


def config_source(template: dict[str, Any]) -> ConfigSource:
    """Follow a pod template's ``--config PATH`` to a ConfigMap key, as the kubelet's mounts do.

    Raises PodFailed naming what is missing: the container would fail the same way (no such file).
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
            return ConfigSource(c.get("name", ""), flag, path, mount["mountPath"], cm["name"], key,
                                mount.get("name", ""))
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


def _timestamp(value: Optional[str]) -> Optional[float]:
    if not value:
        return None
    return float(calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")))


@dataclass
class Pod:
    """A Ready pod of the Deployment, as the API server reports it."""

    name: str
    uid: str
    ip: str
    replica_set: str
    config_hash: str
    template: dict[str, Any]   # the pod's own spec, as a template (for config_source)
    start_seconds: float       # created -> Ready, as the API server's timestamps say

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{ENGINE_PORT}"

    def call(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())


class NodePods:
    """The Ready pods of one Deployment on the node; Prometheus targets and synthetic knobs follow them."""

    def __init__(self, kube: Kube, namespace: str, deployment: str, *, prometheus: PrometheusProcess,
                 kubelet_root: Path, synthetic: bool, knobs: Optional[dict[str, float]] = None,
                 on_pods: Optional[Callable[[], None]] = None, say: Callable[[str], None] = lambda _: None):
        self.kube, self.namespace, self.deployment = kube, namespace, deployment
        self.prometheus, self.kubelet_root, self.synthetic = prometheus, kubelet_root, synthetic
        self.knobs: dict[str, float] = dict(knobs or {})
        self.on_pods = on_pods  # called after every sync (the slow device re-applies its throttle there)
        self.say = say
        self.pods: list[Pod] = []
        self.seen: dict[str, Pod] = {}          # every pod that was Ready, by name (for diagnostics)
        self._knobs_applied: dict[str, dict[str, float]] = {}
        self._targets: set[str] = set()

    # -- the environment's latency (synthetic engines), applied to every pod now and later
    def set_knobs(self, **knobs: float) -> None:
        self.knobs.update(knobs)
        self.sync()

    def _selector(self) -> str:
        dep = self.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployment}")
        if dep is None:
            raise PodFailed(f"Deployment {self.namespace}/{self.deployment} does not exist")
        labels = dep["spec"]["selector"].get("matchLabels") or {}
        return ",".join(f"{k}={v}" for k, v in labels.items())

    def sync(self) -> list[Pod]:
        """Read the Deployment's pods; fail on a crashed container; keep targets and knobs on the Ready ones."""
        items = self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods", self._selector())
        ready: list[Pod] = []
        for p in items:
            if p["metadata"].get("deletionTimestamp"):
                continue  # rolled out: its container is being stopped (its exit code says nothing)
            self._check(p)
            meta, status = p["metadata"], p.get("status") or {}
            if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
                continue
            conditions = {c.get("type"): c for c in status.get("conditions") or []}
            if (conditions.get("Ready") or {}).get("status") != "True":
                continue
            created = _timestamp(meta.get("creationTimestamp"))
            became = _timestamp(conditions["Ready"].get("lastTransitionTime"))
            owner = next((o.get("name", "") for o in meta.get("ownerReferences") or []
                          if o.get("kind") == "ReplicaSet"), "")
            pod = Pod(meta["name"], meta["uid"], status["podIP"], owner,
                      (meta.get("annotations") or {}).get("kvtier.io/config-hash", ""),
                      {"metadata": {"annotations": meta.get("annotations") or {}}, "spec": p["spec"]},
                      (became - created) if created is not None and became is not None else 0.0)
            ready.append(pod)
            if pod.name not in self.seen:
                self.say(f"pod {pod.name} Ready on the node at {pod.ip} ({pod.start_seconds:.0f}s after it was "
                         "created)")
            self.seen[pod.name] = pod
        ready.sort(key=lambda p: p.name)
        self.pods = ready
        self._sync_targets()
        if self.synthetic:
            self._sync_knobs()
        if self.on_pods is not None:
            self.on_pods()
        return ready

    def _check(self, pod: dict[str, Any]) -> None:
        """A container that crashed, was OOM-killed or cannot start fails the scenario, with its log."""
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        if status.get("phase") == "Failed":
            raise PodFailed(f"pod {name} failed ({status.get('reason')}: {status.get('message')}):\n{self.log(name)}")
        for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            state = c.get("state") or {}
            last = (c.get("lastState") or {}).get("terminated")
            waiting = (state.get("waiting") or {}).get("reason")
            if waiting in ("ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                           "CreateContainerError", "InvalidImageName", "RunContainerError"):
                raise PodFailed(f"pod {name}: container {c.get('name')} cannot start: {waiting}: "
                                f"{(state.get('waiting') or {}).get('message')}")
            if c.get("restartCount", 0) > 0 and last:
                raise PodFailed(f"pod {name}: container {c.get('name')} exited ({last.get('reason')}, exit code "
                                f"{last.get('exitCode')}) and was restarted:\n"
                                f"{self.log(name, c.get('name'), previous=True)}")

    def _sync_targets(self) -> None:
        want = {f"{p.ip}:{ENGINE_PORT}": p for p in self.pods}
        for address in self._targets - set(want):
            self.prometheus.remove_target(address)
        for address, pod in want.items():
            if address not in self._targets:
                self.prometheus.add_target(address, namespace=self.namespace, pod=pod.name)
        self._targets = set(want)

    def _sync_knobs(self) -> None:
        for pod in self.pods:
            if self._knobs_applied.get(pod.name) != self.knobs:
                try:
                    pod.call("POST", "/control", self.knobs)
                except (OSError, ValueError):
                    continue  # just Ready: next sync
                self._knobs_applied[pod.name] = dict(self.knobs)

    def wait_ready(self, timeout: float, on_tick: Optional[Callable[[], None]] = None,
                   current_only: bool = True) -> list[Pod]:
        """Until a pod of the Deployment's current ReplicaSet is Ready (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            pods = self.sync()
            if pods and (not current_only or self._current(pods)):
                return pods
            if time.monotonic() > deadline:
                items = self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods", self._selector())
                states = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in items}
                raise PodFailed(f"no pod of Deployment {self.deployment} Ready on the node after {timeout:g}s "
                                f"(pods: {states})")
            if on_tick is not None:
                on_tick()
            time.sleep(1)

    def _current(self, pods: list[Pod]) -> bool:
        dep = self.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployment}") or {}
        want = ((dep.get("spec") or {}).get("template") or {}).get("metadata", {}).get("annotations", {}).get(
            "kvtier.io/config-hash")
        return any(p.config_hash == want for p in pods)

    def check_alive(self) -> None:
        self.sync()

    # -- what the pods loaded
    def loaded_config(self, pod: Pod) -> dict[str, Any]:
        """The synthetic engine: what it parsed (``GET /config``). vLLM has no such endpoint: the file the
        kubelet projected into the pod's ConfigMap volume, read on the node."""
        if self.synthetic:
            return pod.call("GET", "/config")
        source = config_source(pod.template)
        path = (self.kubelet_root / "pods" / pod.uid / "volumes" / "kubernetes.io~configmap" / source.volume
                / source.key)
        return yaml.safe_load(path.read_text()) or {}

    def loaded_control(self, pod: Pod, name: str) -> Optional[str]:
        """The live control file ``name`` as the kubelet delivered it into the pod's ConfigMap volume (read on the
        node), None while it is not there."""
        source = config_source(pod.template)
        path = self.kubelet_root / "pods" / pod.uid / "volumes" / "kubernetes.io~configmap" / source.volume / name
        try:
            return path.read_text()
        except OSError:
            return None

    def restarts(self) -> dict[str, tuple[str, int]]:
        """Every live pod of the Deployment, as the API server reports it: name -> (uid, container restarts)."""
        out = {}
        for p in self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods", self._selector()):
            if p["metadata"].get("deletionTimestamp"):
                continue
            statuses = (p.get("status") or {}).get("containerStatuses") or []
            out[p["metadata"]["name"]] = (p["metadata"]["uid"], sum(c.get("restartCount", 0) for c in statuses))
        return out

    def loaded_configs(self) -> dict[str, dict[str, Any]]:
        out = {}
        for pod in self.pods:
            try:
                out[pod.name] = self.loaded_config(pod)
            except (OSError, urllib.error.URLError, ValueError, ScenarioError):
                out[pod.name] = {}
        return out

    def log(self, pod: str, container: Optional[str] = None, previous: bool = False, lines: int = 40) -> str:
        return pod_log(self.kube, self.namespace, pod, container, previous, lines)


def pod_log(kube: Kube, namespace: str, pod: str, container: Optional[str] = None, previous: bool = False,
            lines: int = 40) -> str:
    """A container's log through the API server (the kubelet serves it)."""
    query = [("tailLines", str(lines))] + ([("container", container)] if container else []) + (
        [("previous", "true")] if previous else [])
    api = kube.api
    try:
        _, url, headers, body, _ = api.param_serialize(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log", query_params=query,
            header_params={"Accept": "*/*"}, auth_settings=["BearerToken"])
        response = api.call_api("GET", url, header_params=headers, _request_timeout=10)
        return response.read().decode(errors="replace")
    except Exception as err:
        return f"(no log for pod {namespace}/{pod}: {err})"


def restarts_since(before: dict[str, tuple[str, int]], now: dict[str, tuple[str, int]]) -> int:
    """Engine restarts between two ``NodePods.restarts()`` readings (pod name -> (uid, container restarts)): each
    pod of ``before`` that is gone or was replaced (another uid) counts once, plus the container restarts each pod
    of ``now`` gained (all of them for a pod that was not there before)."""
    count = 0
    for name, (uid, _) in before.items():
        if name not in now or now[name][0] != uid:
            count += 1
    for name, (uid, restarts) in now.items():
        old_uid, old_restarts = before.get(name, ("", 0))
        count += max(0, restarts - old_restarts) if old_uid == uid else restarts
    return count
