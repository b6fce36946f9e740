"""The ``local`` provider: everything on this machine, on loopback.

A real kube-apiserver + etcd + kube-controller-manager (``e2e/controlplane/run``), the CRD, a real Prometheus
process, the operator as a process (``kvtier operator``, logging to a file), and the kubelet stand-in that runs
the Deployment's pods as synthetic engine processes. Every process is registered with the Supervisor, so it
stops on success, failure and Ctrl-C.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import kvtier_operator

from kvtier_operator.api.crd import crd
from kvtier_operator.kube import ApiError, Kube
from .kubelet import KubeletStandIn
from .manifests import HEALTHY, USER_FIELD_MANAGER, Names
from .processes import ScenarioError, Started, Supervisor, tail, wait_http_ok
from .prometheus import PrometheusProcess, free_port

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/kvcachepolicies.kvtier.io"


@dataclass
class LocalOptions:
    repo: Path
    workdir: Path
    kubeconfig: Optional[Path] = None  # an API server that is already running (then not started or stopped)
    names: Names = field(default_factory=Names)
    seed: Optional[int] = None
    engine: str = "synthetic"              # or "vllm-cpu": real vLLM engines on a slow device
    vllm_python: Optional[str] = None      # the vllm-cpu env's python (default: the checkout's .venv-vllm-cpu)
    model_cache: Optional[Path] = None     # where the harness's small Llama is generated once
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
        self.operator: Optional[Started] = None
        self.kubelet: Optional[KubeletStandIn] = None
        self.controlplane_dir: Optional[Path] = None
        self.disk = None  # the slow device (real engine only)
        self.vllm_settings = None
        options.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def run_script(self) -> Path:
        return self.o.repo / "e2e" / "controlplane" / "run"

    @property
    def operator_log(self) -> Path:
        return self.o.workdir / "operator.log"

    # ------------------------------------------------------------------------------------------ set-up
    def up(self) -> None:
        self._controlplane()
        assert self.kubeconfig is not None
        self.kube = Kube(str(self.kubeconfig))
        self.supervisor.on_close("API client", self.kube.close)
        self._crd()
        self._namespace()
        # A busy CPU engine can take over a second to answer /metrics: a 2 s scrape for it.
        scrape = "2s" if self.o.real else "1s"
        workdir = self.o.workdir / "prometheus"
        try:
            self.prometheus = PrometheusProcess(
                workdir, scrape_interval=scrape,
                spawn=lambda cmd, log, cwd: self.supervisor.start("prometheus", cmd, log, cwd=cwd).process)
            # Registered before the process is started (so run after it stopped): the TSDB is of no use afterwards.
            self.supervisor.on_close("prometheus data", lambda: shutil.rmtree(workdir / "data", ignore_errors=True))
            self.prometheus.start(timeout=30.0)
        except RuntimeError as err:  # not installed, exited, not ready: the scenario's own error, with the words
            raise ScenarioError(str(err)) from None
        self.say(f"Prometheus {self.prometheus.url} scrapes the pods every {scrape} (namespace and pod labels, as "
                 "a Kubernetes pod scrape adds them)")
        self._operator()
        launcher = self._real_engine() if self.o.real else None
        self.kubelet = KubeletStandIn(
            self.kube, self.o.names.namespace, self.o.names.workload, supervisor=self.supervisor,
            prometheus=self.prometheus, engine_script=self.o.repo / "e2e" / "synthetic_engine" / "engine.py",
            workdir=self.o.workdir / "pods", knobs=dict(HEALTHY), seed=self.o.seed, launcher=launcher,
            say=self.say)

    def _real_engine(self):
        """The vllm-cpu env, the harness's model, and the slow device the filesystem tier will live on."""
        from .slowdisk import SlowDisk
        from .vllm_pod import VllmCpuLauncher, VllmCpuSettings, find_vllm_python

        python = find_vllm_python(self.o.repo, self.o.vllm_python)
        cache = self.o.model_cache or Path.home() / ".cache" / "kvtier" / "models"
        started = time.monotonic()
        proc = subprocess.run([str(python), "-c", "import sys; from vllm_cpu.model import ensure_model; "
                               "print(ensure_model(sys.argv[1]))", str(cache)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(self.o.repo / "e2e")}, timeout=600)
        if proc.returncode != 0:
            raise ScenarioError(f"generating the harness model failed:\n{proc.stderr[-2000:]}")
        model = Path(proc.stdout.strip().splitlines()[-1])
        self.say(f"engine: vllm-cpu ({python}); model {model.name} (a small local Llama, random weights; "
                 f"ready in {time.monotonic() - started:.0f}s)")
        disk = SlowDisk(self.o.workdir / "slowdisk", say=self.say)
        # Registered before any pod: clean-up runs in reverse, so the device goes after every engine stopped.
        self.supervisor.on_close("slow device", disk.close)
        disk.setup()
        self.disk = disk
        self.say(f"slow device for tier {self.o.names.fs_tier}: {disk.describe()}")
        self.say(f"  mechanism {disk.mechanism}: {disk.why}")
        self.vllm_settings = VllmCpuSettings(python=python, model_dir=model)
        return VllmCpuLauncher(self.vllm_settings, self.supervisor, self.o.repo, disk)

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
                 f"(kubeconfig {self.kubeconfig}); no kubelet: pods are stand-ins, see below")

    def _stop_controlplane(self) -> None:
        if self.controlplane_dir is None:
            return
        if (self.controlplane_dir / "controlplane.pid").exists():
            subprocess.run([str(self.run_script), "stop", str(self.controlplane_dir)], capture_output=True,
                           text=True, timeout=120)
        # Keep the logs; drop the database and the keys of a server that no longer exists.
        for name in ("etcd", "pki", "kubeconfig"):
            path = self.controlplane_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()

    def _crd(self) -> None:
        assert self.kube is not None
        self.kube.apply(CRD_PATH, crd(), manager="kvtier-install")
        deadline = time.monotonic() + 60
        while True:
            obj = self.kube.get(CRD_PATH) or {}
            if any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (obj.get("status") or {}).get("conditions") or []):
                break
            if time.monotonic() > deadline:
                raise ScenarioError(f"CRD kvcachepolicies.kvtier.io not Established: {obj.get('status')}")
            time.sleep(0.2)
        self.say("CRD kvcachepolicies.kvtier.io installed and Established")

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

    def _operator(self) -> None:
        assert self.kubeconfig is not None
        port = free_port()
        # The operator imports this very package, from wherever it was imported here (checkout or install).
        package_root = Path(kvtier_operator.__file__).resolve().parents[1]
        runtime_root = package_root.parent / "runtime"
        path = [str(package_root)] + ([str(runtime_root)] if runtime_root.is_dir() else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "kvtier_operator.cli", "operator", "--kubeconfig", str(self.kubeconfig),
               "--namespace", self.o.names.namespace, "--standalone", "--liveness",
               f"http://127.0.0.1:{port}/healthz", "--metrics-port", "-1", "--resync", "60", "--backoff-max", "5",
               "--no-read-nodes", "--prometheus-allow", "127.0.0.1:*", "--prometheus-allow-http"]
        self.operator = self.supervisor.start("operator", cmd, self.operator_log, env=env, grace_s=15)
        wait_http_ok(self.operator, f"http://127.0.0.1:{port}/healthz", 60)
        self.say(f"operator running (kvtier operator --namespace {self.o.names.namespace}); its log: "
                 f"{self.operator_log}")

    def check_alive(self) -> None:
        if self.operator is not None and self.operator.process.poll() is not None:
            raise ScenarioError(f"the operator exited with {self.operator.process.returncode}:\n"
                                f"{tail(self.operator_log)}")
        if self.prometheus is not None and self.prometheus.process is not None \
                and self.prometheus.process.poll() is not None:
            raise ScenarioError(f"prometheus exited:\n{tail(self.prometheus.log_path)}")
        if self.kubelet is not None:
            self.kubelet.check_alive()
