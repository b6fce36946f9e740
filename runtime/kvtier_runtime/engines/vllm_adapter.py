"""kvtier's policies and filesystem tier as vLLM 0.33 offloading plug-ins -- the one module that imports vllm.

vLLM loads both by module path (see ``kvtier_runtime.config``):

* ``kv_connector_extra_config: {eviction_policy: KvtierS3FIFOCachePolicy, cache_policy_module_path: <this>}``
  -> ``CachePolicyFactory`` -> one of the ``Kvtier<Eviction><Admission>CachePolicy`` classes below, the CPU
  tier's replacement policy;
* ``secondary_tiers: [{type: KvtierFilesystemTier, module_path: <this>, root_dir: ..., capacity_bytes: ...}]``
  -> ``SecondaryTierFactory`` -> :class:`KvtierFilesystemTier`, a bounded, checksummed, optionally compressed
  disk tier behind vLLM's CPU tier.

Everything engine-agnostic (policies, file format, codecs, thread pools) lives elsewhere in the runtime; this
module only translates vLLM's calling conventions. Pure helpers are in ``vllm_support`` so they can be tested
without vLLM.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ..config import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_THRESHOLD,
    EVICTION_POLICIES,
    CachePolicyChoice,
    FilesystemTierConfig,
    vllm_cache_policy_class,
)
from ..fs.tier import FilesystemTier
from ..fs.tier import JobResult as TierJobResult
from ..policies import AccessContext, EvictionPolicy, get_policy
from .vllm_support import POLICY_REFUSALS, block_view_dtype, job_outcome, namespace_suffix

# ---------------------------------------------------------------------------------------------------------------
# CachePolicy: kvtier's eviction and admission policies for vLLM's CPU tier
# ---------------------------------------------------------------------------------------------------------------


def _access_context(key: OffloadKey, req_context: ReqContext | None) -> AccessContext | None:
    """vLLM's request context as the runtime's: the key's end-token position orders a request's chunks."""
    if req_context is None:
        return None
    position = req_context.get_offload_key_position(key)
    return AccessContext(request_id=req_context.req_id, position=position or 0)


class KvtierCachePolicy(CachePolicy):
    """A runtime :class:`EvictionPolicy` behind vLLM's ``CachePolicy`` contract.

    vLLM's CPU manager owns the chunk slots; the policy only orders entries and picks victims. Mapping:

    * one chunk = one unit of the policy's byte accounting (capacity = ``cache_capacity`` chunks), so the
      manager's free-slot arithmetic and the policy's agree exactly;
    * ``ChunkStatus.ref_cnt`` -1 (store in flight) or > 0 (transfers reading it) = pinned in the policy;
      ``mark_evictable``/``mark_non_evictable`` (vLLM calls them on 0 transitions) unpin/pin;
    * ``evict(n, protected)`` = the policy's atomic ``evict`` (``None`` and no change when impossible);
    * a reuse is the first access of a ready chunk in a request (``on_request_access``), or ``touch``.

    Admission: vLLM's ``insert`` cannot refuse a store (the slot is already allocated and the GPU->CPU copy
    queued). So a chunk the admission filter declines is kept in a *probation* FIFO that is always evicted
    before any admitted chunk; it joins the policy if it is reused while still resident. A one-off chunk thus
    never displaces a chunk the filter admitted.
    """

    eviction: ClassVar[str] = "lru"
    admission: ClassVar[str] = "none"
    admission_threshold: ClassVar[int] = DEFAULT_ADMISSION_THRESHOLD
    # Only these policies read the request context (request id, position); for the others building one per
    # access is pure overhead on vLLM's scheduler thread.
    CONTEXT_AWARE: ClassVar[frozenset[str]] = frozenset({"prefix2q"})

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: EvictionPolicy = get_policy(
            self.eviction, max(1, int(cache_capacity)), admission=None if self.admission == "none" else self.admission,
            admission_threshold=self.admission_threshold,
        )
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        self._uses_context = self.eviction in self.CONTEXT_AWARE

    # ---- lookups ------------------------------------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def probation_size(self) -> int:
        return len(self._probation)

    # ---- insert / remove ----------------------------------------------------------------------------------
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        if key in self._chunks:  # not done by vLLM 0.33; keep the entry's place, adopt the new status
            self._chunks[key] = chunk
            self._sync_pin(key)
            return
        ctx = _access_context(key, req_context) if self._uses_context else None
        self._chunks[key] = chunk
        policy = self.policy
        if policy.admission is None or policy.admit(key, 1, ctx):
            self._enter_policy(key, ctx)
            if chunk.ref_cnt != 0:  # -1: vLLM inserts before the GPU->CPU copy is done
                policy.pin(key)
        else:
            self._probation[key] = None

    def remove(self, key: OffloadKey) -> None:
        del self._chunks[key]
        if key in self._probation:
            del self._probation[key]
            return
        if self.policy.is_pinned(key):
            self.policy.unpin(key)
        self.policy.remove(key)

    def _enter_policy(self, key: OffloadKey, ctx: AccessContext | None) -> None:
        evicted = self.policy.insert(key, 1, ctx)
        if evicted:  # the manager evicts before it inserts; the policy must never need to make room itself
            raise AssertionError(f"policy evicted {len(evicted)} chunks on insert; vLLM's slot accounting broke")
        if evicted is None:
            raise AssertionError("policy refused an insert although vLLM allocated a slot for it")

    def _sync_pin(self, key: OffloadKey) -> None:
        if key not in self.policy:
            return
        evictable = self._chunks[key].ref_cnt == 0
        pinned = self.policy.is_pinned(key)
        if evictable and pinned:
            self.policy.unpin(key)
        elif not evictable and not pinned:
            self.policy.pin(key)

    # ---- accesses -----------------------------------------------------------------------------------------
    def _reuse(self, key: OffloadKey, req_context: ReqContext | None) -> None:
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.is_ready:
            return  # a chunk whose store is still in flight was not reused
        ctx = _access_context(key, req_context) if self._uses_context else None
        if key in self._probation:
            del self._probation[key]  # reused while on probation: the filter's second chance
            self._enter_policy(key, ctx)
            self._sync_pin(key)
        else:
            self.policy.touch(key, ctx)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            self._reuse(key, req_context)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        return  # the keys are not resident yet; insert() sees them (and asks the admission filter)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM passes each key once per request, in the order the request observed it (head to tail).
        for key in keys:
            self._reuse(key, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        return  # every reuse was recorded when first observed (on_request_access); counting again would double it

    # ---- eviction -----------------------------------------------------------------------------------------
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        chunks = self._chunks
        from_probation: list[OffloadKey] = []
        for key in self._probation:
            if len(from_probation) == n:
                break
            if chunks[key].ref_cnt == 0 and key not in protected:
                from_probation.append(key)
        rest = n - len(from_probation)
        victims: list[OffloadKey] = []
        if rest:
            found = self.policy.evict(rest, protected)
            if found is None:
                return None  # atomic: the probation FIFO was only read
            victims = found
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in from_probation:
            del self._probation[key]
            out.append((key, chunks.pop(key)))
        for key in victims:
            chunk = chunks.pop(key)
            assert chunk.ref_cnt == 0, f"evicted chunk {key!r} has ref_cnt {chunk.ref_cnt}"
            out.append((key, chunk))
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        policy = self.policy
        if policy.is_pinned(key):  # False for probation chunks: their ref_cnt is read directly
            policy.unpin(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key in self.policy and not self.policy.is_pinned(key):
            self.policy.pin(key)

    def clear(self) -> None:
        self._chunks.clear()
        self._probation.clear()
        self.policy.clear()


def _make_policy_classes() -> dict[str, type[KvtierCachePolicy]]:
    classes: dict[str, type[KvtierCachePolicy]] = {}
    for eviction in EVICTION_POLICIES:
        for admission in ADMISSION_POLICIES:
            name = vllm_cache_policy_class(eviction, admission)
            classes[name] = type(
                name,
                (KvtierCachePolicy,),
                {
                    "eviction": eviction,
                    "admission": admission,
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"kvtier's {eviction} eviction with {admission} admission as a vLLM CachePolicy.",
                },
            )
    return classes


CACHE_POLICY_CLASSES: dict[str, type[KvtierCachePolicy]] = _make_policy_classes()
# CachePolicyFactory resolves ``getattr(import_module(cache_policy_module_path), eviction_policy)``.
globals().update(CACHE_POLICY_CLASSES)


def __getattr__(name: str) -> type[KvtierCachePolicy]:
    """Classes whose name carries a threshold (``KvtierLRUThreshold5CachePolicy``), made on first use."""
    try:
        choice = CachePolicyChoice.from_class_name(name)
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    cls = type(name, (KvtierCachePolicy,), {
        "eviction": choice.eviction, "admission": choice.admission,
        "admission_threshold": choice.admission_threshold, "__module__": __name__, "__qualname__": name,
        "__doc__": f"kvtier's {choice.eviction} eviction, storing on offer {choice.admission_threshold}."})
    globals()[name] = cls
    return cls


# ---------------------------------------------------------------------------------------------------------------
# SecondaryTierManager: kvtier's bounded filesystem tier behind vLLM's CPU tier
# ---------------------------------------------------------------------------------------------------------------


def run_identity(offloading_spec: Any, root_dir: str) -> dict[str, Any]:
    """What makes blocks of two engines interchangeable: the fields vLLM's own ``fs`` tier separates runs by
    (model, KV dtype, tokens per hash, blocks per chunk, KV cache groups, parallelism unless agnostic)."""
    mapper = FileMapper.from_offloading_spec(
        root_dir=root_dir,
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    return mapper.get_run_config()

_PREFIX = "vllm:kv_offload_kvtier_fs_"
METRIC_USED_BYTES = _PREFIX + "used_bytes"
METRIC_CAPACITY_BYTES = _PREFIX + "capacity_bytes"
METRIC_STORED_CHUNKS = _PREFIX + "stored_chunks"
METRIC_LOADED_CHUNKS = _PREFIX + "loaded_chunks"
METRIC_REFUSED_CHUNKS = _PREFIX + "refused_chunks"
METRIC_FAILED_CHUNKS = _PREFIX + "failed_chunks"
METRIC_EVICTED_CHUNKS = _PREFIX + "evicted_chunks"
METRIC_BACKOFF = _PREFIX + "backoff"
ROOT_LABEL = "root_dir"


@dataclass
class _PendingJob:
    vllm_job_id: int
    is_promotion: bool
    keys: tuple[OffloadKey, ...]
    submitted: float


class KvtierFilesystemTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over :class:`kvtier_runtime.fs.tier.FilesystemTier`.

    Runs in vLLM's scheduler, so nothing here waits for the disk: ``lookup`` reads an in-memory index
    (RETRY while the chunk's store is in flight), ``submit_store``/``submit_load`` reserve space and queue work on
    the tier's write and read thread pools, and ``get_finished_jobs`` collects what finished. A file that fails
    its checksum, key or shape check is a failed key (vLLM recomputes it) and is deleted; restarts rebuild the
    index from the block headers. Space is bounded by ``capacity_bytes`` with the configured eviction policy.

    Keys are vLLM's ``OffloadKey`` plus a digest of the run identity (model, dtype, block layout, the same fields
    vLLM's own ``fs`` tier separates directories by), so two models sharing a ``root_dir`` never serve each
    other's blocks, and the capacity bound covers all of them.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **tier_kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = FilesystemTierConfig.from_kwargs(tier_kwargs)
        locality = self.config.extra.get("locality")
        self.locality = Locality(locality) if locality is not None else None
        row_bytes = self.block_size_bytes
        n_rows = primary_kv_view.nbytes // row_bytes if row_bytes else 0
        kv_dtype = getattr(getattr(getattr(offloading_spec, "config", None), "model", None), "dtype", None)
        self._view_dtype = block_view_dtype(self.config.codec, kv_dtype, row_bytes)
        flat = torch.frombuffer(primary_kv_view, dtype=torch.uint8) if n_rows else torch.empty(0, dtype=torch.uint8)
        # One row per primary chunk, seen as the dtype the codec quantizes (the bytes are never copied here).
        self._rows = flat[: n_rows * row_bytes].view(n_rows, row_bytes).view(self._view_dtype)
        self._suffix = namespace_suffix(run_identity(offloading_spec, self.config.root_dir))
        self.tier = FilesystemTier(
            self.config,
            (self._rows.shape[1],),
            self._view_dtype,
            name=f"{tier_type}:{self.config.root_dir}",
        )
        self._pending: dict[int, _PendingJob] = {}
        self._stats = OffloadingConnectorStats()
        self._labels = (self.config.root_dir,)
        self._evictions_seen = self._evictions_total()

    # ---- keys ---------------------------------------------------------------------------------------------
    def tier_key(self, key: OffloadKey) -> bytes:
        """The key a chunk has in the filesystem tier (vLLM's key + the run-identity digest)."""
        return bytes(key) + self._suffix

    # ---- the SecondaryTierManager interface ----------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self.tier.state(self.tier_key(key)).value
        if state == "hit":
            return LookupResult.HIT
        if state == "pending":
            return LookupResult.RETRY  # the tiering manager treats a secondary's HIT_PENDING as a miss
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_promotion=True)

    def _submit(self, job_metadata: TransferJob, is_promotion: bool) -> None:
        keys = tuple(job_metadata.keys)
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        ctx = _access_context(keys[-1], job_metadata.req_context) if keys else None
        submit = self.tier.submit_load if is_promotion else self.tier.submit_store
        tier_job = submit([self.tier_key(k) for k in keys], rows, ctx)
        self._pending[tier_job] = _PendingJob(job_metadata.job_id, is_promotion, keys, time.monotonic())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        now = time.monotonic()
        for done in self.tier.get_finished():
            job = self._pending.pop(done.job_id, None)
            if job is None:
                continue  # not ours (a blocking call on self.tier by a test or tool)
            results.append(self._to_vllm(job, done, now))
        return results

    def _to_vllm(self, job: _PendingJob, done: TierJobResult, now: float) -> JobResult:
        outcome = job_outcome(done.ok, done.errors, job.is_promotion)
        labels = self._labels
        if job.is_promotion:
            self._stats.increase_counter(METRIC_LOADED_CHUNKS, outcome.n_ok, labels)
        else:
            self._stats.increase_counter(METRIC_STORED_CHUNKS, outcome.n_ok, labels)
        for reason, count in outcome.refused.items():
            self._stats.increase_counter(METRIC_REFUSED_CHUNKS, count, labels + (reason,))
        for kind, count in outcome.failed.items():
            self._stats.increase_counter(METRIC_FAILED_CHUNKS, count, labels + (kind,))
        successful = None
        if job.is_promotion and not outcome.success and outcome.n_ok:
            successful = tuple(k for k, ok in zip(job.keys, done.ok) if ok)
        return JobResult(
            job_id=job.vllm_job_id,
            success=outcome.success,
            successful_keys=successful,
            transfer_time=now - job.submitted,
            transfer_bytes=outcome.n_ok * self.block_size_bytes if outcome.n_ok else None,
        )

    def has_pending_work(self) -> bool:
        return bool(self._pending)

    def drain_jobs(self) -> None:
        self.tier.drain(timeout=None)

    def shutdown(self) -> None:
        self.tier.drain(timeout=None)
        self.tier.close()
        # Release the rows' export of the primary mmap, or vLLM cannot unmap /dev/shm/vllm_offload_*.mmap.
        self._rows = torch.empty(0, self._rows.shape[1] if self._rows.dim() == 2 else 0, dtype=self._view_dtype)

    # ---- metrics (vLLM's hook; the runtime's own kvtier_runtime_* metrics are updated by the tier itself) ----
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        root = (ROOT_LABEL,)
        return {
            METRIC_USED_BYTES: OffloadingGaugeMetadata("Bytes held by a kvtier filesystem tier.", root),
            METRIC_CAPACITY_BYTES: OffloadingGaugeMetadata("Configured capacity of a kvtier filesystem tier.", root),
            METRIC_BACKOFF: OffloadingGaugeMetadata(
                "1 while a kvtier filesystem tier refuses stores after repeated I/O errors.", root
            ),
            METRIC_STORED_CHUNKS: OffloadingCounterMetadata("Chunks written to a kvtier filesystem tier.", root),
            METRIC_LOADED_CHUNKS: OffloadingCounterMetadata(
                "Chunks read back from a kvtier filesystem tier into the CPU tier.", root
            ),
            METRIC_REFUSED_CHUNKS: OffloadingCounterMetadata(
                "Chunks a kvtier filesystem tier declined to store, by reason (not-admitted, no-room, backoff, busy).",
                root + ("reason",),
            ),
            METRIC_FAILED_CHUNKS: OffloadingCounterMetadata(
                "Chunk transfers of a kvtier filesystem tier that failed, by kind (corrupt, missing, enospc, eio...).",
                root + ("kind",),
            ),
            METRIC_EVICTED_CHUNKS: OffloadingCounterMetadata("Chunks evicted from a kvtier filesystem tier.", root),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        labels = self._labels
        stats.set_gauge(METRIC_USED_BYTES, self.tier.used_bytes, labels)
        stats.set_gauge(METRIC_CAPACITY_BYTES, self.tier.capacity_bytes, labels)
        stats.set_gauge(METRIC_BACKOFF, 1 if self.tier.in_backoff else 0, labels)
        total = self._evictions_total()
        if total > self._evictions_seen:
            stats.increase_counter(METRIC_EVICTED_CHUNKS, total - self._evictions_seen, labels)
            self._evictions_seen = total
        return stats

    def _evictions_total(self) -> float:
        value = REGISTRY.get_sample_value("kvtier_runtime_evictions_total", {"tier": self.tier.name})
        return value or 0.0

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_root_dir", "kvtier_capacity_bytes", "kvtier_codec", "kvtier_eviction_policy", "kvtier_admission")

    def config_info(self) -> ConfigInfoMapping:
        c = self.config
        return {
            "kvtier_root_dir": c.root_dir,
            "kvtier_capacity_bytes": c.capacity_bytes,
            "kvtier_codec": c.codec,
            "kvtier_eviction_policy": c.eviction_policy,
            "kvtier_admission": c.admission,
        }


__all__ = [
    "CACHE_POLICY_CLASSES",
    "KvtierCachePolicy",
    "KvtierFilesystemTier",
    "POLICY_REFUSALS",
    *CACHE_POLICY_CLASSES,
]
