"""kvtier's remote tier: chunks in a Valkey/Redis store shared by every replica of one model.

The books (:class:`kvtier_runtime.store.books.OffloadBooks`) drive it like a filesystem tier -- ``state`` on
lookups, ``submit_store`` (write-through from the host tier), ``submit_load`` (promotion into a host row),
``get_finished`` each scheduler step -- and nothing here waits for the network on the caller's thread:

* ``state`` answers from a bounded local presence cache. A key it knows nothing about is queued for a probe
  (``EXISTS``, every queued key in one pipeline, on a probe thread) and answers ``PENDING``; the books answer vLLM
  ``retry``, vLLM keeps scanning the request's keys (each queued too) and asks again next step. A store that is down
  or still connecting answers ``MISS`` at once: no lookup ever waits for a connection attempt.
* Loads and stores go to worker threads that batch queued keys into one pipeline (``GET`` / ``SET``) per round
  trip. Every job has a deadline (``io_timeout_s``, the job machinery both tiers share: :mod:`kvtier_runtime.tiers.jobs`);
  a late key fails as ``timeout`` and a late reply never touches a host row the books may have reused.
* Every fault is a failed key with a reason, never an exception into the engine: ``down`` (refused, reset,
  cluster slot not served), ``timeout``, ``full`` (a write refused by the store's maxmemory under ``noeviction``),
  ``auth``, and for values ``evicted`` (gone since the probe), ``forged`` (does not verify under this scope's key:
  written without it, altered, or moved from another key), ``corrupt``/``truncated``/``foreign``, ``version`` (an
  older format, e.g. an unencrypted value), ``mismatch`` (a row of another shape).
  ``down``/``auth``, or three ``timeout``s in a row, mark the store down for a backoff (1 s doubling to 30 s):
  lookups miss at once, stores are refused, and one background reconnect decides when it is back.

Tenancy: every key starts with the tier's scope (``kvtier:<scope>:<identity>:...``, :mod:`.identity`) and every
value is sealed with AES-256-GCM under a key derived from the tenant's key file, the scope and the model identity
(:mod:`.format`); replicas of one model in one scope share, other scopes neither read, forge nor evict them (a store
ACL per tenant keeps them from deleting or overwriting too: docs/remote.md).

Capacity: kvtier keeps, per scope and model identity, a sorted set of the chunks it wrote
(``kvtier:<scope>:<identity>:index``, score = last write or read). After each store batch, if the set holds more
chunks than ``capacity_bytes`` allows (at the largest value size, its key included), the oldest are popped and
deleted. Used bytes = entries x that size, an upper bound: the store's own eviction (maxmemory + allkeys-lru, the
fleet-wide bound) may drop values the set still lists, which then read as ``evicted`` misses and leave the set as
they are popped. Replicas of one scope share the set, so the budget is fleet-wide per scope and model (another
scope's trim pops its own set only); concurrent writers may overshoot it by at most one batch each before the next
trim.
"""
from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from ..codecs import STATS, Codec, CodecError, CodecHeader, KVChunkCodec, decode, get_codec
from ..codecs.base import PassthroughCodec
from ..config import ConfigError, RemoteTierConfig
from ..policies import AccessContext
from ..tiers.backoff import Backoff
from ..tiers.base import KeyState
from ..tiers.jobs import Expired, Job, JobQueue, JobResult
from ..tiers.keys import read_mac_key
from .client import RemoteStore, failure_kind
from .format import RemoteFormatError, Sealer, value_bytes
from .tier_metrics import RemoteMetrics
from .identity import chunk_key, index_key, key_prefix

log = logging.getLogger("kvtier_runtime.remote")

__all__ = ["RemoteTier", "JobResult", "KeyState"]

# An offload key is a 32-byte block hash + a 4-byte group index: the size the capacity arithmetic assumes (a chunk
# costs the store its value and its key, hex-encoded after the prefix).
NOMINAL_KEY_BYTES = 36
# Faults that mean the store itself is unusable (mark it down at once); "timeout" needs TIMEOUTS_TO_DOWN in a row.
_DOWN_KINDS = frozenset({"down", "auth"})
TIMEOUTS_TO_DOWN = 3
# Job deadlines, in io_timeout_s. Every socket operation is bounded by io_timeout_s (a slow store fails there and is
# marked down); a job's deadline is the backstop, and also covers the wait behind this process's own queue: a
# long prefix is promoted as many loads at once, a prefill as many write-throughs. A request waits on loads (4x);
# only pinned host rows wait on a write-through (8x).
LOAD_DEADLINE_FACTOR = 4
STORE_DEADLINE_FACTOR = 8
# Values refused for what they hold (not for a store fault): logged, since they mean a writer without the key or
# a damaged store.
_REFUSED_KINDS = frozenset({"forged", "corrupt", "truncated", "foreign", "version"})
_HEX = frozenset(b"0123456789abcdef")


class _Lane:
    """A queue drained by up to ``workers`` pool tasks, each taking what is queued (``batch_of`` decides how
    much) and handing it to ``run`` as one batch: one round trip for many keys once there is a backlog."""

    def __init__(self, pool: ThreadPoolExecutor, run: Callable[[list[Any]], None], workers: int,
                 batch_of: Callable[[deque[Any]], int], count: Callable[[int], None]) -> None:
        self._pool = pool
        self._run = run
        self._workers = workers
        self._batch_of = batch_of
        self._count = count  # +1/-1 around a running batch (the job queue's count_task)
        self._items: deque[Any] = deque()
        self._active = 0
        self._lock = threading.Lock()

    def put(self, items: Sequence[Any]) -> None:
        with self._lock:
            self._items.extend(items)
            spawn = self._active < self._workers
            if spawn:
                self._active += 1
        if spawn:
            try:
                self._pool.submit(self._drain)
            except RuntimeError:  # the pool is shut down (tier closing): the jobs expire
                with self._lock:
                    self._active -= 1

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._active -= 1
                    return
                n = max(1, min(len(self._items), self._batch_of(self._items)))
                batch = [self._items.popleft() for _ in range(n)]
            self._count(1)
            try:
                self._run(batch)
            except Exception:  # a bug must not kill the lane: the batch's jobs expire as timeout
                log.exception("kvtier remote tier: a batch failed unexpectedly")
            finally:
                self._count(-1)


class RemoteTier:
    """Chunks of one fixed shape and dtype in a shared Valkey/Redis store, keyed by the config's scope and
    ``identity``, sealed under the tenant's key (``config.mac_key_file``)."""

    # The Tier protocol (kvtier_runtime.tiers.base): a store shared by every replica of the model, whose keys carry
    # the model identity (the books hand raw offload keys); this tier logs its own faults (an evicted chunk is no
    # incident).
    medium = "remote"
    origin = "remote"
    scoped_keys = True
    logs_load_faults = True
    _log = log

    def __init__(
        self,
        config: RemoteTierConfig,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        identity: str,
        name: str | None = None,
        peer: str = "host",
        codec: Codec | KVChunkCodec | None = None,
        n_threads: int = 4,
        max_batch_bytes: int = 16 << 20,
        presence_ttl_s: float = 30.0,
        absent_ttl_s: float = 1.0,
        presence_entries: int = 1 << 16,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        on_complete: Callable[[JobResult], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        store: RemoteStore | None = None,
    ) -> None:
        self.config = config
        self.name = name or f"remote:{config.url}"
        self.peer = peer
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self._codec = codec or get_codec(config.codec, fallback=True)
        # RemoteTierConfig guarantees a key file of the tenant's own (never the store password's file).
        tenant_key = read_mac_key(config.mac_key_file)
        assert tenant_key is not None and config.scope is not None
        self.scope = config.scope
        self._sealer = Sealer(tenant_key, config.scope, identity)
        del tenant_key
        self._io_timeout_s = float(config.io_timeout_s)
        self._clock = clock
        self._prefix = key_prefix(config.scope, identity)
        self.identity = identity
        self._index = index_key(self._prefix)
        self._max_payload = self._codec.max_encoded_nbytes(self.block_shape, dtype)
        self._row_bytes = math.prod(self.block_shape) * dtype.itemsize
        # Codec none: every payload is this header, then the row's bytes as they are. A store seals the row in place
        # (no encoded copy) and a load copies a verified payload with that header into the row with one memmove.
        self._raw_header = _passthrough_header(self._codec, self.block_shape, dtype, self._row_bytes)
        # What one chunk costs the store at most: its value (header, ciphertext, tag) and its key.
        self.value_bytes = value_bytes(self._max_payload) + len(self._prefix) + 2 * NOMINAL_KEY_BYTES
        self.capacity_entries = config.capacity_bytes // self.value_bytes
        if self.capacity_entries < 1:
            raise ConfigError(f"capacity_bytes: {config.capacity_bytes} bytes hold no chunk of {self.value_bytes} "
                              "bytes (one stored value)")
        self._metrics = RemoteMetrics(self.name, config.capacity_bytes)
        # Jobs: ids, results handed out once, deadlines (a helper object: kvtier_runtime.tiers.jobs).
        self.jobs = JobQueue(name=self.name, medium=self.medium, io_timeout_s=config.io_timeout_s,
                             errors=self._metrics, on_io_failure=self._record_io_failure, on_complete=on_complete,
                             log=log)
        self._lock = self.jobs.lock
        self._store = store or RemoteStore(config)
        self._presence_ttl_s = presence_ttl_s
        self._absent_ttl_s = absent_ttl_s
        self._presence_entries = presence_entries
        # A store marked down is retried (one reconnect) after base_s, doubling per fault in a row up to max_s.
        self.backoff = Backoff(backoff_base_s, backoff_max_s, clock=clock)

        # Presence: key -> (present, expires at, why absent); keys whose probe is in flight -> when queued.
        self._plock = threading.Lock()
        self._presence: OrderedDict[bytes, tuple[bool, float, str]] = OrderedDict()
        self._probing: dict[bytes, float] = {}

        # Health: "connecting" (at start and while a reconnect runs), "up", "down" (until backoff.until).
        self._health = "connecting"
        self._timeouts = 0
        self._stores_paused_until = 0.0  # after "full": a full store is not sent more bytes for a while
        self._entries = 0
        self._local = threading.local()
        self._buffer_bytes = value_bytes(self._max_payload)

        self._read_pool, self._write_pool = self.jobs.start_pools(n_threads, n_threads)
        self._probe_pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{self.name}-p")
        per_batch = max(1, max_batch_bytes // self.value_bytes)
        self._loads = _Lane(self._read_pool, self._load_batch, n_threads, lambda q: per_batch, self.jobs.count_task)
        self._stores = _Lane(self._write_pool, self._store_batch, n_threads, lambda q: per_batch, self.jobs.count_task)
        self._probes = _Lane(self._probe_pool, self._probe_batch, 1, lambda q: 1024, self.jobs.count_task)
        self._probe_pool.submit(self._reconnect)
        self._metrics.occupancy(0)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], block_shape: Sequence[int], dtype: torch.dtype,
                    **options: Any) -> "RemoteTier":
        return cls(RemoteTierConfig.from_kwargs(kwargs), block_shape, dtype, **options)

    # ---- observation ------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def io_timeout_s(self) -> float:
        """How long a promotion may take before the books treat its key as missed: a load job's deadline (each
        socket operation is bounded by the config's io_timeout_s; the rest is the wait behind this tier's queue)."""
        return LOAD_DEADLINE_FACTOR * self._io_timeout_s

    @property
    def used_bytes(self) -> int:
        """kvtier's chunks of this model in the store (as last counted after a store), at the largest value size."""
        return self._entries * self.value_bytes

    @property
    def misses(self) -> Counter[str]:
        return self._metrics.misses

    @property
    def store_failures(self) -> Counter[str]:
        return self._metrics.store_failures

    @property
    def health(self) -> str:
        return self._health

    @property
    def cluster(self) -> bool:
        return self._store.cluster

    def store_key(self, key: bytes) -> bytes:
        return chunk_key(self._prefix, key)

    # ---- health -----------------------------------------------------------------------------------------
    def _available(self) -> bool:
        """Whether the store may be asked now; when a down store's backoff ran out, start one reconnect."""
        health = self._health
        if health == "up":
            return True
        if health == "down" and not self.backoff.active and not self.jobs.closed:
            with self._plock:
                if self._health != "down":
                    return False
                self._health = "connecting"
            try:
                self._probe_pool.submit(self._reconnect)
            except RuntimeError:
                pass
        return False

    def _reconnect(self) -> None:
        self._store.reset()
        try:
            self._store.connect()
            self._store.connect().ping()
        except ConfigError as exc:
            log.error("kvtier remote tier %s: %s; every lookup is a miss", self.name, exc)
            self._fault("auth", force=True)
            return
        except Exception as exc:
            kind = failure_kind(exc)
            if self.backoff.failures == 0:
                tls = self._store.describe_tls_failure(exc)
                if tls is not None:
                    log.warning("kvtier remote tier %s: %s; lookups miss, retrying", self.name, tls)
                else:
                    log.warning("kvtier remote tier %s: the store is unusable (%s: %s); lookups miss, retrying",
                                self.name, kind, exc)
            self._fault(kind, force=True)
            return
        self._ok()
        log.info("kvtier remote tier %s: connected (%s mode)", self.name,
                 "cluster" if self._store.cluster else "standalone")

    def _ok(self) -> None:
        if self._health != "up" or self.backoff.failures or self._timeouts:
            with self._plock:
                self._health = "up"
                self.backoff.success()
                self._timeouts = 0
            self._metrics.up(True)

    def _fault(self, kind: str, force: bool = False) -> None:
        """A store-level fault: ``down``/``auth`` (or forced) mark the store down at once; timeouts after
        TIMEOUTS_TO_DOWN in a row; ``full`` pauses stores only."""
        now = self._clock()
        if kind == "full":
            self._stores_paused_until = now + self.backoff.base_s
            return
        with self._plock:
            if kind == "timeout" and not force:
                self._timeouts += 1
                if self._timeouts < TIMEOUTS_TO_DOWN:
                    return
            if kind not in _DOWN_KINDS and kind != "timeout" and not force:
                return
            delay = self.backoff.failure(now)
            was_up = self._health == "up"
            self._health = "down"
        self._metrics.up(False)
        if was_up:
            log.warning("kvtier remote tier %s: store %s (%s); lookups miss for %.1f s, then one reconnect",
                        self.name, "down" if kind != "timeout" else "too slow", kind, delay)
        if kind != "timeout":
            self._store.reset()

    def _record_io_failure(self) -> None:
        """The job queue calls this when a job expires. Not a store fault by itself: the keys may have waited behind a
        burst in this process's own queue. A slow store shows as socket timeouts (io_timeout_s per operation),
        which the batches report to :meth:`_fault`."""

    def _new_job(self, kind: str, keys: Sequence[bytes]) -> Job:
        factor = STORE_DEADLINE_FACTOR if kind == "store" else LOAD_DEADLINE_FACTOR
        return self.jobs.new_job(kind, keys, timeout_s=factor * self._io_timeout_s)

    # ---- presence (scheduler thread: no I/O) ------------------------------------------------------------
    def _remember(self, key: bytes, present: bool, reason: str = "absent") -> None:
        ttl = self._presence_ttl_s if present else self._absent_ttl_s
        with self._plock:
            self._presence[key] = (present, self._clock() + ttl, reason)
            self._presence.move_to_end(key)
            while len(self._presence) > self._presence_entries:
                self._presence.popitem(last=False)

    def known_present(self, key: bytes) -> bool:
        with self._plock:
            entry = self._presence.get(key)
        return entry is not None and entry[0] and self._clock() < entry[1]

    def state(self, key: bytes, probe: bool = True) -> KeyState:
        """HIT if the store is known to hold ``key``, MISS if known not to (or the store is down), PENDING while a
        probe is in flight (``probe``: queue one for an unknown key). Never does I/O."""
        key = bytes(key)
        now = self._clock()
        with self._plock:
            entry = self._presence.get(key)
            if entry is not None:
                present, expires, reason = entry
                if now < expires:
                    if probe:
                        self._count_lookup(present, reason)
                    return KeyState.HIT if present else KeyState.MISS
                del self._presence[key]
            queued = self._probing.get(key)
            if queued is not None:
                if now - queued <= 2 * self._io_timeout_s + 0.5:
                    return KeyState.PENDING
                del self._probing[key]  # the probe thread is stuck behind a slow store
        if not probe:
            return KeyState.MISS
        if not self._available():
            self._count_lookup(False, "down")
            return KeyState.MISS
        with self._plock:
            self._probing[key] = now
        self._probes.put([key])
        return KeyState.PENDING

    # ---- what the books ask (kvtier_runtime.tiers.base.Tier) ---------------------------------------------
    def probe(self, key: bytes) -> KeyState:
        """:meth:`state`, queuing a presence probe for an unknown key (PENDING: ask again next step)."""
        return self.state(key)

    def needs_store(self, key: bytes) -> bool:
        """Unless the presence cache knows the store holds it (another replica may have written it)."""
        return not self.known_present(key)

    def covers(self, key: bytes) -> bool:
        """Never: presence here is a cache another replica's eviction (or the store's) may void at any time, so the
        host tier keeps its own copy."""
        return False

    def _count_lookup(self, hit: bool, reason: str) -> None:
        self._metrics.probed(hit)
        if not hit:
            self._metrics.miss(reason)

    def _probe_batch(self, keys: list[bytes]) -> None:
        present: list[Any]
        try:
            if self._health != "up":
                raise _Unavailable()
            pipe = self._store.pipeline()
            for key in keys:
                pipe.exists(self.store_key(key))
            present = pipe.execute(raise_on_error=False)
        except _Unavailable:
            present = [_Unavailable()] * len(keys)
        except Exception as exc:
            kind = failure_kind(exc)
            self._fault(kind)
            present = [exc] * len(keys)
        else:
            if not any(isinstance(r, Exception) for r in present):
                self._ok()
        for key, reply in zip(keys, present):
            if isinstance(reply, _Unavailable):
                self._remember(key, False, "down")
            elif isinstance(reply, Exception):
                self._remember(key, False, failure_kind(reply))
            else:
                self._remember(key, bool(reply))
            with self._plock:
                self._probing.pop(key, None)

    # ---- jobs (non-blocking) ----------------------------------------------------------------------------
    def submit_store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                     ctx: AccessContext | None = None) -> int:
        """Queue writes of ``blocks`` (host rows, unchanged until the job finishes) under ``keys``. Refused at
        once (failed keys, no exception) while the store is down or, after a ``full`` reply, for a backoff."""
        self.jobs.check_open()
        if len(keys) != len(blocks):
            raise ValueError(f"blocks: {len(blocks)} blocks for {len(keys)} keys")
        keys = [bytes(k) for k in keys]
        job = self._new_job("store", keys)
        refuse = ""
        if not self._available():
            refuse = "down"
        elif self._clock() < self._stores_paused_until:
            refuse = "full"
        work = []
        for i, (key, block) in enumerate(zip(keys, blocks)):
            if not refuse and (tuple(block.shape) != self.block_shape or block.dtype != self.dtype):
                self._fail_key(job, i, "mismatch", store=True)
            elif refuse:
                self._fail_key(job, i, refuse, store=True)
            else:
                work.append((job, i, key, block))
        if work:
            self._stores.put(work)
        self.jobs.settle(job, None, True)
        return job.job_id

    def submit_load(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor],
                    ctx: AccessContext | None = None) -> int:
        """Queue reads of ``keys`` into ``outs`` (contiguous CPU tensors of the tier's shape and dtype)."""
        self.jobs.check_open()
        if len(keys) != len(outs):
            raise ValueError(f"outs: {len(outs)} tensors for {len(keys)} keys")
        keys = [bytes(k) for k in keys]
        job = self._new_job("load", keys)
        up = self._available()
        work = []
        for i, (key, out) in enumerate(zip(keys, outs)):
            if (tuple(out.shape) != self.block_shape or out.dtype != self.dtype or out.device.type != "cpu"
                    or not out.is_contiguous()):
                self._fail_key(job, i, "mismatch")
            elif not up:
                self._fail_key(job, i, "down")
            else:
                work.append((job, i, key, out))
        if work:
            self._loads.put(work)
        self.jobs.settle(job, None, True)
        return job.job_id

    def _fail_key(self, job: Job, i: int, reason: str, store: bool = False) -> None:
        with self._lock:
            job.errors[i] = reason
            result = self.jobs.settle_locked(job, i, False)
        if store:
            self._metrics.store_failed(reason)
        else:
            self._metrics.miss(reason)
        self.jobs.completed(result)

    def _succeed_key(self, job: Job, i: int) -> None:
        self.jobs.settle(job, i, True)

    # ---- batches (pool threads) -------------------------------------------------------------------------
    def _plain(self) -> bytearray:
        """This thread's plaintext buffer: the codec encodes into it before sealing, a value decrypts into it before
        decoding (never into the caller's row: a refused value's bytes must never reach it)."""
        plain: bytearray | None = getattr(self._local, "plain", None)
        if plain is None:
            plain = self._local.plain = bytearray(self._max_payload)
            # Its address, for the memmove of a verified payload into a row (the export pins the buffer in place).
            self._local.plain_at = ctypes.addressof((ctypes.c_char * len(plain)).from_buffer(plain))
        return plain

    def _buffers(self, n: int) -> list[bytearray]:
        """This thread's value buffers (a pipeline holds views of each until it is sent), at least ``n``."""
        bufs: list[bytearray] = getattr(self._local, "bufs", None) or []
        while len(bufs) < n:
            bufs.append(bytearray(self._buffer_bytes))
        self._local.bufs = bufs
        return bufs

    def _store_batch(self, batch: list[tuple[Job, int, bytes, torch.Tensor]]) -> None:
        """One pipeline: a SET per chunk, then the model's index (ZADD, ZCARD); trimmed to the capacity (ZPOPMIN,
        DEL) before the keys settle, so a finished store is already accounted."""
        started = time.perf_counter()
        live = [item for item in batch if not item[0].done.is_set()]
        if not live:
            return
        if self._health != "up" or self._clock() < self._stores_paused_until:
            reason = "full" if self._health == "up" else "down"
            for job, i, _, _ in live:
                self._fail_key(job, i, reason, store=True)
            return
        bufs = self._buffers(len(live))
        plain = self._plain()
        out: torch.Tensor | None = None
        sent: list[tuple[Job, int, bytes, memoryview]] = []
        for j, (job, i, key, block) in enumerate(live):
            buf = bufs[j]
            try:
                if self._raw_header is not None and block.device.type == "cpu" and block.is_contiguous():
                    with job.io_lock:  # the only read of the caller's row: sealed from the row itself
                        if job.expired:
                            raise Expired()
                        total = self._sealer.seal_parts(buf, self.store_key(key), self._codec.name,
                                                        (self._raw_header, _row_bytes_of(block, self._row_bytes)))
                    STATS.record_encode(self._codec.name, self._row_bytes, len(self._raw_header) + self._row_bytes)
                    sent.append((job, i, key, memoryview(buf)[:total]))
                    continue
                if out is None:
                    out = torch.frombuffer(plain, dtype=torch.uint8)
                with job.io_lock:  # the only read of the caller's row
                    if job.expired:
                        raise Expired()
                    n = self._codec.encode(block if block.is_contiguous() else block.contiguous(), out)
                # Encrypted from the plaintext buffer straight into this value's buffer (the pipeline sends a view).
                total = self._sealer.seal(buf, self.store_key(key), self._codec.name, memoryview(plain)[:n])
            except Expired:
                continue
            except Exception as exc:  # a codec fault must not reach the engine
                log.warning("kvtier remote tier %s: encoding a chunk failed: %s", self.name, exc)
                self._fail_key(job, i, "other", store=True)
                continue
            sent.append((job, i, key, memoryview(buf)[:total]))
        if not sent:
            return
        now = time.time()
        try:
            pipe = self._store.pipeline()
            for _, _, key, value in sent:
                pipe.set(self.store_key(key), value)
            pipe.zadd(self._index, {key.hex().encode(): now for _, _, key, _ in sent})
            pipe.zcard(self._index)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            kind = failure_kind(exc)
            self._fault(kind)
            for job, i, _, _ in sent:
                self._fail_key(job, i, kind, store=True)
            return
        entries = replies[-1]
        if isinstance(entries, int):
            self._trim(entries)
        stored_bytes = 0
        fault = ""
        for (job, i, key, value), reply in zip(sent, replies):
            if isinstance(reply, Exception):
                kind = failure_kind(reply)
                fault = fault or kind
                self._fail_key(job, i, kind, store=True)
            else:
                stored_bytes += len(value)
                self._remember(key, True)
                self._succeed_key(job, i)
        self._batch_done(fault, self.peer, self.name, stored_bytes, started, len(sent))

    def _trim(self, entries: int) -> None:
        """Pop the model's oldest chunks past the capacity and delete them (best effort: the store's maxmemory
        stays the hard bound whatever happens here)."""
        try:
            over = entries - self.capacity_entries
            if over > 0:
                popped = self._store.connect().zpopmin(self._index, over)
                if popped:
                    # Only members kvtier writes (a chunk key's hex) name a key to delete: whatever else the index
                    # holds never makes the trim delete a key outside this scope's chunks (the index itself).
                    mine = [bytes(member) for member, _ in popped
                            if member and len(member) % 2 == 0 and _HEX.issuperset(member)]
                    pipe = self._store.pipeline()
                    for member in mine:
                        pipe.delete(self._prefix + member)
                    pipe.execute(raise_on_error=False)
                    for member in mine:
                        self._remember(bytes.fromhex(member.decode()), False, "evicted")
                    self._metrics.evicted(len(popped))
                entries -= len(popped)
        except Exception as exc:
            log.debug("kvtier remote tier %s: trimming the index failed (%s)", self.name, exc)
        self._entries = max(0, entries)
        self._metrics.occupancy(self.used_bytes)

    def _load_batch(self, batch: list[tuple[Job, int, bytes, torch.Tensor]]) -> None:
        started = time.perf_counter()
        live = [item for item in batch if not item[0].done.is_set()]
        if not live:
            return
        if self._health != "up":
            for job, i, key, _ in live:
                self._fail_key(job, i, "down")
            return
        fault = ""
        nbytes = 0
        done = 0  # how many of live have their reply handled

        def settle(value: Any) -> None:
            """One key's reply: its value verified and copied into its row, or the key failed with the reason."""
            nonlocal fault, nbytes, done
            job, i, key, out = live[done]
            done += 1
            kind = ""
            if isinstance(value, Exception):
                kind = failure_kind(value)
                fault = fault or kind
            elif value is None:
                kind = "evicted"  # the probe saw it; the store or another replica dropped it since
            else:
                try:
                    _, payload = self._sealer.open(value, self.store_key(key), self._plain())
                    with job.io_lock:  # the only write of the caller's row
                        if job.expired:
                            raise Expired()
                        raw = self._raw_header
                        if raw is not None and len(payload) == len(raw) + self._row_bytes and payload[:len(raw)] == raw:
                            # What decode() would do for these header bytes (codec none, this shape and dtype: a
                            # copy), without its torch ops; the payload is verified and sits at the buffer's start.
                            ctypes.memmove(out.data_ptr(), self._local.plain_at + len(raw), self._row_bytes)
                        else:
                            decode(payload, out=out)
                except Expired:
                    return
                except RemoteFormatError as exc:
                    kind = exc.kind
                except CodecError:
                    kind = "corrupt"
                except Exception:
                    kind = "other"
            if kind:
                self._remember(key, False, kind)
                self._fail_key(job, i, kind)
                n = self._metrics.misses[kind]
                if kind in _REFUSED_KINDS and n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood stays quiet
                    log.warning("kvtier remote tier %s: refused a value (%s, %d so far); vLLM recomputes the chunk",
                                self.name, kind, n)
            else:
                nbytes += out.numel() * out.element_size()
                self._remember(key, True)
                self._succeed_key(job, i)

        try:
            # A read is a use: the chunk moves to the young end of the model's index (XX: only if listed).
            now = time.time()
            touched = {key.hex().encode(): now for _, _, key, _ in live}
            if self._store.cluster:
                pipe = self._store.pipeline()
                for _, _, key, _ in live:
                    pipe.get(self.store_key(key))
                pipe.zadd(self._index, touched, xx=True)
                for value in pipe.execute(raise_on_error=False)[:len(live)]:
                    settle(value)
            else:
                # One round trip as well, each value read off the socket straight into this thread's value buffer
                # (redis-py's reply parser copies it twice more) and settled as it arrives: the cipher checks one
                # while the kernel receives the next.
                zadd: list[Any] = ["ZADD", self._index, "XX"]
                for member, score in touched.items():
                    zadd += [repr(score), member]
                self._store.read_values([self.store_key(key) for _, _, key, _ in live], self._buffers(1)[0], settle,
                                        [tuple(zadd)])
        except Exception as exc:
            kind = failure_kind(exc)
            self._fault(kind)
            for job, i, key, _ in live[done:]:  # no reply handled: the connection failed first
                self._remember(key, False, kind)
                self._fail_key(job, i, kind)
            return
        self._batch_done(fault, self.name, self.peer, nbytes, started, len(live))

    def _batch_done(self, fault: str, src: str, dst: str, nbytes: int, started: float, n: int) -> None:
        """After a batch's keys settled: the store's health (its first fault, else up) and the bytes moved."""
        if fault:
            self._fault(fault)
        else:
            self._ok()
        if nbytes:
            self._metrics.moved(src, dst, nbytes, time.perf_counter() - started, n)

    # ---- jobs (kvtier_runtime.tiers.jobs.JobQueue) ------------------------------------------------------
    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each once); a job past its deadline finishes here with
        its unfinished keys failed as ``timeout``."""
        return self.jobs.get_finished()

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (see :meth:`JobQueue.drain`)."""
        self.jobs.drain(timeout)

    def close(self) -> None:
        if self.jobs.closed:
            return
        self.jobs.close()
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        self._store.close()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _passthrough_header(codec: Codec | KVChunkCodec, shape: tuple[int, ...], dtype: torch.dtype,
                        nbytes: int) -> bytes | None:
    """The codec header codec ``none`` writes in front of every row of this shape and dtype (it holds no checksum of
    the payload, so it is the same for every row); None for any other codec, which must run to encode."""
    if type(codec) is not PassthroughCodec or codec.fallback_codec is not None or codec.per_channel:
        return None
    return CodecHeader(codec=codec.name, codec_version=codec.version, dtype=dtype, shape=shape, group_size=0,
                       payload_nbytes=nbytes, requested_codec=codec.name, flags=0).pack()


def _row_bytes_of(row: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of a contiguous CPU row, in place (a view the cipher reads; valid while ``row`` lives)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(row.data_ptr())).cast("B")


class _Unavailable(Exception):
    """The store was down when a queued probe ran."""
