"""kvtier's host tier memory: one shared-memory file both of vLLM's processes map (no vllm import).

vLLM's worker process copies KV pages between the engine's cache and this region; the scheduler process (where
kvtier's books and disk I/O threads live) reads and writes the same rows to move blocks to and from the
filesystem tiers. A chunk is one row of ``row_bytes``; with tensor parallelism the row holds every rank's part
(rank r at ``r * worker_bytes``), so one file on disk holds a whole chunk.

The file is ``<shm_dir>/kvtier_host_<engine_id>.mmap``. Every process that maps it holds a shared ``flock`` on it
for its lifetime, so a file nobody holds (left by a killed engine) is recognised and removed at the next start.
"""
from __future__ import annotations

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
# A file younger than this may be one another engine is creating right now (between open and flock).
STALE_AFTER_S = 60.0


def region_path(shm_dir: str, engine_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))
    return os.path.join(shm_dir, f"{PREFIX}{safe}{SUFFIX}")


def remove_stale_regions(shm_dir: str, now: float | None = None) -> list[str]:
    """Delete region files no live process holds (their engine was killed); returns the removed paths."""
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
            if now - os.fstat(fd).st_mtime < STALE_AFTER_S:
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
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)
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
