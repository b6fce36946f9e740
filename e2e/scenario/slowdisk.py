"""A filesystem on a block device that the scenario can make slow on demand: the newest tier's volume.

The breach in the scenario is caused, not injected into metrics: the engine's filesystem tier lives on this
device, and ``slow()`` makes the device itself slow. Mechanisms, probed in this order, the first that works wins
(``SlowDisk.mechanism`` and ``SlowDisk.why`` say which and why; the scenario prints both):

1. ``dm-delay``: device-mapper's ``delay`` target over a loop device (needs the kernel's device-mapper driver).
   Healthy it is a ``linear`` table; ``slow()`` swaps in a ``delay`` table (every read waits).
2. ``blkio-throttle``: a loop device (direct I/O to its backing file) throttled by cgroup v1 ``blkio``
   (``blkio.throttle.read_iops_device``). Only processes inside a throttled group are slowed. On the node
   (``container_cgroups`` given) the limit goes on every container cgroup of the node's pods, where the engine's
   processes are: cgroup v1 throttling is not hierarchical here (a limit on the pod's cgroup left a container's
   reads unthrottled), and a restarted container gets a new cgroup, so ``enforce()`` applies it to new ones
   after every (re)start. Without a node the device has a group of its own and ``wrap()`` starts a process in
   it. The kvtier fs tier writes and reads with O_DIRECT, so its I/O is submitted by the engine's own threads and
   counted against their group (buffered writeback would not be).

Only reads are slowed: they are what a request waits for (a load from the tier). Slowed writes would queue up
the tier's write-through stores behind the throttle, and a process waiting on throttled I/O cannot be killed
until it is served, which would stall the very rollback the scenario shows. Both need root. Nothing else is tried: an I/O fault injected in the tier's own code would not be a slow device.

Everything set up is torn down by ``close()`` (processes left in the cgroup are killed first), also on Ctrl-C
through the scenario's Supervisor. A run killed with SIGKILL cannot clean up: every resource carries the name
``kvtier-slowdisk-<pid>`` and a state file, and the next run (or ``python -m scenario.slowdisk --reap``) removes
the leftovers of owners that are gone (``reap_leftovers()``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PREFIX = "kvtier-slowdisk-"
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
STATE_DIR = Path("/run/kvtier-slowdisk") if Path("/run").is_dir() else Path("/tmp/kvtier-slowdisk")
SECTOR = 512
# Slow: every read waits this long on dm-delay; the throttle allows this many reads a second.
DELAY_MS = 500
IOPS = 2


class SlowDiskUnavailable(RuntimeError):
    """No mechanism works on this machine; the message lists why for each."""


def _run(cmd: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def _check(cmd: Sequence[str], timeout: float = 60) -> str:
    proc = _run(cmd, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:] or proc.returncode}")
    return proc.stdout.strip()


# ---------------------------------------------------------------------------------------------- probes

def probe_dm() -> Optional[str]:
    """None if device-mapper can be used, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("dmsetup") is None:
        return "dmsetup is not installed"
    misc = Path("/proc/misc").read_text() if Path("/proc/misc").exists() else ""
    if "device-mapper" not in misc:
        detail = _run(["dmsetup", "version"]).stderr.strip().splitlines()
        return ("the kernel has no device-mapper driver (/proc/misc lists none"
                + (f"; dmsetup: {detail[0]}" if detail else "") + ")")
    targets = _run(["dmsetup", "targets"])
    if targets.returncode != 0:
        return f"dmsetup targets failed: {targets.stderr.strip()}"
    # The delay target is a module; a `dmsetup create` would load it, but only if modules can be loaded.
    if "delay" not in targets.stdout.split() and _run(["modprobe", "dm-delay"]).returncode != 0:
        return "the kernel's device-mapper has no delay target and modprobe dm-delay failed"
    return None


def probe_blkio() -> Optional[str]:
    """None if a cgroup v1 blkio throttle can be used on a loop device, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not (BLKIO_ROOT / "blkio.throttle.read_iops_device").exists():
        return f"no cgroup v1 blkio hierarchy with throttling at {BLKIO_ROOT}"
    if shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        return "losetup or mkfs.ext4 is not installed"
    return None


def probe_loop() -> Optional[str]:
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control (no loop devices)"
    return None


# ---------------------------------------------------------------------------------------------- the device

@dataclass
class SlowDisk:
    """A mounted filesystem on a loop device (under ``workdir``) that ``slow()`` slows and ``heal()`` restores."""

    workdir: Path
    size_bytes: int = 1 << 30
    say: Callable[[str], None] = print
    mechanism: str = ""
    why: str = ""
    image: Path = field(init=False)
    mount: Path = field(init=False)
    loop: Optional[str] = None
    dm_name: Optional[str] = None
    cgroup: Optional[Path] = None
    mounted: bool = False
    is_slow: bool = False
    # The node's container cgroups (blkio): the throttle goes on these instead of a group of the device's own.
    container_cgroups: Optional[Callable[[], list[Path]]] = None

    def __post_init__(self) -> None:
        self.name = f"{PREFIX}{os.getpid()}"
        self.image = self.workdir / f"{self.name}.img"
        self.mount = self.workdir / "mnt"
        self.state_file = STATE_DIR / f"{self.name}.json"
        self._throttled: dict[Path, int] = {}    # container cgroup -> the limit written there
        self._reads: dict[Path, int] = {}        # container cgroup -> reads it was served (last seen)

    # -- set-up
    def setup(self) -> SlowDisk:
        """Probe, choose and set up; on any failure, undo what was done and raise SlowDiskUnavailable."""
        reaped = reap_leftovers()
        if reaped:
            self.say(f"removed what an earlier, killed run left behind: {'; '.join(reaped)}")
        loop_problem = probe_loop()
        dm_problem = loop_problem or probe_dm()
        blkio_problem = loop_problem or probe_blkio()
        if dm_problem is None:
            self.mechanism = "dm-delay"
            self.why = f"device-mapper delay target ({DELAY_MS} ms a read when slow) over a loop device"
        elif blkio_problem is None:
            self.mechanism = "blkio-throttle"
            self.why = (f"device-mapper delay is unavailable ({dm_problem}), so a cgroup v1 blkio throttle "
                        f"({IOPS} reads a second when slow) on a loop device"
                        + (", set on the node's container cgroups (re-applied after every container start)"
                           if self.container_cgroups is not None else ""))
        else:
            raise SlowDiskUnavailable(f"no way to make a device slow here: device-mapper delay: {dm_problem}; "
                                      f"cgroup v1 blkio throttle: {blkio_problem}")
        try:
            self._setup_device()
        except BaseException:
            self.close()
            raise
        return self

    def _save_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"owner": os.getpid(), "image": str(self.image), "mount": str(self.mount) if self.mounted else None,
                 "loop": self.loop, "dm": self.dm_name, "cgroup": str(self.cgroup) if self.cgroup else None}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def _setup_device(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._save_state()  # first: a kill from here on leaves something the next run can find
        with open(self.image, "wb") as f:
            f.truncate(self.size_bytes)
        # direct-io: the loop device reads its backing file without a second page cache, so a throttled request
        # is a real wait, not a cache hit.
        self.loop = _check(["losetup", "--find", "--show", "--direct-io=on", str(self.image)])
        self._save_state()
        device = self.loop
        if self.mechanism == "dm-delay":
            self.dm_name = self.name
            self._save_state()
            _check(["dmsetup", "create", self.dm_name, "--table", self._linear_table()])
            device = f"/dev/mapper/{self.dm_name}"
        elif self.container_cgroups is None:
            self.cgroup = BLKIO_ROOT / self.name
            self.cgroup.mkdir(exist_ok=True)
            self._save_state()
        _check(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device], timeout=120)
        self.mount.mkdir(parents=True, exist_ok=True)
        _check(["mount", device, str(self.mount)])
        self.mounted = True
        self._save_state()

    def _sectors(self) -> int:
        return self.size_bytes // SECTOR

    def _linear_table(self) -> str:
        return f"0 {self._sectors()} linear {self.loop} 0"

    def _delay_table(self) -> str:
        return f"0 {self._sectors()} delay {self.loop} 0 {DELAY_MS} {self.loop} 0 0"  # reads slow, writes not

    def _majmin(self) -> str:
        assert self.loop is not None
        st = os.stat(self.loop)
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"

    # -- the engine runs inside it (blkio) -- nothing to do for dm-delay, which slows every process
    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` started inside the throttled cgroup (its children inherit it); unchanged for dm-delay."""
        if self.cgroup is None:
            return list(cmd)
        return ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]

    # -- slow and healthy
    def slow(self) -> None:
        if self.mechanism == "dm-delay":
            self._swap_table(self._delay_table())
        else:
            self._throttle(IOPS)
        self.is_slow = True

    def heal(self) -> None:
        if self.mechanism == "dm-delay":
            self._swap_table(self._linear_table())
        else:
            self._throttle(0)  # 0 removes the limit
        self.is_slow = False

    def _swap_table(self, table: str) -> None:
        assert self.dm_name is not None
        _check(["dmsetup", "reload", self.dm_name, "--table", table])
        _check(["dmsetup", "suspend", self.dm_name])
        _check(["dmsetup", "resume", self.dm_name])

    def _throttle(self, iops: int) -> None:
        if self.container_cgroups is not None:
            self._limit = iops
            self._throttled.clear()
            self.enforce()
            return
        assert self.cgroup is not None
        (self.cgroup / "blkio.throttle.read_iops_device").write_text(f"{self._majmin()} {iops}\n")

    def enforce(self) -> list[Path]:
        """Node mode: the current limit on every container cgroup that does not carry it yet (a container that
        (re)started since); returns those it was applied to. Also records each group's served reads."""
        if self.container_cgroups is None or self.loop is None or self.mechanism != "blkio-throttle":
            return []
        applied = []
        limit = getattr(self, "_limit", 0)
        for group in self.container_cgroups():
            self._served(group)
            if self._throttled.get(group) == limit:
                continue
            try:
                (group / "blkio.throttle.read_iops_device").write_text(f"{self._majmin()} {limit}\n")
            except OSError:
                continue  # the container is gone already
            self._throttled[group] = limit
            applied.append(group)
        return applied

    def _served(self, group: Path) -> Optional[int]:
        majmin = self._majmin()
        try:
            text = (group / "blkio.throttle.io_serviced").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == majmin and parts[1] == "Read":
                self._reads[group] = max(self._reads.get(group, 0), int(parts[2]))
                return int(parts[2])
        return 0

    def reads_served(self) -> Optional[int]:
        """Reads the throttle let through so far (blkio; on the node summed over every container cgroup seen,
        gone ones included), None for dm-delay (no such count)."""
        if self.loop is None or self.mechanism != "blkio-throttle":
            return None
        if self.container_cgroups is not None:
            self.enforce()
            return sum(self._reads.values())
        if self.cgroup is None:
            return None
        return self._served(self.cgroup) or 0

    def describe(self) -> str:
        device = f"/dev/mapper/{self.dm_name} over {self.loop}" if self.dm_name else str(self.loop)
        return f"{self.mechanism}: ext4 on {device} mounted at {self.mount}"

    # -- tear-down
    def close(self) -> list[str]:
        """Undo everything (idempotent); returns problems, also raised as one error at the end."""
        problems = _teardown({"image": str(self.image), "mount": str(self.mount) if self.mounted else None,
                              "loop": self.loop, "dm": self.dm_name,
                              "cgroup": str(self.cgroup) if self.cgroup else None})
        self.mounted, self.loop, self.dm_name, self.cgroup = False, None, None, None
        if not problems:
            self.state_file.unlink(missing_ok=True)
        else:
            raise RuntimeError("; ".join(problems))
        return problems


def _kill_members(cgroup: Path) -> list[int]:
    """SIGKILL every process in ``cgroup``; returns the PIDs found ([] when it is empty or gone)."""
    try:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _teardown(state: dict) -> list[str]:
    """Kill what is left in the cgroup, unmount, remove the dm table, detach the loop device, delete the image."""
    problems: list[str] = []
    cgroup = Path(state["cgroup"]) if state.get("cgroup") else None
    if cgroup is not None and cgroup.exists():
        # Lift the throttle first: a process waiting on throttled reads cannot die until they are served.
        limits = cgroup / "blkio.throttle.read_iops_device"
        for line in limits.read_text().splitlines():
            if line.split()[:1]:
                try:
                    limits.write_text(f"{line.split()[0]} 0\n")
                except OSError:
                    pass
        # Bounded, and generous: a killed engine freeing gigabytes on a loaded machine takes seconds to exit.
        for _ in range(300):
            if not _kill_members(cgroup):
                break
            time.sleep(0.1)
    mount = state.get("mount")
    if mount and _is_mounted(mount) and _run(["umount", mount]).returncode != 0 \
            and _run(["umount", "-l", mount]).returncode != 0:
        problems.append(f"cannot unmount {mount}")
    if state.get("dm") and Path(f"/dev/mapper/{state['dm']}").exists():
        for _ in range(10):
            if _run(["dmsetup", "remove", state["dm"]]).returncode == 0:
                break
            time.sleep(0.3)
        else:
            problems.append(f"cannot remove device-mapper table {state['dm']}")
    loop = state.get("loop")
    image = state.get("image")
    if loop and image and image in _loop_backing().get(loop, ""):
        for _ in range(10):
            if _run(["losetup", "-d", loop]).returncode == 0:
                break
            time.sleep(0.3)  # the lazy unmount may still hold it for a moment
        else:
            problems.append(f"cannot detach {loop}")
    if cgroup is not None and cgroup.exists():
        for attempt in range(20):
            # A process can join after the kill above: wrap() starts it outside the cgroup and it moves itself in
            # (`echo $$ > cgroup.procs`). A run SIGKILLed just after starting one leaves it on its way in, and a
            # reap that comes at once finds the cgroup empty, then busy (EBUSY) once it has arrived. Kill late
            # joiners before every attempt; one arriving after the rmdir fails to join and exits (`&&`).
            _kill_members(cgroup)
            try:
                cgroup.rmdir()
                break
            except OSError as err:
                if attempt == 19:
                    problems.append(f"cannot remove cgroup {cgroup}: {err.strerror}")
                time.sleep(0.5)
    if image:
        Path(image).unlink(missing_ok=True)
    return problems


def _is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    return any(line.split()[1] == real for line in Path("/proc/self/mounts").read_text().splitlines())


def _loop_backing() -> dict[str, str]:
    """Loop device -> backing file, for every attached loop device."""
    proc = _run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"])
    out = {}
    for line in proc.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            out[parts[0]] = parts[1].strip()
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leftovers() -> list[str]:
    """Every kvtier-slowdisk resource on this machine, whoever owns it: state files, cgroups, loop devices,
    device-mapper tables, mounts (what a test checks is empty after a run)."""
    found = [f"state {p}" for p in STATE_DIR.glob(f"{PREFIX}*.json")] if STATE_DIR.is_dir() else []
    if BLKIO_ROOT.is_dir():
        found += [f"cgroup {p}" for p in BLKIO_ROOT.glob(f"{PREFIX}*")]
    found += [f"loop {dev} ({back})" for dev, back in _loop_backing().items() if PREFIX in back]
    if Path("/dev/mapper").is_dir():
        found += [f"dm {p.name}" for p in Path("/dev/mapper").glob(f"{PREFIX}*")]
    return found


def reap_leftovers() -> list[str]:
    """Tear down what runs that no longer exist left behind (a SIGKILLed scenario); returns what was removed."""
    removed = []
    if not STATE_DIR.is_dir():
        return removed
    for path in STATE_DIR.glob(f"{PREFIX}*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(state.get("owner", 0))):
            continue
        problems = _teardown(state)
        if problems:
            removed.append(f"{path.name}: " + "; ".join(problems))
            continue
        path.unlink(missing_ok=True)
        removed.append(f"{path.stem} (owner {state.get('owner')} gone): "
                       + ", ".join(f"{k} {v}" for k, v in state.items() if k != "owner" and v))
    return removed


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``--reap``: remove leftovers of dead runs. ``--hold DIR``: set up, print READY and wait (for tests)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--reap"]:
        for line in reap_leftovers():
            print(f"removed {line}")
        left = leftovers()
        for line in left:
            print(f"still there (owner alive?): {line}")
        return 0
    if args[:1] == ["--hold"] and len(args) == 2:
        disk = SlowDisk(Path(args[1]), size_bytes=64 << 20)
        try:
            disk.setup()
            print(f"READY {disk.describe()}", flush=True)
            child = subprocess.Popen(disk.wrap(["sleep", "600"]), start_new_session=True)
            print(f"CHILD {child.pid}", flush=True)
            child.wait()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        finally:
            disk.close()
        print("CLEAN", flush=True)
        return 0
    print("usage: python -m scenario.slowdisk --reap | --hold DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
