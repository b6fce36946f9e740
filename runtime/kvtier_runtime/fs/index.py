"""The filesystem tier's index and eviction (its "manager"), :class:`BlockIndex`: which keys are ready or being
written, their accounting in the eviction policy, pins, and unlinking the files of evicted or bad blocks --
including files that could not be deleted (still counted against capacity, retried) and keys whose file is being
unlinked ("doomed": they cannot be stored again before that, so a late unlink never deletes a newer copy).

A helper object the tier owns: it holds its own state and is reached only through its methods. Methods named
``*_locked`` expect the caller to hold the index's lock (the tier's job lock, so that an index entry and its
job's key settle in one step); the others take it themselves."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from ..policies import AccessContext
from ..policies.base import EvictionPolicy
from ..tiers.base import KeyState
from .fanout import FanoutDirs
from .fileio import FileOps
from .tier_metrics import FilesystemMetrics


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
    """The in-memory index of one tier's block files, their accounting in ``policy`` (bounded by ``file_budget``
    bytes), and the removal of their files under ``dirs``. ``nominal_file_bytes``: a file's size when nothing
    better is known (a doomed key that had no entry)."""

    def __init__(self, *, dirs: FanoutDirs, ops: FileOps, policy: EvictionPolicy, file_budget: int,
                 nominal_file_bytes: int, lock: threading.Lock | threading.RLock,
                 metrics: FilesystemMetrics) -> None:
        self.lock = lock
        self._dirs = dirs
        self._ops = ops
        self._policy = policy
        self._metrics = metrics
        self.file_budget = file_budget
        self._nominal_file_bytes = nominal_file_bytes
        self._entries: dict[bytes, Entry] = {}
        # Keys whose file is being unlinked (bytes on disk), so the key cannot be stored again before that.
        self._doomed: dict[bytes, int] = {}
        self._removals: list[bytes] | None = None  # keys that left the tier, for KV events (record_removals)
        # Files that could not be unlinked: their bytes still occupy the disk, so they stay counted against
        # capacity (the policy's capacity shrinks by them) and are retried until really gone.
        self._stuck: dict[str, tuple[bytes | None, int]] = {}
        self._stuck_retry_at = 0.0
        # Keys whose file failed to read while someone else had them pinned: gone from the index, their
        # accounting and file are dropped at the last unpin.
        self._bad: set[bytes] = set()

    # ---- observation (non-blocking) ---------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of the tier's files on disk: blocks held, plus files that could not be deleted yet."""
        stuck = self._stuck
        return self._policy.used_bytes + (sum(n for _, n in stuck.values()) if stuck else 0)

    def __len__(self) -> int:
        with self.lock:
            return sum(1 for e in self._entries.values() if e.state == "ready")

    def keys(self) -> list[bytes]:
        with self.lock:
            return [k for k, e in self._entries.items() if e.state == "ready"]

    def state(self, key: bytes) -> KeyState:
        with self.lock:
            entry = self._entries.get(key)
        if entry is None:
            return KeyState.MISS
        return KeyState.HIT if entry.state == "ready" else KeyState.PENDING

    def lookup(self, keys: Sequence[bytes]) -> LookupRun:
        """Longest run of leading keys that are ready (the eviction order is not touched)."""
        hits, pending = 0, False
        with self.lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.state != "ready":
                    pending = entry is not None
                    break
                hits += 1
        return LookupRun(hits, pending)

    def update_occupancy(self) -> None:
        self._metrics.occupancy(self.used_bytes)

    # ---- stores -----------------------------------------------------------------------------------------
    def held_locked(self, key: bytes, ctx: AccessContext | None) -> bool:
        """Whether ``key`` is held or being written (a store of it then needs no I/O); a held key is touched."""
        if key in self._entries:
            self._policy.touch(key, ctx)
            return True
        return False

    def busy_locked(self, key: bytes) -> bool:
        """Whether ``key``'s old file is still to be deleted (a store must wait until it is)."""
        return key in self._doomed or key in self._bad

    def admit_locked(self, key: bytes, nbytes: int, ctx: AccessContext | None) -> bool:
        return self._policy.admit(key, nbytes, ctx)

    def reserve_locked(self, key: bytes, nbytes: int, ctx: AccessContext | None) -> list[bytes] | None:
        """Room for ``key``'s file, which is being written from now on (pinned): the keys evicted for it (their
        files to unlink, :meth:`unlink_doomed`), or None when pinned blocks leave no room."""
        evicted = cast("list[bytes] | None", self._policy.insert(key, nbytes, ctx))
        if evicted is None:
            return None
        self._policy.pin(key)
        self._entries[key] = Entry("writing", nbytes)
        return self._doom_locked(evicted, evicted=True)

    def settle_write_locked(self, key: bytes, ok: bool, kind: str, file_bytes: int) -> tuple[bool, str, list[bytes]]:
        """A write of ``key`` ended (``ok``, else failed as ``kind``) with a file of ``file_bytes``: the outcome,
        possibly turned into a failure (no room for a wider file than reserved), and the keys whose files to unlink."""
        self._policy.unpin(key)
        entry = self._entries[key]
        late: list[bytes] = []
        if ok and file_bytes != entry.nbytes:
            # The codec fell back to a wider encoding: account the real size (this may evict more).
            self._policy.remove(key)
            more = cast("list[bytes] | None", self._policy.insert(key, file_bytes))
            if more is None:
                ok, kind = False, "no-room"
                late = self._doom_locked([key])
            else:
                entry.nbytes = file_bytes
                late = self._doom_locked(more, evicted=True)
        if ok:
            entry.state = "ready"
        elif kind != "no-room":
            self._policy.remove(key)
            del self._entries[key]
        return ok, kind, late

    def make_real_room(self, nbytes: int) -> None:
        """The disk is fuller than our accounting (capacity set above the free space, or other tenants): free
        two blocks' worth of our own coldest blocks so the tier keeps working at the disk's real size instead
        of failing every store."""
        with self.lock:
            evicted = cast("list[bytes] | None",
                           self._policy.evict(min(2 * nbytes, self._policy.used_bytes - self._policy.pinned_bytes)))
            doomed = self._doom_locked(evicted or [], evicted=True)
        self.unlink_doomed(doomed)

    # ---- loads ------------------------------------------------------------------------------------------
    def ready_locked(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state == "ready"

    def pin_for_read_locked(self, key: bytes, ctx: AccessContext | None) -> None:
        """A read of ``key`` starts: it is an access, and the block stays until the read ends."""
        self._policy.pin(key)
        self._policy.touch(key, ctx)

    def settle_read_locked(self, key: bytes, failed: bool) -> list[bytes]:
        """A read of ``key`` ended: unpin it; a block that failed to read is never served again (forgotten, its
        file deleted at once or at the last unpin if another transfer still holds it). The keys whose files to
        unlink."""
        doomed = self._unpin_locked(key)
        if failed and key in self._entries:
            if self._policy.is_pinned(key):
                self._bad.add(key)
                del self._entries[key]
            else:
                self._policy.remove(key)
                doomed += self._doom_locked([key])
        return doomed

    # ---- pins and removal -------------------------------------------------------------------------------
    def remove(self, key: bytes) -> bool:
        """Drop a ready, unpinned block (its file is unlinked); False if absent, pinned or being written."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or entry.state != "ready" or self._policy.is_pinned(key):
                return False
            self._policy.remove(key)
            doomed = self._doom_locked([key])
        self.unlink_doomed(doomed)
        self.update_occupancy()
        return True

    def pin(self, key: bytes) -> bool:
        """Keep a ready block from eviction; False if absent or still being written (the write holds its own
        pin, and its failure path must be free to drop the block)."""
        with self.lock:
            if not self.ready_locked(key):
                return False
            self._policy.pin(key)
            return True

    def unpin(self, key: bytes) -> None:
        with self.lock:
            doomed = self._unpin_locked(key)
        self.unlink_doomed(doomed)
        self.update_occupancy()

    def _unpin_locked(self, key: bytes) -> list[bytes]:
        self._policy.unpin(key)
        if key in self._bad and not self._policy.is_pinned(key):
            self._bad.discard(key)
            self._policy.remove(key)
            return self._doom_locked([key])
        return []

    # ---- start-up -------------------------------------------------------------------------------------------
    def adopt(self, found: Sequence[tuple[float, str, bytes, int]]) -> int:
        """Index the blocks a start-up scan found (``(mtime, path, key, file bytes)``, oldest first, so the
        eviction order starts close to the previous run's); files that do not fit are deleted. Returns how many
        blocks were evicted (not adopted, or pushed out by newer ones)."""
        evictions = 0
        with self.lock:
            for _, path, key, nbytes in found:
                evicted = cast("list[bytes] | None", self._policy.insert(key, nbytes))
                if evicted is None:
                    evictions += 1
                    self._remove_path_locked(path)
                    continue
                for old in evicted:
                    self._entries.pop(old, None)
                    evictions += 1
                    self._remove_path_locked(self._dirs.block_path(old))
                self._entries[key] = Entry("ready", nbytes)
        return evictions

    def _remove_path_locked(self, path: str) -> None:
        try:
            os.unlink(path)
            self._dirs.prune(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError:
            try:
                nbytes = os.lstat(path).st_size
            except OSError:
                return
            self._stuck_locked(path, None, nbytes)

    # ---- eviction / unlink ------------------------------------------------------------------------------
    def record_removals(self) -> None:
        """From now on remember every key that leaves the tier (evicted, corrupt, removed) for
        :meth:`take_removals`: KV cache events announce them."""
        with self.lock:
            if self._removals is None:
                self._removals = []

    def take_removals(self) -> list[bytes]:
        """Keys that left the tier since the last call (empty unless :meth:`record_removals` was called)."""
        with self.lock:
            if not self._removals:
                return []
            out, self._removals = self._removals, []
            return out

    def _doom_locked(self, keys: Sequence[bytes], *, evicted: bool = False) -> list[bytes]:
        """Forget ``keys`` and mark their files for unlinking. Only ``evicted`` ones (chosen by the policy to
        make room) count as evictions: a corrupt block or an explicit remove is not one."""
        for key in keys:
            entry = self._entries.pop(key, None)
            self._doomed[key] = entry.nbytes if entry is not None else self._nominal_file_bytes
            if self._removals is not None and entry is not None and entry.state == "ready":
                self._removals.append(key)
        if evicted and keys:
            self._metrics.evicted(len(keys))
        return list(keys)

    def unlink_doomed(self, keys: Sequence[bytes]) -> None:
        """Delete the files of ``keys`` (doomed by the calls that returned them); a file that cannot be deleted
        stays counted and is retried (:meth:`retry_stuck`)."""
        for key in keys:
            path = self._dirs.block_path(key)
            gone = False
            try:
                self._ops.unlink(path)
                gone = True
                self._dirs.prune(os.path.dirname(path))
            except FileNotFoundError:
                gone = True
            except OSError:
                self._metrics.error("unlink")
            finally:
                with self.lock:
                    if gone:
                        self._doomed.pop(key, None)
                    else:  # still on disk: keep counting it, and keep the key from being stored over it
                        self._stuck_locked(path, key, self._doomed.get(key, self._nominal_file_bytes))
        if keys:
            self.update_occupancy()

    def _stuck_locked(self, path: str, key: bytes | None, nbytes: int) -> None:
        self._stuck[path] = (key, nbytes)
        self._policy.capacity_bytes = self.file_budget - sum(n for _, n in self._stuck.values())

    def retry_stuck(self) -> None:
        """Try again to delete files that could not be deleted (at most every _STUCK_RETRY_S)."""
        if not self._stuck:
            return
        now = time.monotonic()
        with self.lock:
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
            with self.lock:
                self._stuck.pop(path, None)
                if key is not None:
                    self._doomed.pop(key, None)
                self._policy.capacity_bytes = self.file_budget - sum(n for _, n in self._stuck.values())
        self.update_occupancy()
