"""The durable, bounded filesystem tier: the public class, assembled from one module per concern.

Helper objects the tier owns: its jobs, deadlines and thread pools (``jobs``, a
:class:`kvtier_runtime.tiers.jobs.JobQueue`, the remote tier's too), its degraded mode and store backoff
(``disk_health``, :mod:`.health`) and what it counts (:mod:`.tier_metrics`, in :mod:`kvtier_runtime.metrics`). The
block files' own concerns are still mixins over one shared state: :mod:`.index` (index, eviction accounting,
unlinking), :mod:`.io` (block files through codecs), :mod:`.scan` (start-up scan).

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

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..codecs import Codec, get_codec
from ..config import FilesystemTierConfig
from ..policies import AccessContext, get_policy
from .fileio import FileOps, probe_o_direct
from .format import MAX_KEY_BYTES, READ_VERSIONS, file_bytes_for
from ..tiers.backoff import Backoff
from ..tiers.base import KeyState
from ..tiers.jobs import JobQueue, JobResult
from ..tiers.keys import read_mac_key
from .health import TierHealth
from .index import DIRECTORY_BYTES, BlockIndex, Entry, LookupRun, file_budget
from .io import BlockIO
from .paths import NAMESPACE, block_relpath
from .scan import StartupScan
from .tier_metrics import FilesystemMetrics

__all__ = ["DIRECTORY_BYTES", "FilesystemTier", "JobResult", "KeyState", "LookupRun", "file_budget"]


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



class FilesystemTier(BlockIndex, BlockIO, StartupScan):
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
        codec: Codec | None = None,
    ) -> None:
        """``codec`` overrides the codec named by the config (e.g. one with another error budget)."""
        self.config = config
        self.name = name
        self._metrics = FilesystemMetrics(name, config.capacity_bytes)  # before anything that may count a fault
        # The tier blocks come from and go to, for the promotion/demotion metrics (vLLM's CPU tier by default).
        self.peer = peer
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self._dtype_name = _torch_dtype_name(dtype)
        self._codec = codec or get_codec(config.codec, fallback=config.codec_fallback)
        self._ops = file_ops or FileOps()
        backoff = Backoff(backoff_base_s, backoff_max_s, after=backoff_after, clock=clock)
        self._clock = clock
        self._mac_key = read_mac_key(config.mac_key_file)
        # Jobs, deadlines and pools (a helper object: kvtier_runtime.tiers.jobs). Its lock is the tier's: an index
        # entry and its job's key settle in one step.
        self.jobs = JobQueue(name=name, medium=self.medium, io_timeout_s=config.io_timeout_s, errors=self._metrics,
                             on_io_failure=self._record_io_failure, on_complete=on_complete,
                             on_lent_read_overrun=self._lent_read_overran, log=self._log)
        self._lock = self.jobs.lock
        self._io_timeout_s = self.jobs.io_timeout_s

        self.root = os.path.join(os.path.realpath(config.root_dir), NAMESPACE)
        # The namespace directory, degraded mode and store backoff (a helper object: .health).
        self.disk_health = TierHealth(name=name, root=self.root, metrics=self._metrics, backoff=backoff,
                                      lock=self._lock)
        self.disk_health.open_namespace()
        if self.degraded is not None:
            self.direct_io = False if direct_io is None else direct_io
        else:
            self.direct_io = probe_o_direct(self.root, self._ops) if direct_io is None else direct_io
        # Staging buffers hold a whole file of either format (format 1's is the longer); a codec with fallback
        # may emit its wider fallback encoding.
        self._max_payload = self._codec.max_encoded_nbytes(self.block_shape, dtype)
        self._nominal_file_bytes = file_bytes_for(self._codec.encoded_nbytes(self.block_shape, dtype))
        self._buffer_bytes = max(file_bytes_for(self._max_payload, v) for v in READ_VERSIONS)
        self._local = threading.local()
        self._init_direct_path()

        self._index: dict[bytes, Entry] = {}
        # Keys whose file is being unlinked (bytes on disk), so the key cannot be stored again before that.
        self._doomed: dict[bytes, int] = {}
        self._removals: list[bytes] | None = None  # keys that left the tier, for KV events (record_removals)
        # Files that could not be unlinked: their bytes still occupy the disk, so they stay counted against
        # capacity (the policy's capacity shrinks by them) and are retried until really gone.
        self._stuck: dict[bytes, int] = {}
        self._stuck_retry_at = 0.0
        # Keys whose file failed to read while someone else had them pinned: gone from the index, their
        # accounting and file are dropped at the last unpin.
        self._bad: set[bytes] = set()
        # What the block files may occupy: the capacity less the directories they live in. A volume's limit (an
        # emptyDir's sizeLimit, a quota) counts every byte under it, and the kubelet evicts a pod whose emptyDir
        # exceeds its sizeLimit: a full tier must stay under the capacity it was given, fan-out included.
        self._file_budget = file_budget(config.capacity_bytes, self._nominal_file_bytes)
        self._policy = get_policy(config.eviction_policy, self._file_budget, admission=config.admission,
                                  admission_threshold=config.admission_threshold)
        self._tmp_ids = itertools.count(1)
        self._made_dirs: set[str] = set()

        self.rebuild_stats = self._rebuild_index() if os.path.isdir(self.root) else {"blocks": 0}
        self._update_occupancy()
        self._read_pool, self._write_pool = self.jobs.start_pools(config.n_read_threads, config.n_write_threads)

    @property
    def capacity_blocks(self) -> int:
        """Blocks of the nominal size (the tier's codec, no fallback) the tier holds when full."""
        return self._file_budget // self._nominal_file_bytes

    @property
    def backoff(self) -> Backoff:
        return self.disk_health.backoff

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
        return self._io_timeout_s

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, Any], block_shape: Sequence[int], dtype: torch.dtype, **options: Any
    ) -> "FilesystemTier":
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

    # ---- jobs (kvtier_runtime.tiers.jobs.JobQueue) ------------------------------------------------------
    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each once); a job past ``io_timeout_s`` finishes here with
        its unfinished keys failed as ``timeout``."""
        return self.jobs.get_finished()

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (see :meth:`JobQueue.drain`)."""
        self.jobs.drain(timeout)

    def close(self) -> None:
        self.jobs.close()

    def _lent_read_overran(self) -> None:
        # Later loads take the staging path (which times out cleanly) for io_timeout_s; the overrun counts towards
        # store backoff.
        self._direct_reads_resume_at = self._clock() + self._io_timeout_s
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
        size = file_bytes_for(self._codec.encoded_nbytes(self.block_shape, self.dtype))
        work: list[tuple[int, bytes, torch.Tensor, list[bytes]]] = []
        backoff = self.in_backoff
        with self._lock:
            for i, (key, block) in enumerate(zip(keys, blocks)):
                if key in self._index:
                    self._policy.touch(key, ctx)
                    self.jobs.settle_locked(job, i, True)
                    continue
                if len(key) > MAX_KEY_BYTES:
                    reason = "key-too-long"
                elif self.degraded is not None:
                    reason = self.degraded
                elif backoff:
                    reason = "backoff"
                elif key in self._doomed or key in self._bad:
                    reason = "busy"
                elif tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
                    reason = "mismatch"
                elif not self._policy.admit(key, size, ctx):
                    reason = "not-admitted"
                else:
                    evicted = self._policy.insert(key, size, ctx)
                    if evicted is None:
                        reason = "no-room"
                    else:
                        self._policy.pin(key)
                        self._index[key] = Entry("writing", size)
                        doomed = self._doom_locked(evicted, evicted=True)
                        work.append((i, key, block, doomed))
                        continue
                self._metrics.rejected(reason)
                job.errors[i] = reason
                self.jobs.settle_locked(job, i, False)
        self._update_occupancy()
        for i, key, block, doomed in work:
            self._write_pool.submit(self.jobs.settled, self._write_task, job, i, key, block, doomed)
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
                entry = self._index.get(key)
                if entry is None or entry.state != "ready":
                    job.errors[i] = "miss"
                    self.jobs.settle_locked(job, i, False)
                elif (tuple(out.shape) != self.block_shape or out.dtype != self.dtype
                      or out.device.type != "cpu" or not out.is_contiguous()):
                    job.errors[i] = "mismatch"
                    self.jobs.settle_locked(job, i, False)
                else:
                    self._policy.pin(key)
                    self._policy.touch(key, ctx)
                    work.append((i, key, out))
        for i, key, out in work:
            self._read_pool.submit(self.jobs.settled, self._read_task, job, i, key, out)
        self.jobs.settle(job, None, True)
        return job.job_id

    def __enter__(self) -> "FilesystemTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
