"""The end-to-end scenario on the local provider with SYNTHETIC engines, and the demo's command line.

Why synthetic here: these tests check the SLO guard's whole state machine end to end (breach, rollback, the
recovery inside the cooldown, a manual re-enable) with exact latency control and in about a minute; a real CPU
engine's latency is neither exact nor that fast. The real engine, a device really made slow and the breach it
causes are tests/e2e/test_scenario_real.py.

Real parts: kube-apiserver + etcd + kube-controller-manager (e2e/controlplane), a node (e2e/node: containerd,
runc, the CNI bridge, a kubelet) that runs the Deployment's pods from the operator image, fed the rendered
engine.yaml through the ConfigMap volume the operator mounted, Prometheus (Debian's binary) scraping the pods at
their IPs, the operator as a pod installed by its chart from the operator image. The node needs root: without it
these tests skip (KVTIER_REQUIRE_NODE=1 makes that a failure). A failure prints the operator log, events, policy status and pod logs.
"""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from plugins.node import require_node
from plugins.processes import like_a_terminal_job, processes_mentioning
from plugins.prometheus import require_prometheus
from scenario.local import LocalOptions
from scenario.manifests import Names
from scenario.processes import Supervisor
from scenario.report import Reporter
from scenario.steps import ScenarioFailed, run_local

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.prometheus, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_local_scenario_rolls_back_the_newest_tier_and_re_enables_it(tmp_path):
    """The scenario with its own control plane and node: the kubelet starts, rolls and stops the pods."""
    require_prometheus()
    require_node()
    names = Names(namespace=f"e2e-{uuid.uuid4().hex[:6]}")
    supervisor = Supervisor()
    out = io.StringIO()
    options = LocalOptions(repo=REPO, workdir=tmp_path / "demo", names=names, seed=7)
    try:
        timings = run_local(options, Reporter(out, color=False, consecutive=3), supervisor)
    except ScenarioFailed as err:
        pytest.fail(f"{out.getvalue()}\n{err}\n{err.diagnostics}", pytrace=False)
    print(out.getvalue())
    print(f"timings: {timings}")
    # Three evaluations 2 s apart once the 6 s window shows the breach; generous for a loaded 2-core machine.
    assert 3.5 < timings.breach_to_disable < 30
    assert timings.reenable < 20
    # The kubelet ran three pods in turn (start, rollback, re-enable), each Ready on the node at its own IP.
    ready = re.findall(r"pod (llama-demo-\S+) Ready on the node at (10\.\d+\.\d+\.\d+)", out.getvalue())
    assert len({name for name, _ in ready}) >= 3, ready
    # The operator ran as a pod (its chart); its log was saved from the API server before the node stopped.
    assert "operator running as pod kvtier-system/" in out.getvalue()
    # It logs each user-visible transition once (kopf's per-event lines are off without --verbose).
    operator_log = (tmp_path / "demo" / "operator.log").read_text()
    assert ": ConfigApplied: " in operator_log, operator_log[-3000:]
    assert ": TierDisabled: disabled tier nvme" in operator_log, operator_log[-3000:]
    # Everything it started has stopped: Prometheus (the one host process), the node (containerd, kubelet, the
    # pods' shims and processes) and the control plane.
    assert [s.name for s in supervisor.started] == ["prometheus"]
    assert [s.name for s in supervisor.started if s.process.poll() is None] == []
    assert supervisor.errors == []
    assert processes_mentioning(str(tmp_path / "demo")) == []
    assert not (tmp_path / "demo" / "controlplane" / "node" / "containerd").exists()


def run_demo(workdir: Path, interrupt_at: str | None = None, timeout: float = 240) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")]),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier_operator.cli", "demo", "--workdir", str(workdir),
                             "--no-color", "--namespace", "demo", "--engine", "synthetic"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            preexec_fn=like_a_terminal_job)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if interrupt_at and line.startswith(interrupt_at):
                proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
                interrupt_at = None
            if time.monotonic() > deadline:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, "".join(lines)


def test_kvtier_demo_runs_the_scenario_with_its_own_control_plane_and_leaves_nothing_running(tmp_path):
    require_prometheus()
    require_node()
    started = time.monotonic()
    rc, out = run_demo(tmp_path / "demo")
    print(out)
    print(f"kvtier demo took {time.monotonic() - started:.1f}s")
    assert rc == 0, out
    for step in range(1, 8):
        assert f"[{step}/7]" in out
    assert "event Warning TierDisabled: disabled tier nvme" in out
    assert "nvme is back" in out and "Every process it started has stopped" in out
    assert "Traceback" not in out
    assert processes_mentioning(str(tmp_path / "demo")) == []
    assert (tmp_path / "demo" / "operator.log").stat().st_size > 0
    assert not (tmp_path / "demo" / "controlplane" / "etcd").exists()


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    require_prometheus()
    require_node()
    rc, out = run_demo(tmp_path / "demo", interrupt_at="[5/7]")
    print(out)
    assert rc == 130, out
    assert "interrupted; every process it started was stopped" in out
    assert "Traceback" not in out
    assert processes_mentioning(str(tmp_path / "demo")) == []
