"""The filesystem tier's index and eviction (its "manager"): which keys are ready or being written, their
accounting in the eviction policy, pins, and unlinking the files of evicted or bad blocks -- including files that
could not be deleted (``_stuck``: still counted against capacity, retried) and keys whose file is being unlinked
(``_doomed``: they cannot be stored again before that, so a late unlink never deletes a newer copy)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence

from ..policies import AccessContext
from ..tiers.base import KeyState
from .paths import block_relpath


@dataclass(frozen=True)
class LookupRun:
    """Result of a prefix lookup: ``hits`` leading keys are ready; ``pending`` if the run stopped at a key whose
    store is still in flight (a caller may wait for it instead of recomputing)."""

    hits: int
    pending: bool


@dataclass
class Entry:
    state: str  # "writing" | "ready"
    nbytes: int


# How often stores retry unlinking files that could not be deleted (their bytes stay counted until then).
_STUCK_RETRY_S = 1.0

# Bytes a directory takes on common filesystems (ext4, xfs: one block); a block file lives two fan-out levels down.
DIRECTORY_BYTES = 4096


def file_budget(capacity_bytes: int, file_bytes: int) -> int:
    """The bytes block files of ``file_bytes`` each may take so that the files and their directories fit in
    ``capacity_bytes``. Empty fan-out directories are pruned, so there are never more leaf directories, nor more
    first-level ones, than files: each file is charged two directories, the namespace directory and the volume's
    own root once each (a du of the volume counts both). At least one file's worth, so that a tiny tier still
    stores."""
    per_file = file_bytes + 2 * DIRECTORY_BYTES
    files = max(1, (capacity_bytes - 2 * DIRECTORY_BYTES) // per_file)
    return min(capacity_bytes, files * file_bytes)


class BlockIndex:
    """Mixin of :class:`~.tier.FilesystemTier`: the in-memory index, eviction accounting and file removal."""

    # ---- observation (non-blocking) ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the tier's files on disk: blocks held, plus files that could not be deleted yet."""
        return self._policy.used_bytes + sum(n for _, n in self._stuck.values())

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._index.values() if e.state == "ready")

    def keys(self) -> list[bytes]:
        with self._lock:
            return [k for k, e in self._index.items() if e.state == "ready"]

    def state(self, key: bytes) -> KeyState:
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return KeyState.MISS
        return KeyState.HIT if entry.state == "ready" else KeyState.PENDING

    def lookup(self, keys: Sequence[bytes], ctx: AccessContext | None = None) -> LookupRun:
        """Longest run of leading keys that are ready. Does not touch the eviction order: an engine asks again
        every scheduling step while a request waits, which would inflate frequency-based policies; the load
        that follows a hit is what counts as an access."""
        hits, pending = 0, False
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is None or entry.state != "ready":
                    pending = entry is not None
                    break
                hits += 1
        self._metrics.looked_up(min(len(keys), hits + 1), hits)
        return LookupRun(hits, pending)

    def block_path(self, key: bytes) -> str:
        return os.path.join(self.root, block_relpath(key))

    def remove(self, key: bytes) -> bool:
        """Drop a ready, unpinned block (its file is unlinked); False if absent, pinned or being written."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.state != "ready" or self._policy.is_pinned(key):
                return False
            self._policy.remove(key)
            doomed = self._doom_locked([key])
        self._unlink_doomed(doomed)
        self._update_occupancy()
        return True

    def pin(self, key: bytes) -> bool:
        """Keep a ready block from eviction; False if absent or still being written (the write holds its own
        pin, and its failure path must be free to drop the block)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.state != "ready":
                return False
            self._policy.pin(key)
            return True

    def unpin(self, key: bytes) -> None:
        with self._lock:
            doomed = self._unpin_locked(key)
        self._unlink_doomed(doomed)
        self._update_occupancy()

    def _unpin_locked(self, key: bytes) -> list[bytes]:
        self._policy.unpin(key)
        if key in self._bad and not self._policy.is_pinned(key):
            self._bad.discard(key)
            self._policy.remove(key)
            return self._doom_locked([key])
        return []

    def _make_real_room(self, nbytes: int) -> None:
        """The disk is fuller than our accounting (capacity set above the free space, or other tenants): free
        two blocks' worth of our own coldest blocks so the tier keeps working at the disk's real size instead
        of failing every store."""
        with self._lock:
            evicted = self._policy.evict(min(2 * nbytes, self._policy.used_bytes - self._policy.pinned_bytes))
            doomed = self._doom_locked(evicted or [], evicted=True)
        self._unlink_doomed(doomed)

    # ---- eviction / unlink ------------------------------------------------------------------------------
    def record_removals(self) -> None:
        """From now on remember every key that leaves the tier (evicted, corrupt, removed) for
        :meth:`take_removals`: KV cache events announce them."""
        with self._lock:
            if self._removals is None:
                self._removals = []

    def take_removals(self) -> list[bytes]:
        """Keys that left the tier since the last call (empty unless :meth:`record_removals` was called)."""
        with self._lock:
            if not self._removals:
                return []
            out, self._removals = self._removals, []
            return out

    def _doom_locked(self, keys: Sequence[bytes], *, evicted: bool = False) -> list[bytes]:
        """Forget ``keys`` and mark their files for unlinking. Only ``evicted`` ones (chosen by the policy to
        make room) count as evictions: a corrupt block or an explicit remove is not one."""
        for key in keys:
            entry = self._index.pop(key, None)
            self._doomed[key] = entry.nbytes if entry is not None else self._nominal_file_bytes
            if self._removals is not None and entry is not None and entry.state == "ready":
                self._removals.append(key)
        if evicted and keys:
            self._metrics.evicted(len(keys))
        return list(keys)

    def _unlink_doomed(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            path = self.block_path(key)
            gone = False
            try:
                self._ops.unlink(path)
                gone = True
                self._prune_fanout(os.path.dirname(path))
            except FileNotFoundError:
                gone = True
            except OSError:
                self._metrics.error("unlink")
            finally:
                with self._lock:
                    if gone:
                        self._doomed.pop(key, None)
                    else:  # still on disk: keep counting it, and keep the key from being stored over it
                        self._stuck_locked(path, key, self._doomed.get(key, self._nominal_file_bytes))
        if keys:
            self._update_occupancy()

    def _prune_fanout(self, leaf: str) -> None:
        """Remove the block's fan-out directories once they are empty: left behind they grow to 65,792
        directories (about 260 MiB on ext4) that no capacity counts. A writer that loses the race finds its
        directory gone and recreates it, as often as that happens (_write_file)."""
        self._made_dirs.discard(leaf)
        for directory in (leaf, os.path.dirname(leaf)):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (the usual case), already gone, or not ours to remove
                return

    def _stuck_locked(self, path: str, key: bytes | None, nbytes: int) -> None:
        self._stuck[path] = (key, nbytes)
        self._policy.capacity_bytes = self._file_budget - sum(n for _, n in self._stuck.values())

    def _retry_stuck(self) -> None:
        """Try again to delete files that could not be deleted (at most every _STUCK_RETRY_S)."""
        now = time.monotonic()
        with self._lock:
            if not self._stuck or now < self._stuck_retry_at:
                return
            self._stuck_retry_at = now + _STUCK_RETRY_S
            items = list(self._stuck.items())
        for path, (key, _) in items:
            try:
                self._ops.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            with self._lock:
                self._stuck.pop(path, None)
                if key is not None:
                    self._doomed.pop(key, None)
                self._policy.capacity_bytes = self._file_budget - sum(n for _, n in self._stuck.values())
        self._update_occupancy()

    def _update_occupancy(self) -> None:
        self._metrics.occupancy(self.used_bytes)
