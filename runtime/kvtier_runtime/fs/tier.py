"""The durable, bounded filesystem tier.

Non-blocking by construction: ``lookup``/``state`` only read an in-memory index, ``submit_store``/``submit_load``
only reserve space and enqueue work on separate write and read thread pools, and completions are collected with
``get_finished()`` (or an ``on_complete`` callback). Nothing here raises into the caller because of the disk: a
bad, missing or unreadable file is a failed key in a :class:`JobResult`, counted in ``kvtier_runtime_fs_errors``.
``store``/``load``/``wait`` are blocking conveniences for tests and benchmarks.

Correctness rules: a block is served only if its header CRC, key, codec-independent shape/dtype, file length and
payload CRC all match; anything else is deleted. Space is accounted by an eviction policy
(``kvtier_runtime.policies``); blocks being written or read are pinned in it so they are never evicted mid-I/O.
An evicted key is "doomed" until its file is unlinked, and cannot be stored again before that, so a late unlink
can never delete a newer copy.
"""
from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import metrics
from ..codecs import Codec, CodecError, KVChunkCodec, decode, get_codec, peek_header
from ..config import ConfigError, FilesystemTierConfig
from ..policies import AccessContext, get_policy
from .fileio import AlignedBuffer, FileOps, probe_o_direct, read_whole, regular_size, write_atomic
from .format import (
    ALIGN,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_OFFSET,
    MAX_KEY_BYTES,
    FormatError,
    block_mac,
    checksum,
    file_bytes_for,
    mac_key_from_bytes,
    pack_header,
    parse_header,
    verify_mac,
    verify_payload,
)
from .paths import NAMESPACE, TMP_MARK, block_relpath, is_block_name, is_fanout_name, is_tmp_name

log = logging.getLogger(__name__)


class KeyState(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # a store is in flight: ask again later


@dataclass(frozen=True)
class LookupRun:
    """Result of a prefix lookup: ``hits`` leading keys are ready; ``pending`` if the run stopped at a key whose
    store is still in flight (a caller may wait for it instead of recomputing)."""

    hits: int
    pending: bool


@dataclass(frozen=True)
class JobResult:
    job_id: int
    kind: str  # "store" | "load"
    keys: tuple[bytes, ...]
    ok: tuple[bool, ...]
    # per failed key, why (e.g. "corrupt", "enospc", "backoff", "no-room", "miss")
    errors: Mapping[int, str] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return all(self.ok)


@dataclass
class _Entry:
    state: str  # "writing" | "ready"
    nbytes: int


@dataclass
class _Job:
    job_id: int
    kind: str
    keys: tuple[bytes, ...]
    ok: list[bool]
    errors: dict[int, str]
    remaining: int
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    # Held by a task while it reads or writes the caller's tensor; expiring the job takes it, so once a job has
    # timed out no late task touches memory the caller may already have reused.
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    settled: list[bool] = field(default_factory=list)
    expired: bool = False


class _Expired(Exception):
    """The job timed out before this task touched the caller's tensor: the task gives up."""


_IO_ERRNO_KIND = {
    errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio", errno.EROFS: "erofs",
    errno.EACCES: "eacces", errno.EPERM: "eacces",
}
# Kinds that say the disk or directory itself is failing (not one bad file): repeated, they trigger backoff.
_BACKOFF_KINDS = frozenset({"enospc", "eio", "erofs", "eacces", "timeout"})
# How often stores retry unlinking files that could not be deleted (their bytes stay counted until then).
_STUCK_RETRY_S = 1.0


def _read_mac_key(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4096)
    except OSError as exc:
        raise ConfigError(f"mac_key_file: {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return mac_key_from_bytes(raw, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



def _may_fall_back(codec: Codec | KVChunkCodec) -> bool:
    """Whether a block may be stored with a wider codec than ``codec.name`` (the block's own header then says)."""
    if isinstance(codec, KVChunkCodec):  # the engine path's layout-aware codec: a verifying one walks its chain
        return len(codec.chain) > 1
    return bool(codec.fallback and codec.fallback_codec is not None)

class FilesystemTier:
    """Blocks of one fixed shape and dtype, stored as checksummed files under ``root_dir``, bounded in bytes."""

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
        # The tier blocks come from and go to, for the promotion/demotion metrics (vLLM's CPU tier by default).
        self.peer = peer
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self._dtype_name = _torch_dtype_name(dtype)
        self._codec = codec or get_codec(config.codec, fallback=config.codec_fallback)
        self._ops = file_ops or FileOps()
        self._on_complete = on_complete
        self._backoff_after = backoff_after
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock
        self._mac_key = _read_mac_key(config.mac_key_file)
        self._io_timeout_s = float(config.io_timeout_s)

        self.root = os.path.join(os.path.realpath(config.root_dir), NAMESPACE)
        # Why the tier cannot store (a read-only or forbidden directory), or None: it then serves what it finds
        # and refuses every store with this reason, instead of failing the engine's start-up.
        self.degraded: str | None = None
        self._open_namespace()
        if self.degraded is not None:
            self.direct_io = False if direct_io is None else direct_io
        else:
            self.direct_io = probe_o_direct(self.root, self._ops) if direct_io is None else direct_io
        # Staging buffers hold a whole file; a codec with fallback may emit its wider fallback encoding.
        self._max_payload = self._codec.max_encoded_nbytes(self.block_shape, dtype)
        self._nominal_file_bytes = file_bytes_for(self._codec.encoded_nbytes(self.block_shape, dtype))
        self._buffer_bytes = file_bytes_for(self._max_payload)
        self._local = threading.local()

        self._lock = threading.Lock()
        self._index: dict[bytes, _Entry] = {}
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
        self._jobs: dict[int, _Job] = {}
        self._finished: OrderedDict[int, JobResult] = OrderedDict()
        # Jobs someone is blocked on in wait(): their results go to the waiter, never to get_finished().
        self._claimed: dict[int, JobResult | None] = {}
        self._job_ids = itertools.count(1)
        self._tmp_ids = itertools.count(1)
        self._made_dirs: set[str] = set()
        self._consecutive_failures = 0
        self._backoff_until = 0.0
        self._closed = False
        self._running_tasks = 0

        metrics.CAPACITY_BYTES.labels(name).set(config.capacity_bytes)
        metrics.FS_BACKOFF.labels(name).set(0)
        self.rebuild_stats = self._rebuild_index() if os.path.isdir(self.root) else {"blocks": 0}
        self._update_occupancy()
        self._write_pool = ThreadPoolExecutor(config.n_write_threads, thread_name_prefix=f"kvtier-{name}-w")
        self._read_pool = ThreadPoolExecutor(config.n_read_threads, thread_name_prefix=f"kvtier-{name}-r")

    def _open_namespace(self) -> None:
        """Create ``<root_dir>/kvtier-blocks-v1`` and make sure it is a real directory.

        A symlink there is refused: start-up removes every file of the namespace it does not recognise, and
        following a link would do that in the link's target. A read-only or forbidden directory degrades the
        tier (see ``degraded``) instead of raising a bare OSError into the engine."""
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            os.mkdir(self.root, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            self._degrade(exc)
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return  # degraded above: nothing to serve
        except OSError as exc:
            self._degrade(exc)
            return
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"root_dir: {self.root} is a symlink; refusing it, since start-up cleanup would "
                              "delete files in its target (make it a real directory)")
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"root_dir: {self.root} exists and is not a directory")
        if self.degraded is None and not os.access(self.root, os.W_OK):
            read_only = bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
            code = errno.EROFS if read_only else errno.EACCES
            self._degrade(OSError(code, os.strerror(code)))

    def _degrade(self, exc: OSError) -> None:
        kind = _IO_ERRNO_KIND.get(exc.errno or 0, "other")
        self.degraded = kind
        log.error("filesystem tier %s: %s is unusable for stores (%s: %s); serving existing blocks only",
                  self.name, self.root, kind, exc.strerror or exc)
        metrics.FS_ERRORS.labels(self.name, kind).inc()

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, Any], block_shape: Sequence[int], dtype: torch.dtype, **options: Any
    ) -> "FilesystemTier":
        return cls(FilesystemTierConfig.from_kwargs(kwargs), block_shape, dtype, **options)

    # ---- observation (non-blocking) ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the tier's files on disk: blocks held, plus files that could not be deleted yet."""
        return self._policy.used_bytes + sum(n for _, n in self._stuck.values())

    @property
    def in_backoff(self) -> bool:
        return self._clock() < self._backoff_until

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
        metrics.LOOKUPS.labels(self.name).inc(min(len(keys), hits + 1))
        metrics.HITS.labels(self.name).inc(hits)
        return LookupRun(hits, pending)

    def block_path(self, key: bytes) -> str:
        return os.path.join(self.root, block_relpath(key))

    # ---- jobs (non-blocking) ----------------------------------------------------------------------------
    def submit_store(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], ctx: AccessContext | None = None
    ) -> int:
        """Queue writes of ``blocks`` under ``keys``; the tensors must stay unchanged until the job finishes.

        Keys already present (or being written) succeed without I/O. A key is refused (a failed key, no
        exception) in backoff, when the admission filter declines it, or when pinned blocks leave no room.
        """
        self._check_open()
        if len(keys) != len(blocks):
            raise ValueError(f"blocks: {len(blocks)} blocks for {len(keys)} keys")
        for key in keys:
            block_relpath(key)  # rejects non-bytes or empty keys with a ValueError naming the key
        keys = [bytes(k) for k in keys]
        job = self._new_job("store", keys)
        size = file_bytes_for(self._codec.encoded_nbytes(self.block_shape, self.dtype))
        work: list[tuple[int, bytes, torch.Tensor, list[bytes]]] = []
        backoff = self.in_backoff
        with self._lock:
            for i, (key, block) in enumerate(zip(keys, blocks)):
                if key in self._index:
                    self._policy.touch(key, ctx)
                    self._settle_locked(job, i, True)
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
                        self._index[key] = _Entry("writing", size)
                        doomed = self._doom_locked(evicted, evicted=True)
                        work.append((i, key, block, doomed))
                        continue
                metrics.STORES_REJECTED.labels(self.name, reason).inc()
                job.errors[i] = reason
                self._settle_locked(job, i, False)
        self._update_occupancy()
        for i, key, block, doomed in work:
            self._write_pool.submit(self._settled, self._write_task, job, i, key, block, doomed)
        self._settle(job, None, True)
        return job.job_id

    def submit_load(
        self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], ctx: AccessContext | None = None
    ) -> int:
        """Queue reads of ``keys`` into ``outs`` (contiguous CPU tensors of the tier's shape and dtype); any
        other destination fails its key as ``mismatch`` here, before a read could blame the file for it."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError(f"outs: {len(outs)} tensors for {len(keys)} keys")
        keys = [bytes(k) for k in keys]
        job = self._new_job("load", keys)
        work: list[tuple[int, bytes, torch.Tensor]] = []
        with self._lock:
            for i, (key, out) in enumerate(zip(keys, outs)):
                entry = self._index.get(key)
                if entry is None or entry.state != "ready":
                    job.errors[i] = "miss"
                    self._settle_locked(job, i, False)
                elif (tuple(out.shape) != self.block_shape or out.dtype != self.dtype
                      or out.device.type != "cpu" or not out.is_contiguous()):
                    job.errors[i] = "mismatch"
                    self._settle_locked(job, i, False)
                else:
                    self._policy.pin(key)
                    self._policy.touch(key, ctx)
                    work.append((i, key, out))
        for i, key, out in work:
            self._read_pool.submit(self._settled, self._read_task, job, i, key, out)
        self._settle(job, None, True)
        return job.job_id

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each result is returned once); a job past its
        ``io_timeout_s`` finishes here with its unfinished keys failed as ``timeout``."""
        self._expire_overdue()
        with self._lock:
            out = list(self._finished.values())
            self._finished.clear()
        return out

    def wait(self, job_id: int, timeout: float | None = None) -> JobResult:
        """Block until ``job_id`` finished and take its result (it is then not returned by get_finished)."""
        with self._lock:
            if job_id in self._finished:
                return self._finished.pop(job_id)
            job = self._jobs.get(job_id)
            if job is None or job_id in self._claimed:
                raise KeyError(f"job_id: {job_id} is unknown or its result was already taken")
            self._claimed[job_id] = None
        # Never longer than the job's own deadline, whatever the caller asked: then the job expires.
        limit = job.deadline - time.monotonic()
        if not job.done.wait(max(0.0, limit if timeout is None else min(timeout, limit))):
            if timeout is None or timeout >= limit:
                self._expire(job)
        if not job.done.is_set():
            with self._lock:  # give the result back to get_finished() when it arrives
                if self._claimed.get(job_id) is None:
                    del self._claimed[job_id]
                else:
                    self._finished[job_id] = self._claimed.pop(job_id)  # type: ignore[assignment]
            raise TimeoutError(f"job {job_id} did not finish within {timeout}s")
        with self._lock:
            result = self._claimed.pop(job_id)
        assert result is not None
        return result

    # ---- blocking conveniences --------------------------------------------------------------------------
    def store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], timeout: float | None = 60) -> JobResult:
        return self.wait(self.submit_store(keys, blocks), timeout)

    def load(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], timeout: float | None = 60) -> JobResult:
        return self.wait(self.submit_load(keys, outs), timeout)

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

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (results stay available to get_finished). Bounded even with
        ``timeout=None``: a job past its ``io_timeout_s`` expires."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._expire_overdue()
            with self._lock:
                pending = [j for j in self._jobs.values() if not j.done.is_set()]
            if not pending:
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            until_expiry = max(0.0, min(j.deadline for j in pending) - time.monotonic()) + 0.001
            step = until_expiry if left is None else min(left, until_expiry)
            if not pending[0].done.wait(step) and left is not None and step >= left:
                raise TimeoutError(f"{len(pending)} jobs still running after {timeout}s")

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [j for j in self._jobs.values() if j.deadline <= now and not j.done.is_set()]
        for job in overdue:
            self._expire(job)

    def _expire(self, job: _Job) -> None:
        """Finish ``job`` now: keys not settled fail as ``timeout``. Taking ``io_lock`` waits for a task that is
        copying to or from the caller's tensor (memory speed, bounded) and stops every later one."""
        with job.io_lock:
            job.expired = True
        with self._lock:
            if job.done.is_set():
                return
            late = [i for i, settled in enumerate(job.settled) if not settled]
            for i in late:
                job.errors[i] = "timeout"
            job.remaining = 1
            result = self._settle_locked(job, None, False)
        if late:
            log.warning("filesystem tier %s: %s job %d: %d keys still waiting for the disk after %.1fs",
                        self.name, job.kind, job.job_id, len(late), self._io_timeout_s)
            metrics.FS_ERRORS.labels(self.name, "timeout").inc(len(late))
            self._record_io_failure()
        if result is not None and self._on_complete is not None:
            self._on_complete(result)

    def _check_open(self) -> None:
        # Before any reservation: a job refused by a shut-down pool would leave its keys "writing" and pinned.
        if self._closed:
            raise RuntimeError(f"{self.name}: the filesystem tier is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.drain(timeout=self._io_timeout_s)
        except TimeoutError:
            pass
        deadline = time.monotonic() + self._io_timeout_s
        while self._running_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        hung = self._running_tasks > 0
        # Tasks of expired jobs may still sit in a hung system call: then do not wait for them (they touch no
        # caller memory any more), so closing is bounded too.
        self._write_pool.shutdown(wait=not hung, cancel_futures=hung)
        self._read_pool.shutdown(wait=not hung, cancel_futures=hung)

    def __enter__(self) -> "FilesystemTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- job bookkeeping --------------------------------------------------------------------------------
    def _new_job(self, kind: str, keys: Sequence[bytes]) -> _Job:
        keys_t = tuple(bytes(k) for k in keys)
        job = _Job(next(self._job_ids), kind, keys_t, [False] * len(keys_t), {}, len(keys_t) + 1,
                   time.monotonic() + self._io_timeout_s, settled=[False] * len(keys_t))
        with self._lock:
            # remaining is len(keys) + 1: the extra count keeps the job open until submit_* has queued every
            # key, and is released by its last line.
            self._jobs[job.job_id] = job
        return job

    def _settle(self, job: _Job, i: int | None, ok: bool) -> None:
        with self._lock:
            result = self._settle_locked(job, i, ok)
        if result is not None and self._on_complete is not None:
            self._on_complete(result)

    def _settle_locked(self, job: _Job, i: int | None, ok: bool) -> JobResult | None:
        if job.done.is_set():  # expired: a late task's outcome is no longer the caller's
            return None
        if i is not None:
            job.ok[i] = ok
            job.settled[i] = True
        job.remaining -= 1
        if job.remaining:
            return None
        result = JobResult(job.job_id, job.kind, job.keys, tuple(job.ok), dict(job.errors))
        del self._jobs[job.job_id]
        if job.job_id in self._claimed:
            self._claimed[job.job_id] = result
        else:
            self._finished[job.job_id] = result
        job.done.set()
        return result

    # ---- I/O tasks (pool threads) -----------------------------------------------------------------------
    def _staging(self) -> tuple[AlignedBuffer, torch.Tensor]:
        local = self._local
        if getattr(local, "buf", None) is None:
            local.buf = AlignedBuffer(self._buffer_bytes + ALIGN)
            local.tensor = torch.frombuffer(local.buf.mv, dtype=torch.uint8)
        return local.buf, local.tensor

    def _settled(self, task: Callable[..., bool], job: _Job, i: int, *args: Any) -> None:
        """Run an I/O task and settle its key whatever happens: an exception escaping a task would otherwise
        vanish in the pool and leave the job unfinished, so a waiter (TieredStore waits without a timeout)
        would hang."""
        ok = False
        with self._lock:
            self._running_tasks += 1
        try:
            ok = task(job, i, *args)
        except Exception:
            log.exception("filesystem tier %s: %s task failed unexpectedly", self.name, job.kind)
            with self._lock:
                job.errors.setdefault(i, "other")
            metrics.FS_ERRORS.labels(self.name, "other").inc()
        finally:
            self._settle(job, i, ok)
            with self._lock:
                self._running_tasks -= 1

    def _write_task(self, job: _Job, i: int, key: bytes, block: torch.Tensor, evicted: list[bytes]) -> bool:
        self._unlink_doomed(evicted)
        if self._stuck:
            self._retry_stuck()
        ok, kind = False, ""
        started = time.perf_counter()
        try:
            nbytes = self._write_block(job, key, block)
            ok = True
        except _Expired:
            kind = "timeout"
        except FormatError as exc:
            kind = exc.kind
        except OSError as exc:
            kind = _IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except Exception:  # a codec or programming fault must not kill the pool thread or reach the engine
            kind = "other"
        late: list[bytes] = []
        with self._lock:
            self._policy.unpin(key)
            entry = self._index[key]
            if ok and file_bytes_for(nbytes) != entry.nbytes:
                # The codec fell back to a wider encoding: account the real size (this may evict more).
                self._policy.remove(key)
                more = self._policy.insert(key, file_bytes_for(nbytes))
                if more is None:
                    ok, kind = False, "no-room"
                    late = self._doom_locked([key])
                else:
                    entry.nbytes = file_bytes_for(nbytes)
                    late = self._doom_locked(more, evicted=True)
            if ok:
                entry.state = "ready"
            else:
                if kind != "no-room":
                    self._policy.remove(key)
                    del self._index[key]
                job.errors[i] = kind
        self._unlink_doomed(late)
        if ok:
            with self._lock:  # _record_io_failure updates it under the lock from other pool threads
                self._consecutive_failures = 0
            metrics.FS_BACKOFF.labels(self.name).set(0)
            metrics.DEMOTIONS.labels(self.peer, self.name).inc()
            metrics.BYTES_MOVED.labels(self.peer, self.name).inc(block.numel() * block.element_size())
            metrics.TRANSFER_SECONDS.labels(self.peer, self.name).observe(time.perf_counter() - started)
        else:
            if kind != "timeout":  # counted once, when the job expired
                metrics.FS_ERRORS.labels(self.name, kind).inc()
            if kind == "enospc":
                self._make_real_room(file_bytes_for(self._codec.encoded_nbytes(self.block_shape, self.dtype)))
            if kind in _BACKOFF_KINDS and kind != "timeout":
                self._record_io_failure()
        self._update_occupancy()
        return ok

    def _make_real_room(self, nbytes: int) -> None:
        """The disk is fuller than our accounting (capacity set above the free space, or other tenants): free
        two blocks' worth of our own coldest blocks so the tier keeps working at the disk's real size instead
        of failing every store."""
        with self._lock:
            evicted = self._policy.evict(min(2 * nbytes, self._policy.used_bytes - self._policy.pinned_bytes))
            doomed = self._doom_locked(evicted or [], evicted=True)
        self._unlink_doomed(doomed)

    def _write_block(self, job: _Job, key: bytes, block: torch.Tensor) -> int:
        buf, tensor = self._staging()
        with job.io_lock:  # the only read of the caller's tensor
            if job.expired:
                raise _Expired()
            src = block if block.is_contiguous() else block.contiguous()
            nbytes = self._codec.encode(src, tensor[HEADER_BYTES : HEADER_BYTES + self._max_payload])
        end = HEADER_BYTES + nbytes
        total = file_bytes_for(nbytes)
        if end < total:  # zero the padding so no stale bytes of an earlier block reach the disk
            tensor[end:total].zero_()
        crc = checksum(buf.mv[HEADER_BYTES:end])
        header = pack_header(
            # the codec actually used (after any fallback), from the blob's own header
            codec=self._written_codec(tensor[HEADER_BYTES:end]), dtype=self._dtype_name, shape=self.block_shape,
            payload_len=nbytes, payload_crc=crc, key=key,
        )
        buf.mv[:HEADER_BYTES] = header
        if self._mac_key is not None:
            buf.mv[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = block_mac(self._mac_key, buf.mv, buf.mv[HEADER_BYTES:end])
        final = self.block_path(key)
        directory = os.path.dirname(final)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        tmp = f"{final}{TMP_MARK}{os.getpid()}.{next(self._tmp_ids)}"
        try:
            write_atomic(self._ops, tmp, final, buf.mv[:total], self.direct_io)
        except FileNotFoundError:  # the fan-out directory was removed behind our back: recreate it once
            os.makedirs(directory, exist_ok=True)
            write_atomic(self._ops, tmp, final, buf.mv[:total], self.direct_io)
        return nbytes

    def _written_codec(self, blob: torch.Tensor) -> str:
        # Parsing the blob's header costs ~0.4 ms of GIL-held Python per block (measured in the fs bench
        # breakdown); only a codec that can fall back needs it to learn what it wrote.
        if not _may_fall_back(self._codec):
            return self._codec.name
        return peek_header(blob).codec

    def _read_task(self, job: _Job, i: int, key: bytes, out: torch.Tensor) -> bool:
        started = time.perf_counter()
        kind = ""
        try:
            self._read_block(job, key, out)
        except _Expired:
            pass  # the caller gave up on this key: the block itself is fine
        except FormatError as exc:
            kind = exc.kind
        except FileNotFoundError:
            kind = "missing"
        except OSError as exc:
            kind = _IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except CodecError:
            kind = "corrupt"
        except Exception:
            kind = "other"
        with self._lock:
            doomed = self._unpin_locked(key)
            if kind:
                job.errors[i] = kind
                # A block that failed to read is never served again: forget it and delete the file (at once,
                # or at the last unpin if another transfer still holds it).
                if key in self._index:
                    if self._policy.is_pinned(key):
                        self._bad.add(key)
                        del self._index[key]
                    else:
                        self._policy.remove(key)
                        doomed += self._doom_locked([key])
        self._unlink_doomed(doomed)
        if kind:
            metrics.FS_ERRORS.labels(self.name, kind).inc()
            self._update_occupancy()
        else:
            metrics.PROMOTIONS.labels(self.name, self.peer).inc()
            metrics.BYTES_MOVED.labels(self.name, self.peer).inc(out.numel() * out.element_size())
            metrics.TRANSFER_SECONDS.labels(self.name, self.peer).observe(time.perf_counter() - started)
        return not kind

    def _read_block(self, job: _Job, key: bytes, out: torch.Tensor) -> None:
        buf, tensor = self._staging()
        size = read_whole(self._ops, self.block_path(key), buf.mv, self.direct_io)
        header = parse_header(buf.mv[: min(size, HEADER_BYTES)])
        self._check_header(header, key)
        # With a MAC key the MAC is the integrity check (it catches every change a CRC catches), so the CRC pass
        # over the payload is skipped: one hash per block instead of two.
        verify_payload(header, size, buf.mv[HEADER_BYTES:], check_crc=self._mac_key is None)
        if header.payload_len > self._max_payload:
            raise FormatError("mismatch", f"payload of {header.payload_len} bytes exceeds {self._max_payload}")
        payload = buf.mv[HEADER_BYTES : HEADER_BYTES + header.payload_len]
        if self._mac_key is not None:
            verify_mac(self._mac_key, buf.mv[:HEADER_BYTES], payload)
        with job.io_lock:  # the only write of the caller's tensor
            if job.expired:
                raise _Expired()
            decode(tensor[HEADER_BYTES : HEADER_BYTES + header.payload_len], out=out)

    def _check_header(self, header: Any, key: bytes | None) -> None:
        if key is not None and header.key != key:
            raise FormatError("mismatch", "file holds another key")
        if header.shape != self.block_shape or header.dtype != self._dtype_name:
            raise FormatError(
                "mismatch", f"block is {header.dtype}{list(header.shape)}, tier is {self._dtype_name}{list(self.block_shape)}"
            )

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
            metrics.EVICTIONS.labels(self.name).inc(len(keys))
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
                metrics.FS_ERRORS.labels(self.name, "unlink").inc()
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
        directory gone and recreates it (_write_block)."""
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

    # ---- backoff ----------------------------------------------------------------------------------------
    def _record_io_failure(self) -> None:
        with self._lock:
            self._consecutive_failures += 1
            over = self._consecutive_failures - self._backoff_after
            if over >= 0:
                delay = min(self._backoff_max_s, self._backoff_base_s * (2 ** min(over, 30)))
                self._backoff_until = self._clock() + delay
                metrics.FS_BACKOFF.labels(self.name).set(1)

    def _update_occupancy(self) -> None:
        metrics.OCCUPANCY_BYTES.labels(self.name).set(self.used_bytes)

    # ---- start-up ---------------------------------------------------------------------------------------
    def _rebuild_index(self) -> dict[str, int]:
        """Rebuild the index from block headers; remove temporary, torn, foreign and mismatched files.

        Only our own namespace directory is scanned and cleaned: files elsewhere under root_dir are left alone.
        Blocks are inserted oldest first (by mtime) so the eviction order starts close to the previous run's.
        """
        stats = {"blocks": 0, "tmp": 0, "foreign": 0, "corrupt": 0, "truncated": 0, "mismatch": 0,
                 "version": 0, "evicted": 0}
        found: list[tuple[float, str, bytes, int]] = []
        head = bytearray(HEADER_BYTES)
        # Walked by directory file descriptors opened with O_NOFOLLOW at every level: a symlink swapped in for
        # the namespace, a fan-out directory or a block file is never followed, so cleanup cannot reach outside.
        top = _open_dir(self.root, None)
        if top is None:
            raise ConfigError(f"root_dir: {self.root} is a symlink or not a directory; refusing it, since "
                              "start-up cleanup would delete files in its target")
        try:
            for d1 in os.listdir(top):
                fd1 = self._scan_dir(top, d1, stats)
                if fd1 is None:
                    continue
                try:
                    for d2 in os.listdir(fd1):
                        fd2 = self._scan_dir(fd1, d2, stats)
                        if fd2 is None:
                            continue
                        try:
                            for name in os.listdir(fd2):
                                self._scan_file(fd2, name, d1, d2, head, stats, found)
                        finally:
                            os.close(fd2)
                        _rmdir_if_empty(fd1, d2)  # left by an earlier run, or emptied by the scan
                finally:
                    os.close(fd1)
                _rmdir_if_empty(top, d1)
        finally:
            os.close(top)
        found.sort()
        with self._lock:
            for _, path, key, nbytes in found:
                evicted = self._policy.insert(key, nbytes)
                if evicted is None:
                    stats["evicted"] += 1
                    self._remove_path_locked(path)
                    continue
                for old in evicted:
                    self._index.pop(old, None)
                    stats["evicted"] += 1
                    self._remove_path_locked(self.block_path(old))
                self._index[key] = _Entry("ready", nbytes)
            stats["blocks"] = len(self._index)
        for kind in ("foreign", "corrupt", "truncated", "mismatch", "version"):
            if stats[kind]:
                metrics.FS_ERRORS.labels(self.name, kind).inc(stats[kind])
        if stats["tmp"]:
            metrics.FS_ERRORS.labels(self.name, "torn").inc(stats["tmp"])
        return stats

    def _scan_dir(self, parent: int, name: str, stats: dict[str, int]) -> int | None:
        """A descriptor of fan-out directory ``name``, or None after removing whatever else is there (a symlink
        or stray file in the fan-out could point blocks outside root_dir)."""
        if is_fanout_name(name):
            fd = _open_dir(name, parent)
            if fd is not None:
                return fd
        stats["foreign"] += 1
        _remove_entry(parent, name)
        return None

    def _scan_file(
        self, dir_fd: int, name: str, d1: str, d2: str, head: bytearray, stats: dict[str, int],
        found: list[tuple[float, str, bytes, int]],
    ) -> None:
        if is_tmp_name(name):
            stats["tmp"] += 1
            _remove_entry(dir_fd, name)
            return
        if not is_block_name(name):
            stats["foreign"] += 1
            _remove_entry(dir_fd, name)
            return
        relpath = f"{d1}/{d2}/{name}"
        try:
            # O_NONBLOCK: a FIFO here must not block start-up; O_NOFOLLOW: a symlink is not a block.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            stats["foreign"] += 1
            _remove_entry(dir_fd, name)
            return
        try:
            st = os.fstat(fd)
            size = regular_size(self._ops, fd)
            n = os.preadv(fd, [head], 0)
            header = parse_header(memoryview(head)[:n])
            self._check_header(header, None)
            if relpath != block_relpath(header.key):
                raise FormatError("mismatch", "file name does not match the key in its header")
            if size != header.file_bytes:
                raise FormatError("truncated" if size < header.file_bytes else "corrupt", "length")
        except FormatError as exc:
            stats[exc.kind] += 1
            _remove_entry(dir_fd, name)
            return
        except OSError:
            stats["corrupt"] += 1
            _remove_entry(dir_fd, name)
            return
        finally:
            os.close(fd)
        found.append((st.st_mtime, os.path.join(self.root, relpath), header.key, header.file_bytes))

    def _remove_path_locked(self, path: str) -> None:
        try:
            os.unlink(path)
            self._prune_fanout(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError:
            try:
                nbytes = os.lstat(path).st_size
            except OSError:
                return
            self._stuck_locked(path, None, nbytes)


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """A descriptor of directory ``name`` (relative to ``dir_fd``), or None if it is a symlink or not a directory."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (NotADirectoryError, FileNotFoundError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


def _rmdir_if_empty(dir_fd: int, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:  # not empty, gone, or not a directory (the scan removed strays already)
        pass


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the directory open at ``dir_fd`` without following it: a symlink is unlinked, never
    its target; a directory is removed by descriptors (shutil.rmtree's symlink-safe walk)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


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
