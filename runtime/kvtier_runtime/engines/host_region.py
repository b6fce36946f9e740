"""kvtier's host tier memory: one shared-memory file both of vLLM's processes map (no vllm import).

vLLM's worker process copies KV pages between the engine's cache and this region; the scheduler process (where
kvtier's books and disk I/O threads live) reads and writes the same rows to move blocks to and from the
filesystem tiers. A chunk is one row of ``row_bytes``; with tensor parallelism the row holds every rank's part
(rank r at ``r * worker_bytes``), so one file on disk holds a whole chunk.

The file is ``<shm_dir>/kvtier_host_<engine_id>.mmap``. Every process that maps it holds a shared ``flock`` on it
for its lifetime, so a file nobody holds (left by a killed engine) is recognised and removed at the next start.
"""
from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import time

import torch

log = logging.getLogger(__name__)

PREFIX = "kvtier_host_"
SUFFIX = ".mmap"
# A file younger than this may be one another engine is creating right now (between its open and its flock, a few
# microseconds). Short, because a restarted container must not find last run's region still counted against the
# /dev/shm size limit (the region of a killed engine is only ever removed here: SIGKILL runs no shutdown).
STALE_AFTER_S = 5.0


def region_path(shm_dir: str, engine_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))
    return os.path.join(shm_dir, f"{PREFIX}{safe}{SUFFIX}")


def remove_stale_regions(shm_dir: str, now: float | None = None, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Delete region files no live process holds (their engine was killed) and at least ``min_age_s`` old; returns
    the removed paths. (A region is locked before it appears under its name, so the age is only a margin for
    regions made by older kvtier versions, which created the file before locking it.)"""
    removed: list[str] = []
    now = time.time() if now is None else now
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held by a live engine
        finally:
            os.close(fd)  # releases our probe lock too
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


# Folders whose dead regions this process removes when it exits (see remove_dead_regions_at_exit).
_EXIT_CLEANUP: set[str] = set()
# How long that exit waits for the engine's processes, killed a moment before, to be gone (their locks released).
EXIT_WAIT_S = 5.0
EXIT_SETTLE_S = 1.0


def remove_dead_regions_at_exit(shm_dir: str) -> None:
    """Remove, when this process exits, the region files under ``shm_dir`` that no live process holds.

    For vLLM's front end (the API server), the process that outlives the engine: on SIGTERM with the default
    ``--shutdown-timeout 0`` it SIGKILLs the engine core (the region's owner) in the same instant it SIGTERMs it, so
    the owner's shutdown never runs; the front end then exits normally and this removes what the killed engine
    left in ``/dev/shm``. Only regions nobody holds are removed (the rule of :func:`remove_stale_regions`), so a
    folder shared with live engines is safe. Registered once per folder."""
    if shm_dir in _EXIT_CLEANUP:
        return
    _EXIT_CLEANUP.add(shm_dir)
    atexit.register(_remove_dead_regions, shm_dir, EXIT_WAIT_S)


def _remove_dead_regions(shm_dir: str, wait_s: float, poll_s: float = 0.05) -> list[str]:
    """:func:`remove_stale_regions` once no descendant of this process holds a region under ``shm_dir`` open
    (bounded by ``wait_s``): vLLM killed its engine core and workers just before, and a killed process releases its
    lock when it is torn down. (Other descendants, e.g. multiprocessing's resource tracker, are not waited for.)"""
    deadline = time.monotonic() + wait_s
    while _held_below(shm_dir, os.getpid()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    # A reaped-to-zombie process may still hold its lock a moment (its mapping is torn down after): retry briefly
    # while region files remain (some may be live engines' sharing the folder: those stay, the retry is bounded).
    settle = min(deadline, time.monotonic() + EXIT_SETTLE_S)
    removed = remove_stale_regions(shm_dir, min_age_s=0.0)
    while _region_names(shm_dir) and time.monotonic() < settle:
        time.sleep(poll_s)
        removed += remove_stale_regions(shm_dir, min_age_s=0.0)
    if removed:
        log.info("kvtier: removed %d shared-memory region(s) of a stopped engine from %s", len(removed), shm_dir)
    return removed


def _region_names(shm_dir: str) -> list[str]:
    try:
        return [n for n in os.listdir(shm_dir) if n.startswith(PREFIX) and n.endswith(SUFFIX)]
    except OSError:
        return []


def _held_below(shm_dir: str, pid: int) -> bool:
    """Whether a live descendant of ``pid`` has a region file under ``shm_dir`` open (from /proc/<pid>/fd)."""
    folder = os.path.realpath(shm_dir)
    for child in _live_descendants(pid):
        try:
            fds = os.listdir(f"/proc/{child}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{child}/fd/{fd}")
            except OSError:
                continue
            name = os.path.basename(target)
            if os.path.dirname(target) == folder and name.startswith(PREFIX) and name.endswith(SUFFIX):
                return True
    return False


def _live_descendants(pid: int) -> list[int]:
    """Processes below ``pid`` that have not exited (zombies, whose files are closed, do not count); from /proc,
    empty where there is none."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) >= 2 and fields[0] not in (b"Z", b"X"):
            parents[int(name)] = int(fields[1])
    below: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        below += frontier
    return below


def _open_locked(path: str) -> int:
    """The region file at ``path``, opened and holding a shared lock; created if absent. A file this creates is
    locked before it appears under its name (made under a private name, locked, then hard-linked into place), so a
    region file nobody holds is always one whose processes are gone -- never one being created."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(fd, path):
                return fd
            os.close(fd)  # removed as stale between our open and our lock (its engine was gone): start again
            continue
        private = f"{path}.{os.getpid()}.{time.monotonic_ns()}.new"
        fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.link(private, path)
        except FileExistsError:
            os.close(fd)  # another process of this engine published it first: use that one
            continue
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(private)
        return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class HostRegion:
    """A ``(n_rows, row_bytes)`` uint8 tensor over the shared file; created by whichever process comes first."""

    def __init__(self, shm_dir: str, engine_id: str, n_rows: int, row_bytes: int) -> None:
        if n_rows <= 0 or row_bytes <= 0:
            raise ValueError(f"host region: {n_rows} rows of {row_bytes} bytes")
        os.makedirs(shm_dir, exist_ok=True)
        self.path = region_path(shm_dir, engine_id)
        self.n_rows = n_rows
        self.row_bytes = row_bytes
        self.nbytes = n_rows * row_bytes
        self._fd = _open_locked(self.path)
        size = os.fstat(self._fd).st_size
        if size < self.nbytes:
            # posix_fallocate, not ftruncate: a tmpfs too small for the tier fails here, at start-up, instead of
            # with SIGBUS at the first copy into an unbacked page.
            os.posix_fallocate(self._fd, 0, self.nbytes)
        self._mmap = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.rows = flat.view(n_rows, row_bytes)

    def data_ptr(self) -> int:
        return self.rows.data_ptr()

    def close(self, unlink: bool = False) -> None:
        """Drop this process's mapping; ``unlink`` also removes the file (the scheduler does, at shutdown)."""
        if self._fd < 0:
            return
        # Tensors viewing the buffer keep the mmap exported; release ours so the mapping can close.
        self.rows = torch.empty(0, self.row_bytes, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            log.debug("host region %s still viewed by tensors; the mapping closes with them", self.path)
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
