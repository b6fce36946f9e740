"""scripts/lib/beside.sh: a build run beside the env installs (scripts/setup, .ci/test-envs) must fail the script
when it fails, and must not outlive a script that stops early.

The defect this guards against: a build run as `log "...: $(build)"` hid the build's exit status, so a failed
control-plane build let setup succeed; and a background build left running after Ctrl-C keeps both cores busy.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = ROOT / "scripts" / "lib" / "beside.sh"


def _script(body: str) -> list[str]:
    return ["bash", "-c", f"set -euo pipefail\n. {LIB}\n{body}"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (reaped by init later) counts as gone.
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_a_successful_build_prefixes_its_lines_and_the_script_goes_on() -> None:
    proc = subprocess.run(_script("beside_start b 'the build' 'echo built'\necho foreground\nbeside_wait\necho after"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[b] built" in proc.stderr
    assert proc.stdout.split() == ["foreground", "after"]


def test_a_failure_inside_a_command_substitution_fails_the_script_and_names_the_build() -> None:
    proc = subprocess.run(_script("beside_start b 'the build' 'x=$(false); echo never $x'\nbeside_wait\necho after"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "never" not in proc.stderr and "after" not in proc.stdout
    assert "the build failed (its [b] lines above say why)" in proc.stderr


def test_a_script_that_fails_before_waiting_stops_the_build(tmp_path: pathlib.Path) -> None:
    pidfile = tmp_path / "pid"
    body = (f"beside_start b 'the build' 'sleep 60 & echo $! > {pidfile}; wait'\n"
            f"while [ ! -s {pidfile} ]; do sleep 0.05; done\nfalse\nbeside_wait")
    proc = subprocess.run(_script(body), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the build's child outlived the script"


def test_sigterm_while_waiting_stops_the_build(tmp_path: pathlib.Path) -> None:
    pidfile, waiting = tmp_path / "pid", tmp_path / "waiting"
    # The signal is sent once the script is past beside_start (it wrote `waiting`) and the build's child runs.
    body = f"beside_start b 'the build' 'sleep 60 & echo $! > {pidfile}; wait'\n: > {waiting}\nbeside_wait"
    proc = subprocess.Popen(_script(body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not (waiting.exists() and pidfile.exists() and pidfile.read_text().strip()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the build's child outlived the script"
