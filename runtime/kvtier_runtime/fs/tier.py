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
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import metrics
from ..codecs import Codec, CodecError, decode, get_codec, peek_header
from ..config import FilesystemTierConfig
from ..policies import AccessContext, get_policy
from .fileio import AlignedBuffer, FileOps, probe_o_direct, read_whole, write_atomic
from .format import (
    ALIGN,
    HEADER_BYTES,
    FormatError,
    checksum,
    file_bytes_for,
    pack_header,
    parse_header,
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
    done: threading.Event = field(default_factory=threading.Event)


_IO_ERRNO_KIND = {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio", errno.EROFS: "eio"}


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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

        self.root = os.path.join(os.path.realpath(config.root_dir), NAMESPACE)
        os.makedirs(self.root, exist_ok=True)
        self.direct_io = probe_o_direct(self.root, self._ops) if direct_io is None else direct_io
        # Staging buffers hold a whole file; a codec with fallback may emit its wider fallback encoding.
        self._max_payload = self._codec.max_encoded_nbytes(self.block_shape, dtype)
        self._buffer_bytes = file_bytes_for(self._max_payload)
        self._local = threading.local()

        self._lock = threading.Lock()
        self._index: dict[bytes, _Entry] = {}
        self._doomed: set[bytes] = set()
        # Keys whose file failed to read while someone else had them pinned: gone from the index, their
        # accounting and file are dropped at the last unpin.
        self._bad: set[bytes] = set()
        self._policy = get_policy(config.eviction_policy, config.capacity_bytes, admission=config.admission,
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

        metrics.CAPACITY_BYTES.labels(name).set(config.capacity_bytes)
        metrics.FS_BACKOFF.labels(name).set(0)
        self.rebuild_stats = self._rebuild_index()
        self._update_occupancy()
        self._write_pool = ThreadPoolExecutor(config.n_write_threads, thread_name_prefix=f"kvtier-{name}-w")
        self._read_pool = ThreadPoolExecutor(config.n_read_threads, thread_name_prefix=f"kvtier-{name}-r")

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, Any], block_shape: Sequence[int], dtype: torch.dtype, **options: Any
    ) -> "FilesystemTier":
        return cls(FilesystemTierConfig.from_kwargs(kwargs), block_shape, dtype, **options)

    # ---- observation (non-blocking) ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._policy.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._policy.used_bytes

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
                if backoff:
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
        """Results of jobs finished since the last call (each result is returned once)."""
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
        if not job.done.wait(timeout):
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
        """Wait until every submitted job finished (results stay available to get_finished)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [j for j in self._jobs.values() if not j.done.is_set()]
            if not pending:
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending[0].done.wait(left):
                raise TimeoutError(f"{len(pending)} jobs still running after {timeout}s")

    def _check_open(self) -> None:
        # Before any reservation: a job refused by a shut-down pool would leave its keys "writing" and pinned.
        if self._closed:
            raise RuntimeError(f"{self.name}: the filesystem tier is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._write_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)

    def __enter__(self) -> "FilesystemTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- job bookkeeping --------------------------------------------------------------------------------
    def _new_job(self, kind: str, keys: Sequence[bytes]) -> _Job:
        keys_t = tuple(bytes(k) for k in keys)
        job = _Job(next(self._job_ids), kind, keys_t, [False] * len(keys_t), {}, len(keys_t) + 1)
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
        if i is not None:
            job.ok[i] = ok
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
        try:
            ok = task(job, i, *args)
        except Exception:
            log.exception("filesystem tier %s: %s task failed unexpectedly", self.name, job.kind)
            with self._lock:
                job.errors.setdefault(i, "other")
            metrics.FS_ERRORS.labels(self.name, "other").inc()
        finally:
            self._settle(job, i, ok)

    def _write_task(self, job: _Job, i: int, key: bytes, block: torch.Tensor, evicted: list[bytes]) -> bool:
        self._unlink_doomed(evicted)
        ok, kind = False, ""
        started = time.perf_counter()
        try:
            nbytes = self._write_block(key, block)
            ok = True
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
            metrics.FS_ERRORS.labels(self.name, kind).inc()
            if kind == "enospc":
                self._make_real_room(file_bytes_for(self._codec.encoded_nbytes(self.block_shape, self.dtype)))
            if kind in ("enospc", "eio"):
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

    def _write_block(self, key: bytes, block: torch.Tensor) -> int:
        buf, tensor = self._staging()
        src = block if block.is_contiguous() else block.contiguous()
        nbytes = self._codec.encode(src, tensor[HEADER_BYTES : HEADER_BYTES + self._max_payload])
        end = HEADER_BYTES + nbytes
        total = file_bytes_for(nbytes)
        if end < total:  # zero the padding so no stale bytes of an earlier block reach the disk
            tensor[end:total].zero_()
        crc = checksum(buf.mv[HEADER_BYTES:end])
        header = pack_header(
            # the codec actually used (after any fallback), from the blob's own header
            codec=peek_header(tensor[HEADER_BYTES:end]).codec, dtype=self._dtype_name, shape=self.block_shape,
            payload_len=nbytes, payload_crc=crc, key=key,
        )
        buf.mv[:HEADER_BYTES] = header
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

    def _read_task(self, job: _Job, i: int, key: bytes, out: torch.Tensor) -> bool:
        started = time.perf_counter()
        kind = ""
        try:
            self._read_block(key, out)
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
                if self._index.pop(key, None) is not None:
                    if self._policy.is_pinned(key):
                        self._bad.add(key)
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

    def _read_block(self, key: bytes, out: torch.Tensor) -> None:
        buf, tensor = self._staging()
        size = read_whole(self._ops, self.block_path(key), buf.mv, self.direct_io)
        header = parse_header(buf.mv[: min(size, HEADER_BYTES)])
        self._check_header(header, key)
        verify_payload(header, size, buf.mv[HEADER_BYTES:])
        if header.payload_len > self._max_payload:
            raise FormatError("mismatch", f"payload of {header.payload_len} bytes exceeds {self._max_payload}")
        decode(tensor[HEADER_BYTES : HEADER_BYTES + header.payload_len], out=out)

    def _check_header(self, header: Any, key: bytes | None) -> None:
        if key is not None and header.key != key:
            raise FormatError("mismatch", "file holds another key")
        if header.shape != self.block_shape or header.dtype != self._dtype_name:
            raise FormatError(
                "mismatch", f"block is {header.dtype}{list(header.shape)}, tier is {self._dtype_name}{list(self.block_shape)}"
            )

    # ---- eviction / unlink ------------------------------------------------------------------------------
    def _doom_locked(self, keys: Sequence[bytes], *, evicted: bool = False) -> list[bytes]:
        """Forget ``keys`` and mark their files for unlinking. Only ``evicted`` ones (chosen by the policy to
        make room) count as evictions: a corrupt block or an explicit remove is not one."""
        for key in keys:
            self._index.pop(key, None)
            self._doomed.add(key)
        if evicted and keys:
            metrics.EVICTIONS.labels(self.name).inc(len(keys))
        return list(keys)

    def _unlink_doomed(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            try:
                self._ops.unlink(self.block_path(key))
            except FileNotFoundError:
                pass
            except OSError:
                metrics.FS_ERRORS.labels(self.name, "unlink").inc()
            finally:
                with self._lock:
                    self._doomed.discard(key)

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
        metrics.OCCUPANCY_BYTES.labels(self.name).set(self._policy.used_bytes)

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
        with os.scandir(self.root) as top:
            for d1 in top:
                if not self._scan_dir_ok(d1, stats):
                    continue
                with os.scandir(d1.path) as mid:
                    for d2 in mid:
                        if not self._scan_dir_ok(d2, stats):
                            continue
                        with os.scandir(d2.path) as leaf:
                            for f in leaf:
                                self._scan_file(f, d1.name, d2.name, head, stats, found)
        found.sort()
        with self._lock:
            for _, path, key, nbytes in found:
                evicted = self._policy.insert(key, nbytes)
                if evicted is None:
                    stats["evicted"] += 1
                    self._remove_path(path)
                    continue
                for old in evicted:
                    self._index.pop(old, None)
                    stats["evicted"] += 1
                    self._remove_path(self.block_path(old))
                self._index[key] = _Entry("ready", nbytes)
            stats["blocks"] = len(self._index)
        for kind in ("foreign", "corrupt", "truncated", "mismatch", "version"):
            if stats[kind]:
                metrics.FS_ERRORS.labels(self.name, kind).inc(stats[kind])
        if stats["tmp"]:
            metrics.FS_ERRORS.labels(self.name, "torn").inc(stats["tmp"])
        return stats

    def _scan_dir_ok(self, entry: os.DirEntry, stats: dict[str, int]) -> bool:
        if entry.is_dir(follow_symlinks=False) and is_fanout_name(entry.name):
            return True
        # A symlink or stray file in the fan-out could point blocks outside root_dir: remove it.
        stats["foreign"] += 1
        if entry.is_dir(follow_symlinks=False):
            _rmtree_quiet(entry.path)
        else:
            self._remove_path(entry.path)
        return False

    def _scan_file(
        self, f: os.DirEntry, d1: str, d2: str, head: bytearray, stats: dict[str, int],
        found: list[tuple[float, str, bytes, int]],
    ) -> None:
        if is_tmp_name(f.name):
            stats["tmp"] += 1
            self._remove_path(f.path)
            return
        if not is_block_name(f.name) or not f.is_file(follow_symlinks=False):
            stats["foreign"] += 1
            _rmtree_quiet(f.path) if f.is_dir(follow_symlinks=False) else self._remove_path(f.path)
            return
        try:
            st = f.stat(follow_symlinks=False)
            with open(f.path, "rb", buffering=0) as fh:
                n = fh.readinto(head)
            header = parse_header(memoryview(head)[:n])
            self._check_header(header, None)
            if f.path != self.block_path(header.key):
                raise FormatError("mismatch", "file name does not match the key in its header")
            if st.st_size != header.file_bytes:
                raise FormatError("truncated" if st.st_size < header.file_bytes else "corrupt", "length")
        except FormatError as exc:
            stats[exc.kind] += 1
            self._remove_path(f.path)
            return
        except OSError:
            stats["corrupt"] += 1
            self._remove_path(f.path)
            return
        found.append((st.st_mtime, f.path, header.key, header.file_bytes))

    def _remove_path(self, path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _rmtree_quiet(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
