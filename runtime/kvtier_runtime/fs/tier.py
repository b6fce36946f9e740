"""The durable, bounded filesystem tier: the public class, assembled from one module per concern.

Helper objects the tier owns, each reached only through its methods: its jobs, deadlines and thread pools
(``jobs``, a :class:`kvtier_runtime.tiers.jobs.JobQueue`, the remote tier's too, whose results, draining and
closing it serves as every tier does: :class:`kvtier_runtime.tiers.queued.QueuedTier`), its degraded mode and
store backoff (``disk_health``, :mod:`.health`), its index, eviction accounting and file removal (``index``,
:class:`.index.BlockIndex`), its block files through codecs (``io``, :class:`.io.BlockIO`), the fan-out
directories both use (:class:`.fanout.FanoutDirs`) and what it counts (:mod:`.tier_metrics`, in
:mod:`kvtier_runtime.metrics`). The start-up scan is a function (:func:`.scan.scan_blocks`) whose findings the index
adopts. The tier itself only routes: its I/O tasks run a block through ``io`` and settle the outcome in ``index``.

Non-blocking by construction: ``lookup``/``state`` only read an in-memory index, ``submit_store``/``submit_load``
only reserve space and enqueue work on separate write and read thread pools, and completions are collected with
``get_finished()`` (or an ``on_complete`` callback); ``drain`` waits for every submitted job. Nothing here raises
into the caller because of the disk: a bad, missing or unreadable file is a failed key in a :class:`JobResult`,
counted in ``kvtier_runtime_fs_errors``. There is no blocking store or load here: tests and benchmarks wait for one
job with ``tests/plugins/tier_sync.py``, on top of this API.

Correctness rules: a block is served only if its header CRC, key, codec-independent shape/dtype, file length and
payload CRC all match; anything else is deleted. Space is accounted by an eviction policy
(``kvtier_runtime.policies``); blocks being written or read are pinned in it so they are never evicted mid-I/O.
An evicted key is "doomed" until its file is unlinked, and cannot be stored again before that, so a late unlink
can never delete a newer copy.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..codecs import Codec, CodecError, KVChunkCodec, get_codec
from ..config import FilesystemTierConfig
from ..policies import AccessContext, get_policy
from ..tiers.backoff import Backoff
from ..tiers.base import EventPlace, KeyState, ReplayPolicy, TierChanges
from ..tiers.jobs import Expired, Job, JobQueue, JobResult
from ..tiers.keys import read_mac_key
from ..tiers.queued import QueuedTier
from .fanout import FanoutDirs
from .fileio import FileOps, probe_o_direct
from .format import MAX_KEY_BYTES, FormatError, file_bytes_for
from .health import BACKOFF_KINDS, IO_ERRNO_KIND, TierHealth
from .index import DIRECTORY_BYTES, BlockIndex, LookupRun, file_budget
from .io import BlockIO
from .paths import NAMESPACE, block_relpath
from .scan import scan_blocks
from .tier_metrics import FilesystemMetrics

__all__ = ["DIRECTORY_BYTES", "FilesystemTier", "JobResult", "KeyState", "LookupRun", "file_budget"]


# How KV cache events place a filesystem tier's chunks (kvtier_runtime.tiers.base.EventPlace).
EVENT_PLACE = EventPlace("STORAGE", "LOCAL", "kvtier-fs")


class FilesystemTier(QueuedTier):
    """Blocks of one fixed shape and dtype, stored as checksummed files under ``root_dir``, bounded in bytes."""

    # The Tier protocol (kvtier_runtime.tiers.base): a local disk, keys with the books' run-identity suffix (one
    # directory may serve several models), failed loads logged by the books.
    medium = "filesystem"
    origin = "disk"
    scoped_keys = False
    logs_load_faults = False
    _log = logging.getLogger("kvtier_runtime.fs.tier")

    def __init__(
        self,
        config: FilesystemTierConfig,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        name: str = "fs",
        peer: str = "host",
        file_ops: FileOps | None = None,
        direct_io: bool | None = None,
        on_complete: Callable[[JobResult], None] | None = None,
        backoff_after: int = 3,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        codec: Codec | KVChunkCodec | None = None,
    ) -> None:
        """``codec`` overrides the codec named by the config (e.g. one with another error budget)."""
        self.config = config
        self.name = name
        self._metrics = FilesystemMetrics(name, config.capacity_bytes)  # before anything that may count a fault
        # The tier blocks come from and go to, for the promotion/demotion metrics (vLLM's CPU tier by default).
        self.peer = peer
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.file_ops = file_ops or FileOps()
        self._clock = clock
        # Config errors (an unknown codec, an unreadable MAC key) before anything touches the disk.
        codec = codec or get_codec(config.codec, fallback=config.codec_fallback)
        mac_key = read_mac_key(config.mac_key_file)
        # Jobs, deadlines and pools. Its lock is the tier's and the index's: an index entry and its job's key
        # settle in one step.
        self.jobs = JobQueue(name=name, medium=self.medium, io_timeout_s=config.io_timeout_s, errors=self._metrics,
                             on_io_failure=self._record_io_failure, on_complete=on_complete,
                             on_lent_read_overrun=self._lent_read_overran, log=self._log)
        self._lock = self.jobs.lock
        self.root = os.path.join(os.path.realpath(config.root_dir), NAMESPACE)
        # The namespace directory, degraded mode and store backoff.
        self.disk_health = TierHealth(name=name, root=self.root, metrics=self._metrics,
                                      backoff=Backoff(backoff_base_s, backoff_max_s, after=backoff_after, clock=clock),
                                      lock=self._lock)
        self.disk_health.open_namespace()
        if direct_io is None:
            direct_io = False if self.degraded is not None else probe_o_direct(self.root, self.file_ops)
        dirs = FanoutDirs(self.root)
        # Block files through the codec (and the file format around them).
        self.io = BlockIO(name=name, codec=codec, ops=self.file_ops, dirs=dirs, block_shape=self.block_shape,
                          dtype=dtype, mac_key=mac_key, direct_io=direct_io, clock=clock)
        # What the block files may occupy: the capacity less the directories they live in. A volume's limit (an
        # emptyDir's sizeLimit, a quota) counts every byte under it, and the kubelet evicts a pod whose emptyDir
        # exceeds its sizeLimit: a full tier must stay under the capacity it was given, fan-out included.
        budget = file_budget(config.capacity_bytes, self.io.nominal_file_bytes)
        # Which keys are held, their accounting in the eviction policy, and the removal of their files.
        self.index = BlockIndex(
            dirs=dirs, ops=self.file_ops, lock=self._lock, metrics=self._metrics, file_budget=budget,
            nominal_file_bytes=self.io.nominal_file_bytes,
            policy=get_policy(config.eviction_policy, budget, admission=config.admission,
                              admission_threshold=config.admission_threshold))
        self.rebuild_stats = self._rebuild_index() if os.path.isdir(self.root) else {"blocks": 0}
        self._update_occupancy()
        self._read_pool, self._write_pool = self.jobs.start_pools(config.n_read_threads, config.n_write_threads)

    @property
    def codec(self) -> Codec | KVChunkCodec:
        """The codec blocks are written with (the config's, or the one given)."""
        return self.io.codec

    @property
    def direct_io(self) -> bool:
        """Whether block files are opened with O_DIRECT."""
        return self.io.direct_io

    @property
    def capacity_blocks(self) -> int:
        """Blocks of the nominal size (the tier's codec, no fallback) the tier holds when full."""
        return self.index.file_budget // self.io.nominal_file_bytes

    @property
    def backoff(self) -> Backoff:
        return self.disk_health.backoff

    # The Tier protocol's observation members (what the engine exports and replay models, asked of the tier).
    @property
    def address(self) -> str:
        return self.config.root_dir

    @property
    def evictions(self) -> int:
        return self._metrics.evictions

    @property
    def replay_policy(self) -> ReplayPolicy:
        return ReplayPolicy(self.config.eviction_policy, self.config.admission, shared=False)

    @property
    def event_place(self) -> EventPlace:
        # This replica's own disk: vLLM's STORAGE medium, local.
        return EVENT_PLACE

    def gauges(self) -> dict[str, float]:
        return {"backoff": 1.0 if self.in_backoff else 0.0}

    def reasons(self) -> dict[str, dict[str, int]]:
        return {}  # its faults are the books' load failures and kvtier_runtime_fs_errors_total

    @property
    def in_backoff(self) -> bool:
        """Whether stores are refused for now after repeated disk faults."""
        return self.disk_health.in_backoff

    @property
    def degraded(self) -> str | None:
        """Why the tier cannot store (a read-only or forbidden directory), or None: it then serves what it finds
        and refuses every store with this reason, instead of failing the engine's start-up."""
        return self.disk_health.degraded

    def _record_io_failure(self) -> None:
        self.disk_health.io_failure()

    @property
    def io_timeout_s(self) -> float:
        """How long a transfer may take before the caller treats its keys as missed (the config's io_timeout_s)."""
        return self.jobs.io_timeout_s

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, Any], block_shape: Sequence[int], dtype: torch.dtype, **options: Any
    ) -> FilesystemTier:
        return cls(FilesystemTierConfig.from_kwargs(kwargs), block_shape, dtype, **options)

    # ---- what the books ask (kvtier_runtime.tiers.base.Tier) ---------------------------------------------
    def probe(self, key: bytes) -> KeyState:
        """HIT or MISS for a lookup of the engine's, counted in this tier's lookups and hits. A key whose store is
        still in flight is a miss here: the books never make a request wait on a write-through."""
        hit = self.state(key) is KeyState.HIT
        self._metrics.probed(hit)
        return KeyState.HIT if hit else KeyState.MISS

    def needs_store(self, key: bytes) -> bool:
        return self.state(key) is KeyState.MISS

    def covers(self, key: bytes) -> bool:
        """Held or being written here: the index is this tier's own, so the host tier need not keep a copy."""
        return self.state(key) is not KeyState.MISS

    def _lent_read_overran(self) -> None:
        # Later loads take the staging path (which times out cleanly) for io_timeout_s; the overrun counts towards
        # store backoff.
        self.io.pause_direct_reads(self._clock() + self.io_timeout_s)
        self._record_io_failure()

    # ---- jobs (non-blocking) ----------------------------------------------------------------------------
    def submit_store(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], ctx: AccessContext | None = None
    ) -> int:
        """Queue writes of ``blocks`` under ``keys``; the tensors must stay unchanged until the job finishes.

        Keys already present (or being written) succeed without I/O. A key is refused (a failed key, no
        exception) in backoff, when the admission filter declines it, or when pinned blocks leave no room.
        """
        self.jobs.check_open()
        if len(keys) != len(blocks):
            raise ValueError(f"blocks: {len(blocks)} blocks for {len(keys)} keys")
        for key in keys:
            block_relpath(key)  # rejects non-bytes or empty keys with a ValueError naming the key
        keys = [bytes(k) for k in keys]
        job = self.jobs.new_job("store", keys)
        size = self.io.nominal_file_bytes
        index = self.index
        work: list[tuple[int, bytes, torch.Tensor, list[bytes]]] = []
        backoff = self.in_backoff
        with self._lock:
            for i, (key, block) in enumerate(zip(keys, blocks)):
                if index.held_locked(key, ctx):
                    self.jobs.settle_locked(job, i, True)
                    continue
                if len(key) > MAX_KEY_BYTES:
                    reason = "key-too-long"
                elif self.degraded is not None:
                    reason = self.degraded
                elif backoff:
                    reason = "backoff"
                elif index.busy_locked(key):
                    reason = "busy"
                elif tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
                    reason = "mismatch"
                elif not index.admit_locked(key, size, ctx):
                    reason = "not-admitted"
                else:
                    doomed = index.reserve_locked(key, size, ctx)
                    if doomed is None:
                        reason = "no-room"
                    else:
                        work.append((i, key, block, doomed))
                        continue
                self._metrics.rejected(reason)
                job.errors[i] = reason
                self.jobs.settle_locked(job, i, False)
        self._update_occupancy()
        self.jobs.run_each(self._write_pool, self.config.n_write_threads, self._write_task, job, work)
        self.jobs.settle(job, None, True)
        return job.job_id

    def submit_load(
        self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], ctx: AccessContext | None = None
    ) -> int:
        """Queue reads of ``keys`` into ``outs`` (contiguous CPU tensors of the tier's shape and dtype); any
        other destination fails its key as ``mismatch`` here, before a read could blame the file for it."""
        self.jobs.check_open()
        if len(keys) != len(outs):
            raise ValueError(f"outs: {len(outs)} tensors for {len(keys)} keys")
        keys = [bytes(k) for k in keys]
        job = self.jobs.new_job("load", keys)
        work: list[tuple[int, bytes, torch.Tensor]] = []
        with self._lock:
            for i, (key, out) in enumerate(zip(keys, outs)):
                if not self.index.ready_locked(key):
                    job.errors[i] = "miss"
                    self.jobs.settle_locked(job, i, False)
                elif (tuple(out.shape) != self.block_shape or out.dtype != self.dtype
                      or not out.is_cpu or not out.is_contiguous()):
                    job.errors[i] = "mismatch"
                    self.jobs.settle_locked(job, i, False)
                else:
                    self.index.pin_for_read_locked(key, ctx)
                    work.append((i, key, out))
        self.jobs.run_each(self._read_pool, self.config.n_read_threads, self._read_task, job, work)
        self.jobs.settle(job, None, True)
        return job.job_id

    # ---- I/O tasks (pool threads): a block through ``io``, its outcome settled in ``index`` ------------------
    def _write_task(self, job: Job, i: int, key: bytes, block: torch.Tensor, evicted: list[bytes]) -> bool:
        """Write one block (never raises for the disk: the outcome is ``ok`` or an error kind for the key)."""
        self.index.unlink_doomed(evicted)
        self.index.retry_stuck()
        ok, kind, nbytes = False, "", 0
        started = time.perf_counter()
        try:
            nbytes = self.io.write_block(job, key, block)
            ok = True
        except Expired:
            kind = "timeout"
        except FormatError as exc:
            kind = exc.kind
        except OSError as exc:
            kind = IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except Exception:  # a codec or programming fault must not kill the pool thread or reach the engine
            kind = "other"
        with self._lock:
            ok, kind, late = self.index.settle_write_locked(key, ok, kind, file_bytes_for(nbytes))
            if not ok:
                job.errors[i] = kind
        self.index.unlink_doomed(late)
        if ok:
            self.disk_health.io_success()
            self._metrics.demoted(self.peer, block.numel() * block.element_size(), time.perf_counter() - started)
        else:
            if kind != "timeout":  # counted once, when the job expired
                self._metrics.error(kind)
            if kind == "enospc":
                self.index.make_real_room(self.io.nominal_file_bytes)
            if kind in BACKOFF_KINDS and kind != "timeout":
                self.disk_health.io_failure()
        self._update_occupancy()
        return ok

    def _read_task(self, job: Job, i: int, key: bytes, out: torch.Tensor) -> bool:
        """Read one block into ``out`` (never raises for the disk); a block that fails to read is deleted."""
        started = time.perf_counter()
        kind = ""
        try:
            self.io.read_block(job, key, out)
        except Expired:
            pass  # the caller gave up on this key: the block itself is fine
        except FormatError as exc:
            kind = exc.kind
        except FileNotFoundError:
            kind = "missing"
        except OSError as exc:
            kind = IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except CodecError:
            kind = "corrupt"
        except Exception:
            kind = "other"
        with self._lock:
            doomed = self.index.settle_read_locked(key, failed=bool(kind))
            if kind:
                job.errors[i] = kind
        self.index.unlink_doomed(doomed)
        if kind:
            self._metrics.error(kind)
            self._update_occupancy()
        else:
            self._metrics.promoted(self.peer, out.numel() * out.element_size(), time.perf_counter() - started)
        return not kind

    # ---- the index (observation, pins, removal) ---------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the tier's files on disk: blocks held, plus files that could not be deleted yet."""
        return self.index.used_bytes

    def __len__(self) -> int:
        return len(self.index)

    def keys(self) -> list[bytes]:
        return self.index.keys()

    def state(self, key: bytes) -> KeyState:
        return self.index.state(key)

    def lookup(self, keys: Sequence[bytes], ctx: AccessContext | None = None) -> LookupRun:
        """Longest run of leading keys that are ready. Does not touch the eviction order: an engine asks again
        every scheduling step while a request waits, which would inflate frequency-based policies; the load
        that follows a hit is what counts as an access."""
        run = self.index.lookup(keys)
        self._metrics.looked_up(min(len(keys), run.hits + 1), run.hits)
        return run

    def block_path(self, key: bytes) -> str:
        return os.path.join(self.root, block_relpath(key))

    def remove(self, key: bytes) -> bool:
        """Drop a ready, unpinned block (its file is unlinked); False if absent, pinned or being written."""
        return self.index.remove(key)

    def pin(self, key: bytes) -> bool:
        """Keep a ready block from eviction; False if absent or still being written (the write holds its own
        pin, and its failure path must be free to drop the block)."""
        return self.index.pin(key)

    def unpin(self, key: bytes) -> None:
        self.index.unpin(key)

    def record_changes(self) -> None:
        """From now on remember every key that leaves the tier (evicted, corrupt, removed) for
        :meth:`take_changes`: KV cache events announce them. Keys enter it only through the engine's own stores."""
        self.index.record_removals()

    def take_changes(self) -> TierChanges:
        """Keys that left the tier since the last call (empty unless :meth:`record_changes` was called)."""
        return TierChanges([], self.index.take_removals())

    def _update_occupancy(self) -> None:
        self.index.update_occupancy()

    def _rebuild_index(self) -> dict[str, int]:
        """Rebuild the index from the block files' headers (:func:`.scan.scan_blocks`; only our own namespace
        directory is scanned and cleaned); blocks are adopted oldest first, so the eviction order starts close to
        the previous run's."""
        stats, found = scan_blocks(self.root, self.file_ops, self.io.check_header)
        stats["evicted"] += self.index.adopt(found)
        stats["blocks"] = len(self.index)
        for kind in ("foreign", "corrupt", "truncated", "mismatch", "version"):
            if stats[kind]:
                self._metrics.error(kind, stats[kind])
        if stats["tmp"]:
            self._metrics.error("torn", stats["tmp"])
        return stats
