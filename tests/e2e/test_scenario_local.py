"""The end-to-end scenario on the local provider with SYNTHETIC engines, and the demo's command line.

Why synthetic here: these tests check the SLO guard's whole state machine end to end (breach, rollback, the
recovery inside the cooldown, a manual re-enable) with exact latency control and in about a minute; a real CPU
engine's latency is neither exact nor that fast. The real engine, a device really made slow and the breach it
causes are tests/e2e/test_scenario_real.py.

Real parts: kube-apiserver + etcd + kube-controller-manager (e2e/controlplane), Prometheus (Debian's binary),
the operator as a process. Stand-in: the pods, which no kubelet runs here; they are synthetic engine processes
fed the rendered engine.yaml through the Deployment's own volume and mount (e2e/scenario/kubelet.py).
A failure prints the operator log, events, policy status and pod logs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from scenario.local import LocalOptions
from scenario.manifests import Names
from scenario.processes import Supervisor
from scenario.report import Reporter
from scenario.steps import ScenarioFailed, run_local
from plugins.prometheus import require_prometheus
from plugins.processes import processes_mentioning

pytestmark = [pytest.mark.controlplane, pytest.mark.prometheus, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_local_scenario_rolls_back_the_newest_tier_and_re_enables_it(controlplane, tmp_path):
    require_prometheus()
    names = Names(namespace=f"e2e-{uuid.uuid4().hex[:6]}")
    supervisor = Supervisor()
    options = LocalOptions(repo=REPO, workdir=tmp_path, kubeconfig=controlplane.kubeconfig, names=names, seed=7)
    try:
        timings = run_local(options, Reporter(sys.stdout, color=False, consecutive=3), supervisor)
    except ScenarioFailed as err:
        pytest.fail(f"{err}\n{err.diagnostics}", pytrace=False)
    print(f"timings: {timings}")
    # Three evaluations 2 s apart once the 6 s window shows the breach; generous for a loaded 2-core machine.
    assert 3.5 < timings.breach_to_disable < 30
    assert timings.reenable < 20
    # Everything it started has stopped: the operator, Prometheus, every pod (including the rolled ones).
    assert len(supervisor.started) >= 5  # operator, prometheus, and three pods (start, rollback, re-enable)
    assert [s.name for s in supervisor.started if s.process.poll() is None] == []
    assert supervisor.errors == []
    with controlplane.api_client() as api:
        from kubernetes import client
        phase = None
        try:
            phase = client.CoreV1Api(api).read_namespace(names.namespace).status.phase
        except client.ApiException as err:
            assert err.status == 404
        assert phase in (None, "Terminating"), "the scenario deletes its namespace"


def run_demo(workdir: Path, interrupt_at: str | None = None, timeout: float = 240) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")]),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier_operator.cli", "demo", "--workdir", str(workdir),
                             "--no-color", "--namespace", "demo", "--engine", "synthetic"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
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
    rc, out = run_demo(tmp_path / "demo", interrupt_at="[5/7]")
    print(out)
    assert rc == 130, out
    assert "interrupted; every process it started was stopped" in out
    assert "Traceback" not in out
    assert processes_mentioning(str(tmp_path / "demo")) == []
