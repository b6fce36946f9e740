"""images/build and images/load: kvtier's images without a registry (Debian rootfs + pinned wheels, umoci,
skopeo), cached by a hash of their inputs, and the images running on a real node."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from kubernetes import client
from packaging.requirements import Requirement
from plugins.controlplane import ControlPlane, build, start, stop
from plugins.node import build_node, require_node, start_node, stop_node, wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build"
LOAD = ROOT / "images" / "load"
IMAGE_BUILD_TIMEOUT_S = 900


def locked_versions() -> dict[str, str]:
    text = (ROOT / "images" / "operator-requirements.txt").read_text()
    return {m[0].lower(): m[1] for m in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def test_operator_lock_pins_what_the_operator_extra_pins_and_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = locked_versions()
    for line in project["dependencies"] + project["optional-dependencies"]["operator"]:
        req = Requirement(line)
        name = req.name.lower()
        assert name in locked, f"{name} (pyproject) is missing from images/operator-requirements.txt"
        assert req.specifier.contains(locked[name]), f"{name}: pyproject says {req.specifier}, the lock {locked[name]}"
    assert not {n for n in locked if n in {"torch", "vllm", "triton", "numpy"} or n.startswith("nvidia-")}
    # Every pin carries a hash: images/build installs with --require-hashes.
    text = (ROOT / "images" / "operator-requirements.txt").read_text()
    assert text.count("==") == len(locked) and len(re.findall(r"==\S+ \\\n\s+--hash=sha256:", text)) == len(locked)


def copy_inputs(dest: Path) -> Path:
    """The files images/build reads, in a tree of their own (so a test can edit them)."""
    for rel in ("images", "operator", "runtime", "charts/kvtier/Chart.yaml", "pyproject.toml", "README.md"):
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def image_hash(tree: Path, name: str) -> str:
    return subprocess.run(
        [str(tree / "images" / "build"), "--hash", name], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_the_cache_key_follows_content_not_timestamps(tmp_path: Path) -> None:
    tree = copy_inputs(tmp_path / "repo")
    base, operator = image_hash(tree, "base"), image_hash(tree, "operator")
    source = next((tree / "operator").rglob("cli.py"))
    os.utime(source, (1, 1))
    assert (image_hash(tree, "base"), image_hash(tree, "operator")) == (base, operator)
    source.write_text(source.read_text() + "\n# changed\n")
    assert image_hash(tree, "operator") != operator and image_hash(tree, "base") == base
    lock = tree / "images" / "operator-requirements.txt"
    lock.write_text(lock.read_text() + "\n")
    changed = image_hash(tree, "operator")
    assert changed != operator
    # The operator image is built on the base one: a base input change rebuilds both.
    script = tree / "images" / "build"
    script.write_text(script.read_text().replace("base_packages=python3", "base_packages=python3,busybox"))
    assert image_hash(tree, "base") != base and image_hash(tree, "operator") != changed


def test_a_missing_image_is_one_line_naming_the_image_and_the_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(LOAD), str(tmp_path / "cp"), "operator"],
        capture_output=True,
        text=True,
        env={**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "empty")},
        timeout=60,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "ghcr.io/kvtier/kvtier-operator:" in lines[0] and "images/build operator" in lines[0]


def build_images(*names: str) -> list[Path]:
    proc = subprocess.run([str(BUILD), *names], stdout=subprocess.PIPE, text=True, timeout=IMAGE_BUILD_TIMEOUT_S)
    assert proc.returncode == 0, "images/build failed (its output is above)"
    return [Path(p) for p in proc.stdout.split()]


@pytest.mark.controlplane
@pytest.mark.node
@pytest.mark.slow
def test_images_run_on_the_node_as_declared(tmp_path: Path) -> None:
    require_node()
    build()
    build_node()
    first = build_images("base", "operator")
    # Cached: the same archives, not rebuilt.
    mtimes = [p.stat().st_mtime for p in first]
    assert build_images("base", "operator") == first and [p.stat().st_mtime for p in first] == mtimes
    cp_dir = tmp_path / "cp"
    kubeconfig = start(cp_dir, owner_pid=os.getpid())
    try:
        start_node(cp_dir, owner_pid=os.getpid())
        subprocess.run([str(LOAD), str(cp_dir), "base", "operator"], check=True, timeout=300)
        operator_ref = subprocess.run([str(BUILD), "--name", "operator"], capture_output=True, text=True, check=True).stdout.strip()
        with ControlPlane(kubeconfig=kubeconfig).api_client() as api:
            core = client.CoreV1Api(api)
            wait_until(lambda: core.list_namespaced_service_account("default").items, 30, "default ServiceAccount")
            pods = {
                # The base image: sh and python3.
                "base": {"image": "kvtier.local/base:bookworm", "command": ["/bin/sh", "-c", "python3 -c 'import sys; print(sys.version_info[:2])'"]},
                # The operator image as the chart runs it: its own user, read-only root filesystem, kvtier on PATH.
                "operator": {"image": operator_ref, "args": ["--help"], "securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True}},
                "operator-sh": {"image": operator_ref, "command": ["/bin/sh", "-c", "id -u; python3 -c 'import kopf, kubernetes, kvtier_operator'"]},
            }
            for name, container in pods.items():
                core.create_namespaced_pod(
                    "default",
                    {
                        "metadata": {"name": name},
                        "spec": {
                            "restartPolicy": "Never",
                            "automountServiceAccountToken": False,
                            "containers": [{"name": "main", "imagePullPolicy": "Never", **container}],
                        },
                    },
                )
            logs = {}
            for name in pods:
                phase = wait_until(
                    lambda name=name: (p := core.read_namespaced_pod(name, "default").status.phase) in ("Succeeded", "Failed") and p,
                    180,
                    f"pod {name} to finish",
                )
                logs[name] = core.read_namespaced_pod_log(name, "default")
                assert phase == "Succeeded", f"{name}: {phase}: {logs[name]!r}"
        assert logs["base"].strip() == "(3, 11)"
        assert "usage: kvtier" in logs["operator"]
        assert logs["operator-sh"].strip() == "65532"
    finally:
        stop_node(cp_dir)
        stop(cp_dir)
