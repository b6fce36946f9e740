"""The scenario's slow device (e2e/scenario/slowdisk.py): it really is slow when asked, healthy otherwise, and
nothing it sets up (loop device, device-mapper table, cgroup, mount, processes) outlives a run: not on success,
not on Ctrl-C, and after a SIGKILL the next run removes the leftovers.

Needs root and a loop device plus device-mapper or a cgroup v1 blkio hierarchy; skipped, with the probe's
reasons, elsewhere."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugins.processes import like_a_terminal_job
from scenario import slowdisk

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _require_mechanism() -> None:
    problems = [p for p in (slowdisk.probe_loop(), slowdisk.probe_dm() and slowdisk.probe_blkio()) if p]
    if problems:
        pytest.skip(f"no slow-device mechanism here: {problems}")


def _timed_direct_reads(disk: slowdisk.SlowDisk, path: Path, count: int) -> float:
    """Seconds for ``count`` 64 KiB O_DIRECT reads by a process started the way the scenario starts the engine."""
    started = time.monotonic()
    subprocess.run(disk.wrap(["dd", f"if={path}", "of=/dev/null", "bs=64k", f"count={count}", "iflag=direct"]),
                   check=True, capture_output=True, timeout=120)
    return time.monotonic() - started


def test_the_device_is_slow_only_while_slowed_and_leaves_nothing(tmp_path):
    _require_mechanism()
    disk = slowdisk.SlowDisk(tmp_path / "disk", size_bytes=64 << 20, say=lambda _: None)
    disk.setup()
    try:
        assert disk.mechanism in ("dm-delay", "blkio-throttle") and disk.why
        data = disk.mount / "blocks"
        data.write_bytes(os.urandom(4 << 20))
        healthy = _timed_direct_reads(disk, data, 24)
        disk.slow()
        slow = _timed_direct_reads(disk, data, 24)
        disk.heal()
        healed = _timed_direct_reads(disk, data, 24)
        print(f"{disk.mechanism}: 24 direct reads healthy {healthy:.3f}s, slowed {slow:.3f}s, healed {healed:.3f}s")
        # 24 requests at 2 IOPS (or 500 ms each) take about 10 s (the throttle lets a short burst through); healthy,
        # milliseconds.
        assert slow > 5 and slow > 5 * healthy and healed < slow / 5
    finally:
        disk.close()
    assert slowdisk.leftovers() == []
    assert not disk.image.exists()


def _hold(workdir: Path) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "e2e"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scenario.slowdisk", "--hold", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=like_a_terminal_job)
    assert proc.stdout is not None
    child = 0
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("CHILD "):
            child = int(line.split()[1])
            break
        assert time.monotonic() < deadline, "the holder did not set up in time"
    assert child, "the holder exited before setting up: " + (proc.stdout.read() if proc.poll() is not None else "")
    return proc, child


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_ctrl_c_tears_everything_down(tmp_path):
    _require_mechanism()
    proc, child = _hold(tmp_path / "held")
    assert slowdisk.leftovers() != []
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert "CLEAN" in out and "Traceback" not in out, out
    assert slowdisk.leftovers() == []
    assert _gone(child), "the process started inside the slowed device's cgroup was stopped"


def test_after_a_sigkill_the_next_run_removes_the_leftovers(tmp_path):
    _require_mechanism()
    proc, child = _hold(tmp_path / "killed")
    proc.kill()
    proc.wait(timeout=30)
    left = slowdisk.leftovers()
    assert left != [], "a SIGKILLed run cannot clean up; this test needs something left to reap"
    reaped = slowdisk.reap_leftovers()  # what the next SlowDisk.setup() does first
    print(reaped)
    assert reaped and slowdisk.leftovers() == []
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the orphan in the cgroup was killed before the cgroup was removed"


def test_the_reap_kills_a_process_that_joins_the_cgroup_after_the_kill_pass(tmp_path, monkeypatch):
    """The class of the SIGKILL leftover: wrap() starts a process outside the cgroup and it moves itself in, so a
    reap right after the kill can find the cgroup empty and then busy. Here the joiner is released in the middle
    of the teardown (after the kill pass, before the cgroup is removed), every time."""
    if os.geteuid() != 0 or slowdisk.probe_blkio():
        pytest.skip(f"needs root and a cgroup v1 blkio hierarchy: {slowdisk.probe_blkio()}")
    cgroup = Path("/sys/fs/cgroup/blkio") / f"{slowdisk.PREFIX}latejoin-{os.getpid()}"
    cgroup.mkdir()
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    joiner = subprocess.Popen(["sh", "-c", f'read _ < {fifo}; echo $$ > {cgroup}/cgroup.procs && exec sleep 600'],
                              start_new_session=True)
    try:
        def mounted_check_that_releases_the_joiner(_path):
            fifo.write_text("go\n")
            deadline = time.monotonic() + 10
            while str(joiner.pid) not in (cgroup / "cgroup.procs").read_text().split():
                assert time.monotonic() < deadline, "the joiner did not join"
                time.sleep(0.01)
            return False

        monkeypatch.setattr(slowdisk, "_is_mounted", mounted_check_that_releases_the_joiner)
        problems = slowdisk._teardown({"cgroup": str(cgroup), "mount": str(tmp_path / "mnt")})
        assert problems == [] and not cgroup.exists()
        assert joiner.wait(timeout=10) == -signal.SIGKILL
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()
        if cgroup.exists():
            cgroup.rmdir()
