"""Jobs of the tiers behind the host tier (filesystem and remote): ids, per-key settlement, results handed out
once by ``get_finished`` (and to an ``on_complete`` callback as they finish), deadlines (``io_timeout_s``: a job
past it finishes with its late keys failed as ``timeout``), and the read and write thread pools the I/O tasks run
on. Each tier owns a :class:`JobQueue` (composition: the queue knows the tier only by the callbacks it was
given)."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Expired", "Job", "JobQueue", "JobResult"]

# How often drain re-checks a job held open by a read into lent memory (see JobQueue._expire).
_LOG = logging.getLogger("kvtier_runtime.tiers")
_LENT_POLL_S = 0.05


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
class Job:
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
    # Tasks using the caller's memory outside io_lock (format 2's direct path, counted under io_lock): a read
    # straight into it (``lent_reads``, a system call that cannot be called back) or a store's hashes of it
    # (memory speed). While any is, the job cannot expire: finishing it would hand back memory still in use.
    lent: int = 0
    lent_reads: int = 0
    overdue_reported: bool = False


class ErrorCounter(Protocol):
    """What a tier's metrics must offer JobQueue: count ``n`` failed keys of ``kind`` (e.g. ``timeout``)."""

    def error(self, kind: str, n: int = 1) -> None: ...


class Expired(Exception):
    """The job timed out before this task touched the caller's tensor: the task gives up."""


class JobQueue:
    """The jobs of one tier behind the host tier (:class:`~kvtier_runtime.fs.tier.FilesystemTier`,
    :class:`~kvtier_runtime.remote.tier.RemoteTier`): job bookkeeping, waiting, expiry and the I/O pools. A helper
    object each tier owns (``tier.jobs``), told at construction what it needs of the tier:

    ``errors`` counts a job's late keys (``error(kind, n)``, the tier's metrics); ``on_io_failure`` is called when a
    job expires (a filesystem tier counts it towards its store backoff); ``on_lent_read_overrun`` when a read into
    the caller's memory outlives its job's deadline (see :meth:`_expire`; by default ``on_io_failure``).

    :attr:`lock` guards the jobs; a tier whose own state must change in the same step as a job's (a filesystem
    tier's index) uses it as its lock too."""

    def __init__(self, *, name: str, medium: str, io_timeout_s: float, errors: ErrorCounter,
                 on_io_failure: Callable[[], None], on_complete: Callable[[JobResult], None] | None = None,
                 on_lent_read_overrun: Callable[[], None] | None = None,
                 log: logging.Logger = _LOG) -> None:
        # What the tier is, in log lines ("filesystem tier nvme: ..."), and where it logs.
        self.name = name
        self.medium = medium
        self.io_timeout_s = float(io_timeout_s)
        self._errors = errors
        self._on_io_failure = on_io_failure
        self._on_lent_read_overrun = on_lent_read_overrun or on_io_failure
        self._on_complete = on_complete
        self._log = log
        self.lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._finished: OrderedDict[int, JobResult] = OrderedDict()
        self._job_ids = itertools.count(1)
        self._closed = False
        self._running_tasks = 0
        self.read_pool: ThreadPoolExecutor | None = None
        self.write_pool: ThreadPoolExecutor | None = None
        self._at_close: list[Callable[[], None]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def start_pools(self, n_read: int, n_write: int) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The read and write pools the tier's I/O tasks run on (shut down by :meth:`close`)."""
        self.write_pool = ThreadPoolExecutor(n_write, thread_name_prefix=f"kvtier-{self.name}-w")
        self.read_pool = ThreadPoolExecutor(n_read, thread_name_prefix=f"kvtier-{self.name}-r")
        return self.read_pool, self.write_pool

    def count_task(self, delta: int) -> None:
        """A task of the tier's own (not run through :meth:`settled`) starts (+1) or ends (-1): :meth:`close`
        waits for running ones."""
        with self.lock:
            self._running_tasks += delta

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each result is returned once); a job past its
        ``io_timeout_s`` finishes here with its unfinished keys failed as ``timeout``."""
        self._expire_overdue()
        with self.lock:
            out = list(self._finished.values())
            self._finished.clear()
        return out

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (results stay available to get_finished). With
        ``timeout=None`` bounded by ``io_timeout_s`` (a job past it expires), except for a job whose direct read
        into the caller's memory is still in the kernel: that one ends when the read returns (see _expire)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._expire_overdue()
            with self.lock:
                pending = [j for j in self._jobs.values() if not j.done.is_set()]
            if not pending:
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            now = time.monotonic()
            # Jobs past their deadline are waiting for a read into lent memory (see _expire): poll those slowly.
            until_expiry = min((j.deadline - now for j in pending if j.deadline > now), default=_LENT_POLL_S) + 0.001
            step = until_expiry if left is None else min(left, until_expiry)
            if not pending[0].done.wait(step) and left is not None and step >= left:
                raise TimeoutError(f"{len(pending)} jobs still running after {timeout}s")

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        with self.lock:
            overdue = [j for j in self._jobs.values() if j.deadline <= now and not j.done.is_set()]
        for job in overdue:
            self._expire(job)

    def _expire(self, job: Job) -> None:
        """Finish ``job`` now: keys not settled fail as ``timeout``. Taking ``io_lock`` waits for a task that is
        copying to or from the caller's tensor (memory speed, bounded) and stops every later one.

        Format 2's direct path uses the caller's tensor outside ``io_lock`` (``job.lent``): a store hashing it is
        waited for, like a copy (memory speed). A system call reading straight into it (``job.lent_reads``)
        cannot be called back, so finishing the job would let it overwrite memory the caller has reused: the job
        then stays open until the read returns (the next poll or ``get_finished`` expires whatever is left); the
        overrun is logged once, counts towards store backoff, and later loads take the staging path for
        ``io_timeout_s``, which times out cleanly, so a hung disk holds at most the reads already in flight
        (``n_read_threads``)."""
        while True:
            with job.io_lock:
                lent, reads = job.lent, job.lent_reads
                if not lent:
                    job.expired = True
            if not lent or reads:
                break
            time.sleep(0.001)  # a store hashing the caller's row
        if lent:
            if not job.overdue_reported:
                job.overdue_reported = True
                self._log.warning("%s tier %s: load job %d: %d reads into the caller's memory still in the "
                                  "kernel after %.1fs; the job ends when they return", self.medium, self.name,
                                  job.job_id, reads, self.io_timeout_s)
                self._on_lent_read_overrun()
            return
        with self.lock:
            if job.done.is_set():
                return
            late = [i for i, settled in enumerate(job.settled) if not settled]
            for i in late:
                job.errors[i] = "timeout"
            job.remaining = 1
            result = self.settle_locked(job, None, False)
        if late:
            self._log.warning("%s tier %s: %s job %d: %d keys still waiting after %.1fs", self.medium, self.name,
                              job.kind, job.job_id, len(late), self.io_timeout_s)
            self._errors.error("timeout", len(late))
            self._on_io_failure()
        if result is not None and self._on_complete is not None:
            self._on_complete(result)

    def check_open(self) -> None:
        # Before any reservation: a job refused by a shut-down pool would leave its keys "writing" and pinned.
        if self._closed:
            raise RuntimeError(f"{self.name}: the {self.medium} tier is closed")

    def at_close(self, release: Callable[[], None]) -> None:
        """Have :meth:`close` call ``release`` once, after the pools stopped: what else the tier holds (a remote
        tier's probe thread and store connections), released in the order given."""
        self._at_close.append(release)

    def close(self) -> None:
        """Refuse new jobs, wait (bounded by ``io_timeout_s``) for the running ones, stop the pools, then release
        what :meth:`at_close` was given. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain(timeout=self.io_timeout_s)
        except TimeoutError:
            pass
        deadline = time.monotonic() + self.io_timeout_s
        while self._running_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        hung = self._running_tasks > 0
        # Tasks of expired jobs may still sit in a hung system call: then do not wait for them (they touch no
        # caller memory any more), so closing is bounded too.
        for pool in (self.write_pool, self.read_pool):
            if pool is not None:
                pool.shutdown(wait=not hung, cancel_futures=hung)
        for release in self._at_close:
            release()

    # ---- job bookkeeping --------------------------------------------------------------------------------
    def new_job(self, kind: str, keys: Sequence[bytes], timeout_s: float | None = None) -> Job:
        """A job of ``keys``, due ``timeout_s`` from now (by default ``io_timeout_s``)."""
        keys_t = tuple(bytes(k) for k in keys)
        due = self.io_timeout_s if timeout_s is None else timeout_s
        job = Job(next(self._job_ids), kind, keys_t, [False] * len(keys_t), {}, len(keys_t) + 1,
                  time.monotonic() + due, settled=[False] * len(keys_t))
        with self.lock:
            # remaining is len(keys) + 1: the extra count keeps the job open until submit_* has queued every
            # key, and is released by its last line.
            self._jobs[job.job_id] = job
        return job

    def settle(self, job: Job, i: int | None, ok: bool) -> None:
        with self.lock:
            result = self.settle_locked(job, i, ok)
        if result is not None and self._on_complete is not None:
            self._on_complete(result)

    def settle_locked(self, job: Job, i: int | None, ok: bool) -> JobResult | None:
        """Settle key ``i`` of ``job`` (None: the submitter's own count) under :attr:`lock`; the job's result when
        this finished it (the caller hands it to ``on_complete`` after releasing the lock: :meth:`completed`)."""
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
        self._finished[job.job_id] = result
        job.done.set()
        return result

    def completed(self, result: JobResult | None) -> None:
        """Hand a result :meth:`settle_locked` returned to ``on_complete`` (outside the lock)."""
        if result is not None and self._on_complete is not None:
            self._on_complete(result)

    def run_each(self, pool: ThreadPoolExecutor, workers: int, task: Callable[..., bool], job: Job,
                 items: Sequence[tuple[Any, ...]]) -> None:
        """Run ``task(job, *item)`` through :meth:`settled` for every item (its first element the key's index), on at
        most ``workers`` threads of ``pool``: each takes the next item until none is left. One pool task per thread
        instead of one per item: a small block's I/O is a few tens of microseconds, and a pool task per block (its
        future, queue and thread hand-off, on threads contending for the GIL) cost as much again."""
        if not items:
            return
        left = deque(items)

        def drain_items() -> None:
            with self.lock:
                self._running_tasks += 1
            try:
                while True:
                    try:
                        item = left.popleft()  # atomic: the runners share the deque without a lock
                    except IndexError:
                        return
                    self._settled(task, job, *item)
            finally:
                with self.lock:
                    self._running_tasks -= 1

        for _ in range(min(workers, len(items))):
            pool.submit(drain_items)

    def settled(self, task: Callable[..., bool], job: Job, i: int, *args: Any) -> None:
        """Run an I/O task and settle its key whatever happens: an exception escaping a task would otherwise
        vanish in the pool and leave the job unfinished, so ``drain`` without a timeout would hang."""
        with self.lock:
            self._running_tasks += 1
        try:
            self._settled(task, job, i, *args)
        finally:
            with self.lock:
                self._running_tasks -= 1

    def _settled(self, task: Callable[..., bool], job: Job, i: int, *args: Any) -> None:
        """:meth:`settled` of a task already counted as running."""
        ok = False
        try:
            ok = task(job, i, *args)
        except Exception:
            self._log.exception("%s tier %s: %s task failed unexpectedly", self.medium, self.name, job.kind)
            with self.lock:
                job.errors.setdefault(i, "other")
            self._errors.error("other")
        finally:
            self.settle(job, i, ok)
