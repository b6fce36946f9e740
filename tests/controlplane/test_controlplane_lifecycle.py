"""`e2e/controlplane/run` leaves nothing behind: `stop` ends every process it started, and a control plane
whose owner dies (a killed pytest) stops by itself. Each test starts a control plane of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from plugins.controlplane import RUN, start, stop

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


def process_group(pgid: int) -> list[int]:
    """PIDs (not zombies) whose process group is `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def wait_gone(pgid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := process_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def api_port(state_dir: Path) -> int:
    return int((state_dir / "ready").read_text().strip().rsplit(":", 1)[1])


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_stop_ends_every_process(tmp_path: Path) -> None:
    state = tmp_path / "cp"
    kubeconfig = start(state, owner_pid=os.getpid())
    assert kubeconfig == state / "kubeconfig" and kubeconfig.is_file()
    pid = int((state / "controlplane.pid").read_text())
    port = api_port(state)
    group = process_group(pid)
    assert len(group) == 2, f"expected the launcher and kube-controller-manager, got {group}"

    again = subprocess.run([str(RUN), "start", str(state)], capture_output=True, text=True)
    assert again.returncode != 0 and "already running" in again.stderr

    stop(state)
    assert process_group(pid) == []
    assert not accepts(port)
    status = subprocess.run([str(RUN), "status", str(state)], capture_output=True, text=True)
    assert status.returncode == 1 and status.stdout.strip() == "not running"


def test_owner_exit_stops_the_control_plane(tmp_path: Path) -> None:
    owner = subprocess.Popen(["sleep", "600"])
    state = tmp_path / "cp"
    try:
        start(state, owner_pid=owner.pid)
        pid = int((state / "controlplane.pid").read_text())
        port = api_port(state)
        assert len(process_group(pid)) == 2
    finally:
        owner.kill()
        owner.wait()
    # The launcher polls its owner twice a second and then shuts down gracefully (bounded at 20 s).
    left = wait_gone(pid, timeout_s=40)
    if left:
        stop(state)
    assert left == [], f"processes outlived their owner: {left}"
    assert not accepts(port)
