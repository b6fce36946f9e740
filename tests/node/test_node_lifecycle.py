"""`e2e/node/run`: a real node joins the control plane, runs pods that reach the API server and each other, and
leaves nothing on the host when it stops: after `stop`, and after its owner is SIGKILLed (a killed pytest or
make). "Nothing" is every kind of host state a node makes: processes, mounts, network namespaces, veths and the
bridge, nat rules, cgroups, CNI state, and the sysctls it set. Each test starts a control plane and node of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client
from plugins.controlplane import ControlPlane, build, start, stop
from plugins.node import (
    BUSYBOX_IMAGE,
    NODE_NAME,
    Node,
    build_node,
    busybox_image,
    require_node,
    start_node,
    stop_node,
    wait_until,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.slow]

# What the kubelet needs set and this repository's node sets and restores (e2e/node/run kubelet_sysctls).
KUBELET_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops")


def sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", *k.split(".")).read_text().strip() for k in KUBELET_SYSCTLS}


def host_state(node_dir: Path) -> dict[str, list[str]]:
    """Every trace of one node on the host, by kind; all lists are empty when nothing is left."""
    node_id = (node_dir / "id").read_text().strip()
    run_dir = f"/run/kvtier-node/{node_id}"
    lib_dir = f"/var/lib/kvtier-node/{node_id}"
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith((str(node_dir) + "/", run_dir + "/", lib_dir + "/")) or line.split()[4] in (str(node_dir), lib_dir)
    ]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    bridge = f"kvt-{node_id}"
    net = [line for line in links.splitlines() if bridge in line]
    nat = subprocess.run(["iptables", "-w", "10", "-t", "nat", "-S"], capture_output=True, text=True, check=True).stdout
    rules = [line for line in nat.splitlines() if f"KVT-{node_id}" in line]
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/kvtier-node-{node_id}")]
    processes = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(node_dir) in cmdline or run_dir in cmdline or lib_dir in cmdline:
            processes.append(f"{entry.name}: {cmdline[:200]}")
    cni = [str(p) for p in Path("/var/lib/cni/results").glob(f"kvtier-{node_id}-*")] if Path("/var/lib/cni/results").is_dir() else []
    state = [d for d in (run_dir, lib_dir) if Path(d).exists()]
    return {"mounts": mounts, "links": net, "nat": rules, "cgroups": cgroups, "processes": processes, "cni": cni, "state": state}


def nothing_left(node_dir: Path) -> bool:
    return not any(host_state(node_dir).values())


def run_pod(core: client.CoreV1Api, namespace: str, name: str, script: str) -> None:
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", script]}
                ],
            },
        },
    )


def pod_phase(core: client.CoreV1Api, namespace: str, name: str) -> str:
    return core.read_namespaced_pod(name, namespace).status.phase


@pytest.fixture
def cluster(tmp_path: Path):
    require_node()
    build()
    build_node()
    # A long cluster directory (as pytest's tmp paths are, and users' may be): nothing the node puts in it may be
    # a unix socket, whose path must stay under 108 bytes.
    cp_dir = tmp_path / ("a-long-cluster-directory-" * 3) / "cp"
    kubeconfig = start(cp_dir, owner_pid=os.getpid())
    try:
        start_node(cp_dir, owner_pid=os.getpid())
        yield ControlPlane(kubeconfig=kubeconfig, state_dir=cp_dir), Node(cp_dir)
    finally:
        stop_node(cp_dir)
        stop(cp_dir)


def test_pods_run_reach_the_api_server_and_each_other_and_stop_leaves_nothing(cluster, tmp_path: Path) -> None:
    cp, node = cluster
    before = sysctls()
    node.load_image(busybox_image(tmp_path))
    with cp.api_client() as api:
        core = client.CoreV1Api(api)
        ready = [c.status for c in core.read_node(NODE_NAME).status.conditions if c.type == "Ready"]
        assert ready == ["True"]
        core.create_namespace({"metadata": {"name": "nodetest"}})
        wait_until(lambda: core.list_namespaced_service_account("nodetest").items, 30, "default ServiceAccount")
        # A plain HTTP request to the "kubernetes" Service: a Go TLS server answers it with this exact sentence,
        # so the reply proves the pod reached the API server through the Service address.
        run_pod(core, "nodetest", "api", "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 10.96.0.1 443")
        run_pod(core, "nodetest", "server", "echo pong | nc -l -p 8080")
        server_ip = wait_until(lambda: core.read_namespaced_pod("server", "nodetest").status.pod_ip, 120, "server pod IP")
        run_pod(core, "nodetest", "client", f"for i in 1 2 3 4 5 6 7 8 9 10; do nc -w 3 {server_ip} 8080 </dev/null && exit 0; sleep 1; done; exit 1")
        for name in ("api", "client", "server"):
            phase = wait_until(
                lambda name=name: pod_phase(core, "nodetest", name) in ("Succeeded", "Failed") and pod_phase(core, "nodetest", name),
                120,
                f"pod {name} to finish",
            )
            log = core.read_namespaced_pod_log(name, "nodetest")
            assert phase == "Succeeded", f"pod {name}: {phase}, log: {log!r}"
            if name == "api":
                assert "Client sent an HTTP request to an HTTPS server" in log
            if name == "client":
                assert log.strip() == "pong"
    state = host_state(node.dir)
    assert state["mounts"] and state["links"] and state["nat"] and state["cgroups"] and state["processes"]

    stop_node(node.cp_dir)
    assert host_state(node.dir) == {k: [] for k in state}
    assert sysctls() == before or not Path("/run/kvtier-node/sysctl.saved").exists()


def test_owner_sigkill_tears_the_node_down(tmp_path: Path) -> None:
    require_node()
    build()
    build_node()
    owner = subprocess.Popen(["sleep", "600"])
    cp_dir = tmp_path / "cp"
    try:
        kubeconfig = start(cp_dir, owner_pid=owner.pid)
        start_node(cp_dir, owner_pid=owner.pid)
        node = Node(cp_dir)
        node.load_image(busybox_image(tmp_path))
        with ControlPlane(kubeconfig=kubeconfig).api_client() as api:
            core = client.CoreV1Api(api)
            wait_until(lambda: core.list_namespaced_service_account("default").items, 30, "default ServiceAccount")
            run_pod(core, "default", "sleeper", "sleep 600")
            wait_until(lambda: pod_phase(core, "default", "sleeper") == "Running", 120, "pod Running")
        assert all(host_state(node.dir)[k] for k in ("mounts", "links", "nat", "cgroups", "processes"))
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        left = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            left = host_state(node.dir)
            if not any(left.values()):
                break
            time.sleep(0.5)
        assert not any(left.values()), json.dumps(left, indent=1)
    finally:
        if owner.poll() is None:
            owner.kill()
        stop_node(cp_dir)
        stop(cp_dir)


def test_a_start_after_the_supervisor_was_sigkilled_clears_its_leftovers_first(tmp_path: Path) -> None:
    """The supervisor itself killed (not its owner): containerd, the kubelet and the bridge outlive it. The next
    start in that directory removes them before it sets up (or it would fail on the existing bridge), and the
    node it starts stops cleanly."""
    require_node()
    build()
    build_node()
    cp_dir = tmp_path / "cp"
    start(cp_dir, owner_pid=os.getpid())
    try:
        start_node(cp_dir, owner_pid=os.getpid())
        node_dir = cp_dir / "node"
        supervisor = int((node_dir / "supervisor.pid").read_text())
        os.kill(supervisor, signal.SIGKILL)
        time.sleep(1)
        left = host_state(node_dir)
        assert left["links"] and left["processes"], "a SIGKILLed supervisor leaves its node running"
        start_node(cp_dir, owner_pid=os.getpid())
        with ControlPlane(kubeconfig=cp_dir / "kubeconfig").api_client() as api:
            ready = [c.status for c in client.CoreV1Api(api).read_node(NODE_NAME).status.conditions if c.type == "Ready"]
        assert ready == ["True"]
        stop_node(cp_dir)
        assert not any(host_state(node_dir).values()), json.dumps(host_state(node_dir), indent=1)
    finally:
        stop_node(cp_dir)
        stop(cp_dir)
