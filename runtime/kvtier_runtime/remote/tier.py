"""kvtier's remote tier: chunks in a Valkey/Redis store shared by every replica of one model. The public class,
assembled from one module per concern.

The books (:class:`kvtier_runtime.store.books.OffloadBooks`) drive it like a filesystem tier -- ``state`` on
lookups, ``submit_store`` (write-through from the host tier), ``submit_load`` (promotion into a host row),
``get_finished`` each scheduler step -- and nothing here waits for the network on the caller's thread:

* ``state`` answers from a bounded local presence cache (:mod:`.presence`). A key it knows nothing about is queued
  for a probe (``EXISTS``, every queued key in one pipeline, on a probe thread) and answers ``PENDING``; the books
  answer vLLM ``retry``, vLLM keeps scanning the request's keys (each queued too) and asks again next step. A store
  that is down or still connecting answers ``MISS`` at once: no lookup ever waits for a connection attempt.
* Loads and stores go to worker threads that batch queued keys into one pipeline (``GET`` / ``SET``) per round
  trip (:mod:`.batches`, on :mod:`.lane`; values sealed and opened by :mod:`.values`). Every job has a deadline
  (the job machinery both tiers share: :mod:`kvtier_runtime.tiers.jobs`); a late key fails as ``timeout`` and a
  late reply never touches a host row the books may have reused.
* Every fault is a failed key with a reason, never an exception into the engine: ``down`` (refused, reset,
  cluster slot not served), ``timeout``, ``full`` (a write refused by the store's maxmemory under ``noeviction``),
  ``auth``, and for values ``evicted`` (gone since the probe), ``forged`` (names a tenant key this tier holds but
  does not verify: altered, or moved from another store key), ``key`` (sealed under a tenant key this tier does not
  hold: the other side of a key rotation, a removed key, another tenant's value), ``corrupt``/``truncated``/``foreign``, ``version`` (an
  older format, e.g. an unencrypted value), ``mismatch`` (a row of another shape).
  ``down``/``auth``, or three ``timeout``s in a row, mark the store down for a backoff (1 s doubling to 30 s):
  lookups miss at once, stores are refused, and one background reconnect decides when it is back (:mod:`.health`).

Tenancy: every key starts with the tier's scope (``kvtier:<scope>:<identity>:...``, :mod:`.identity`) and every
value is sealed with AES-256-GCM under a key derived from the tenant's key file, the scope and the model identity
(:mod:`.format`); replicas of one model in one scope share, other scopes neither read, forge nor evict them (a store
ACL per tenant keeps them from deleting or overwriting too: docs/remote.md).

Capacity: a sorted set per scope and model of the chunks kvtier wrote, trimmed after each store batch
(:mod:`.index`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..codecs import Codec, KVChunkCodec, get_codec
from ..config import RemoteTierConfig
from ..policies import AccessContext
from ..tiers.backoff import Backoff
from ..tiers.base import EventPlace, KeyState, ReplayPolicy, TierChanges
from ..tiers.jobs import Job, JobQueue, JobResult
from ..tiers.queued import QueuedTier
from .batches import Batches, KeyOutcomes, RowWork
from .changes import MAX_PENDING_KEYS, Changes, SharedLog
from .client import RemoteStore, store_credentials
from .health import StoreHealth
from .identity import chunk_key, key_prefix
from .index import CapacityIndex, chunk_cost
from .keyring import Keyring
from .lane import Lane
from .presence import PresenceCache
from .tier_metrics import RemoteMetrics
from .values import ChunkValues

__all__ = ["RemoteTier", "JobResult", "KeyState"]

# Job deadlines, in io_timeout_s. Every socket operation is bounded by io_timeout_s (a slow store fails there and is
# marked down); a job's deadline is the backstop, and also covers the wait behind this process's own queue: a
# long prefix is promoted as many loads at once, a prefill as many write-throughs. A request waits on loads (4x);
# only pinned host rows wait on a write-through (8x).
LOAD_DEADLINE_FACTOR = 4
STORE_DEADLINE_FACTOR = 8
# Presence probes queued are sent in pipelines of at most this many keys.
PROBES_PER_BATCH = 1024


class RemoteTier(QueuedTier):
    """Chunks of one fixed shape and dtype in a shared Valkey/Redis store, keyed by the config's scope and
    ``identity``, sealed under the tenant's key (``config.mac_key_file``)."""

    # The Tier protocol (kvtier_runtime.tiers.base): a store shared by every replica of the model, whose keys carry
    # the model identity (the books hand raw offload keys); this tier logs its own faults (an evicted chunk is no
    # incident).
    medium = "remote"
    origin = "remote"
    scoped_keys = True
    logs_load_faults = True

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
        self.identity = identity
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        # RemoteTierConfig guarantees a scope and a key file of the tenant's own (never the store password's file);
        # the keyring checks the bytes too (never the store's password or username) and follows a rotation.
        assert config.mac_key_file is not None and config.scope is not None
        self.scope = config.scope
        self._prefix = key_prefix(config.scope, identity)
        self._metrics = RemoteMetrics(self.name, config.capacity_bytes)
        self.keys = Keyring(config.mac_key_file, config.previous_mac_key_file, config.scope, identity,
                            credentials=store_credentials(config), on_previous_read=self._metrics.previous_key_read,
                            on_reload=self._metrics.key_reload)
        self.values = ChunkValues(codec=codec or get_codec(config.codec, fallback=True), sealer=self.keys,
                                  block_shape=self.block_shape, dtype=dtype)
        self._io_timeout_s = float(config.io_timeout_s)
        self._clock = clock
        # What one chunk costs the store at most: its value (header, ciphertext, tag) and its key.
        self.value_bytes = chunk_cost(self.values.max_payload, self._prefix)
        self._store = store or RemoteStore(config)
        self.index = CapacityIndex(name=self.name, store=self._store, prefix=self._prefix,
                                   capacity_bytes=config.capacity_bytes, cost=self.value_bytes, metrics=self._metrics)
        # Jobs: ids, results handed out once, deadlines (a helper object: kvtier_runtime.tiers.jobs).
        self.jobs = JobQueue(name=self.name, medium=self.medium, io_timeout_s=config.io_timeout_s,
                             errors=self._metrics, on_io_failure=self._job_expired, on_complete=on_complete,
                             log=logging.getLogger("kvtier_runtime.remote"))
        self._outcomes = KeyOutcomes(self.jobs, self._metrics)
        # What entered and left the tier, for KV events; the shared log every replica of the scope writes and reads
        # once this engine publishes them (record_changes).
        self.changes = Changes()
        self.shared_log = SharedLog(name=self.name, store=self._store, prefix=self._prefix, index_key=self.index.key,
                                    max_index=min(MAX_PENDING_KEYS, 2 * self.index.capacity_entries),
                                    changes=self.changes, available=lambda: self.store_health.up)
        self.presence = PresenceCache(present_ttl_s=presence_ttl_s, absent_ttl_s=absent_ttl_s,
                                      entries=presence_entries, probe_patience_s=2 * self._io_timeout_s + 0.5,
                                      clock=clock)
        self._start(n_threads, max_batch_bytes, Backoff(backoff_base_s, backoff_max_s, clock=clock))

    def _start(self, n_threads: int, max_batch_bytes: int, backoff: Backoff) -> None:
        """The store's health, the worker threads and their lanes; then the first connection, on the probe
        thread."""
        read_pool, write_pool = self.jobs.start_pools(n_threads, n_threads)
        probe_pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{self.name}-p")
        # A store marked down is retried (one reconnect) after base_s, doubling per fault in a row up to max_s.
        self.store_health = StoreHealth(name=self.name, store=self._store, metrics=self._metrics, backoff=backoff,
                                  clock=self._clock, spawn=probe_pool.submit, closed=lambda: self.jobs.closed)
        batches = Batches(name=self.name, peer=self.peer, store=self._store, store_key=self.store_key,
                          values=self.values, index=self.index, health=self.store_health, presence=self.presence,
                          outcomes=self._outcomes, metrics=self._metrics, changes=self.changes,
                          shared_log=self.shared_log)
        per_batch = max(1, max_batch_bytes // self.value_bytes)
        count = self.jobs.count_task
        self._loads: Lane[RowWork] = Lane(read_pool, batches.load, n_threads, per_batch, count)
        self._stores: Lane[RowWork] = Lane(write_pool, batches.store, n_threads, per_batch, count)
        self._probes: Lane[bytes] = Lane(probe_pool, batches.probe, 1, PROBES_PER_BATCH, count)
        # Closing: the job queue stops the I/O pools, then the probe thread and the store's connections.
        self.jobs.at_close(lambda: probe_pool.shutdown(wait=False, cancel_futures=True))
        self.jobs.at_close(self.shared_log.stop)
        self.jobs.at_close(self._store.close)
        self.store_health.connect()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], block_shape: Sequence[int], dtype: torch.dtype,
                    **options: Any) -> RemoteTier:
        return cls(RemoteTierConfig.from_kwargs(kwargs), block_shape, dtype, **options)

    # ---- observation ------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def capacity_entries(self) -> int:
        """Chunks of the largest value size the capacity holds."""
        return self.index.capacity_entries

    # The Tier protocol's observation members (what the engine exports and replay models, asked of the tier).
    @property
    def address(self) -> str:
        return self.config.url

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_entries

    @property
    def evictions(self) -> int:
        return self._metrics.evictions

    @property
    def replay_policy(self) -> ReplayPolicy:
        # kvtier trims the model's chunks in the store least recently written or read first; the store is shared by
        # every replica of the model (replay --replicas N --shared models that).
        return ReplayPolicy("lru", "none", shared=True)

    @property
    def event_place(self) -> EventPlace:
        # A store every replica of the model in this scope reads: vLLM's STORAGE medium, remote to this replica.
        return EventPlace("STORAGE", "REMOTE", f"kvtier-remote:{self.scope}")

    def record_changes(self) -> None:
        """Remember what enters and leaves the tier from now on: its own trims and the chunks its loads find gone,
        and every replica's writes and removals through the scope's shared log (:mod:`.changes`)."""
        self.changes.record()
        self.shared_log.start()

    def take_changes(self) -> TierChanges:
        return self.changes.take()

    def gauges(self) -> dict[str, float]:
        # up: the store answers, also when it refuses this tier's user (auth is the tier's fault, counted in its
        # misses, not the store's). remote_*_bytes: the series by url the engine exported before tiers were named
        # (the same figures as tier_used_bytes/tier_capacity_bytes), kept one release for dashboards to move.
        return {"up": 1.0 if self.health in ("up", "refused") else 0.0,
                "remote_used_bytes": float(self.used_bytes), "remote_capacity_bytes": float(self.capacity_bytes)}

    def reasons(self) -> dict[str, dict[str, int]]:
        return {"misses": dict(self.misses), "store_failures": dict(self.store_failures)}

    @property
    def io_timeout_s(self) -> float:
        """How long a promotion may take before the books treat its key as missed: a load job's deadline (each
        socket operation is bounded by the config's io_timeout_s; the rest is the wait behind this tier's queue)."""
        return LOAD_DEADLINE_FACTOR * self._io_timeout_s

    @property
    def used_bytes(self) -> int:
        """kvtier's chunks of this model in the store (as last counted after a store), at the largest value size."""
        return self.index.used_bytes

    @property
    def misses(self) -> Counter[str]:
        return self._metrics.misses

    @property
    def store_failures(self) -> Counter[str]:
        return self._metrics.store_failures

    @property
    def health(self) -> str:
        """The store's: "connecting", "up", "down" or "refused" (it refuses this tier's user:
        :class:`.health.StoreHealth`)."""
        return self.store_health.state

    @property
    def backoff(self) -> Backoff:
        return self.store_health.backoff

    @property
    def cluster(self) -> bool:
        return self._store.cluster

    def store_key(self, key: bytes) -> bytes:
        return chunk_key(self._prefix, key)

    def _job_expired(self) -> None:
        """The job queue calls this when a job expires. Not a store fault by itself: the keys may have waited behind
        a burst in this process's own queue. A slow store shows as socket timeouts (io_timeout_s per operation),
        which the batches report to the store's health."""

    # ---- what the books ask (kvtier_runtime.tiers.base.Tier; the scheduler thread: no I/O) --------------------
    def known_present(self, key: bytes) -> bool:
        return self.presence.known_present(key)

    def state(self, key: bytes, probe: bool = True) -> KeyState:
        """HIT if the store is known to hold ``key``, MISS if known not to (or the store is down), PENDING while a
        probe is in flight (``probe``: queue one for an unknown key). Never does I/O."""
        key = bytes(key)
        known = self.presence.lookup(key)
        if known is not None:
            state, reason = known
            if probe and state is not KeyState.PENDING:
                self._count_lookup(state is KeyState.HIT, reason)
            return state
        if not probe:
            return KeyState.MISS
        if not self.store_health.available():
            self._count_lookup(False, self.store_health.miss_reason)
            return KeyState.MISS
        self.presence.probing(key)
        self._probes.put([key])
        return KeyState.PENDING

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
        refuse = self.store_health.store_refusal(self.store_health.available())
        work: list[RowWork] = []
        for i, (key, block) in enumerate(zip(keys, blocks)):
            if refuse:
                self._outcomes.fail(job, i, refuse, store=True)
            elif tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
                self._outcomes.fail(job, i, "mismatch", store=True)
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
        up = self.store_health.available()
        work: list[RowWork] = []
        for i, (key, out) in enumerate(zip(keys, outs)):
            if (tuple(out.shape) != self.block_shape or out.dtype != self.dtype or out.device.type != "cpu"
                    or not out.is_contiguous()):
                self._outcomes.fail(job, i, "mismatch")
            elif not up:
                self._outcomes.fail(job, i, self.store_health.miss_reason)
            else:
                work.append((job, i, key, out))
        if work:
            self._loads.put(work)
        self.jobs.settle(job, None, True)
        return job.job_id

    def _new_job(self, kind: str, keys: Sequence[bytes]) -> Job:
        factor = STORE_DEADLINE_FACTOR if kind == "store" else LOAD_DEADLINE_FACTOR
        return self.jobs.new_job(kind, keys, timeout_s=factor * self._io_timeout_s)
