"""vLLM ``OffloadingSpec`` plug-in: kvtier's own offloading spec (``spec_name: KvtierOffloadingSpec``).

Its manager (scheduler process) translates vLLM's calls to :class:`~kvtier_runtime.store.books.OffloadBooks`
(host tier + filesystem tiers + remote tiers, kvtier's policies); its worker (worker process) copies pages between
vLLM's KV cache and the host rows (:mod:`kvtier_runtime.engines.page_copy`, in a shared region:
:mod:`kvtier_runtime.engines.host_region`)."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...codecs import KVChunkCodec
from ...codecs.layout import describe
from ...config import DEFAULT_HOST_SHM_DIR, ConfigError, OffloadSpecConfig
from ...store.books import DISK, HOST, REMOTE, OffloadBooks
from ...store.breaker import LoadMeter, TierBreakers
from ...store.memory_tier import MemoryTier
from ...tiers.registry import TierPlan, build_tiers, tier_class
from .. import metric_defs as M
from ..chunk_layout import LayoutDecision, check_worker_pages, chunk_layout, tier_codec
from ..host_region import HostRegion, remove_dead_regions_at_exit, remove_stale_regions
from ..page_copy import PageCopier
from ..vllm_support import block_view_dtype, namespace_suffix
from .cache_policy import access_context
from .caller_frames import find_in_callers, positive_int
from .events import kv_events_enabled, offloading_event, tier_kv_events
from .metric_metadata import vllm_metric_definitions
from .model_config import chunk_facts, kv_layout
from .remote_identity import remote_identity
from .secondary_tier import run_identity
from .wake import WAKE_S, ControlWatch, engine_input_queue, wake

# Under vLLM's logger tree: vLLM's handlers print only that tree, and this is where the engine's operators read.
_log = logging.getLogger(f"vllm.{__name__}")


# ---------------------------------------------------------------------------------------------------------------
# KvtierOffloadingSpec: kvtier's own offloading spec (host tier + filesystem tiers, kvtier's policies and codecs)
# ---------------------------------------------------------------------------------------------------------------



class KvtierHostSpec(CPULoadStoreSpec):
    """Rows of kvtier's host tier (one chunk each) a worker job reads or writes: host-memory chunk ids, as vLLM's
    own CPU tier names them (``chunk_ids``)."""


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` for kvtier. Configuration errors raise :class:`ConfigError` naming the key, in the
    constructor, so a bad config fails engine start-up before any KV is allocated."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # vLLM calls this in its front end (its Prometheus metrics), the process that outlives the engine core on
        # SIGTERM: there, remove at exit the host region a SIGKILLed engine core leaves behind.
        _front_end_cleanup(extra_config)
        return vllm_metric_definitions(M.SPEC_METRICS)

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
        # Per tier behind the host tier, in the policy's order.
        self.view_dtypes = [
            block_view_dtype(t.config.codec, config.model.dtype, self.row_bytes or 2) for t in self.kvtier.tiers
        ]
        self.layout = kv_layout(config)
        groups = getattr(config, "groups", None) or ()
        self.tokens_per_chunk = int(getattr(groups[0], "tokens_per_block", 0) if groups else 0) * \
            int(self.blocks_per_chunk)
        self.kv_events = [tier_kv_events(t.config.extra, i) for i, t in enumerate(self.kvtier.tiers)]
        # Only lossy tiers need the chunk's layout (and reading the model's config to find heads and head size).
        lossy = any(t.config.codec != "none" for t in self.kvtier.tiers)
        self.layout_decision = chunk_layout(chunk_facts(config)) if lossy else LayoutDecision(None)
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
        # Before the tiers: each tier stamps the end of its load jobs on its breaker's meter (docs/breaker.md).
        self.breakers = TierBreakers.for_spec(cfg, spec.tokens_per_chunk, logger=_log)
        # One plan per tier behind the host tier, in the policy's order (the order of cfg.names and of the
        # breakers); the registry builds them all. From here on each tier is a slot of the books (the tier, its
        # breaker and meter, its rows, its events), asked what it is, never sorted by medium.
        plans = self._tier_plans(spec, self.breakers.meters[1:])
        tiers = build_tiers(plans)
        for name, tier in zip(cfg.names[1:], tiers):
            _log.info("kvtier: tier %s: %s at %s, %d chunks", name, tier.medium, tier.address, tier.capacity_blocks)
        self.books = OffloadBooks(host, tiers, rows=[self.region.rows.view(p.dtype) for p in plans],
                                  key_suffix=suffix, enable_events=kv_events_enabled(spec),
                                  tier_events=spec.kv_events, breakers=self.breakers)
        self._reported: Counter[str] = Counter()
        self._stats_seen: tuple[int, ...] = ()  # _stats_state() when get_stats last ran
        self._extra_steps = 0
        self._lock = threading.RLock()
        self._requests: dict[str, dict[OffloadKey, int | None]] = {}  # request -> chunks it used, their positions
        # Recording (trace_dir): per running request, its prompt's chunks and length as first seen (None once
        # recorded), until it finishes.
        self._traced: dict[str, tuple[tuple[bytes, ...], int] | None] = {}
        # Per running request, the keys whose settled lookup hit_tokens/lookup_tokens counted, each with the tier
        # that served it (Found.served; None: a miss): vLLM's load source and the recording read it from here, so
        # the counters, the load source and the recording name the same tier for every chunk.
        self._counted: dict[str, dict[OffloadKey, int | None]] = {}
        # Per running request, the prompt's length in tokens (as vLLM's scheduler announced the request).
        self._prompt_tokens: dict[str, int] = {}
        # An idle engine announces a control-file change at once (a tier the guard disables leaves routers'
        # indexes within seconds): the engine core's queue, found while it builds this manager (wake.py).
        self._wake_until = 0.0
        control_file = cfg.control_file
        inbox = engine_input_queue() if self.books.events is not None and control_file is not None else None
        self._watch = ControlWatch(control_file, lambda: self._woken(inbox)) \
            if inbox is not None and control_file is not None else None
        if self._watch is not None:
            _log.info("kvtier: watching %s: a control-file change wakes the engine to announce it", cfg.control_file)
        elif self.books.events is not None and cfg.control_file is not None:
            _log.info("kvtier: this vLLM's engine core was not found: a control-file change is announced at the "
                      "engine's next step")
        try:
            self.recorder = _trace_recorder(spec, self, cfg.trace_dir) if cfg.trace_dir is not None else None
        except ConfigError:  # start-up fails: leave no tier threads or shared memory behind
            if self._watch is not None:
                self._watch.stop()
            self.books.close()
            self.region.close(unlink=True)
            raise

    def _tier_plans(self, spec: KvtierOffloadingSpec, meters: Sequence[LoadMeter]) -> list[TierPlan]:
        """What to build for each tier behind the host tier, in the policy's order. Each reads the host rows as the
        KV dtype its codec quantizes (layout-aware when the chunk's layout is known) and stamps the end of its load
        jobs on its breaker's meter. A tier that keys by the model itself (a remote store shared by every replica
        of the scope) is given the model identity, derived from vLLM's config; the others get the books' offload
        keys with the run-identity suffix (vLLM's block hashes + group index, where a request's cache_salt already
        entered the first block's hash). A medium's module (a remote tier's client, redis-py) is imported only when
        a tier of it is built."""
        cfg = spec.kvtier
        decision = spec.layout_decision
        if len(meters) != len(cfg.tiers):
            raise RuntimeError(f"breakers: {len(meters)} meters for {len(cfg.tiers)} tiers")
        plans: list[TierPlan] = []
        self.flat_codec_tiers: Counter[str] = Counter()
        for entry, dtype, meter in zip(cfg.tiers, spec.view_dtypes, meters):
            codec = tier_codec(entry.config, decision)
            if entry.config.codec != "none" and not isinstance(codec, KVChunkCodec):  # flat (int4 refused: int8)
                self.flat_codec_tiers[decision.reason] += 1
            options: dict[str, Any] = {"name": entry.config.runtime_name, "peer": "host", "codec": codec,
                                       "on_complete": meter.on_complete}
            if tier_class(entry.medium).scoped_keys:
                options["identity"] = remote_identity(spec, entry.config.codec)
            plans.append(TierPlan(entry.medium, entry.config, (self.region.rows.view(dtype).shape[1],), dtype,
                                  options))
        if self.flat_codec_tiers:
            _log.warning("kvtier: %d compressed tier(s) use the flat codec, whose scales do not follow K and V (%s: "
                         "%s)", sum(self.flat_codec_tiers.values()), decision.reason, decision.detail)
        elif decision.layout is not None:
            _log.info("kvtier: compressed tiers encode chunks of %s with layout-aware scales",
                      describe(decision.layout))
        return plans

    @property
    def lock(self) -> threading.RLock:
        """vLLM 0.33 holds this around every call (a lookup HIT and the prepare_load that pins it stay atomic)."""
        return self._lock

    # ---- lookups ----
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if req_context is None:
            return _LOOKUP[self.books.lookup(bytes(key), None)]
        if self.recorder is not None and req_context.req_id not in self._traced:
            self._first_seen(req_context)
        # hit_tokens/lookup_tokens count a request's key once: after a retry vLLM asks the whole prefix again.
        counted = self._counted.get(req_context.req_id)
        if counted is None:
            if len(self._counted) >= MAX_COUNTED_REQUESTS:  # requests never finished (not vLLM's way): forget
                self._counted.clear()
            counted = self._counted[req_context.req_id] = {}
        count = key not in counted
        found = self.books.find(bytes(key), access_context(key, req_context), count=count)
        if count and (found.state == "hit" or found.state == "miss"):
            counted[key] = found.served
        return _LOOKUP[found.state]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        """The tier this request's counted lookup of ``key`` said served it (vLLM asks after the lookups, for the
        keys it loads): the first load after a promotion is the promoted tier's, any later one the host tier's, as
        ``hit_tokens{tier}`` counts them."""
        counted = self._counted.get(req_context.req_id) if req_context is not None else None
        served = counted.get(key) if counted is not None else None
        return _SOURCES[self.books.served_by(served)[1] if served is not None else HOST]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.recorder is not None:
            tokens = _announced_prompt_tokens()
            if tokens is not None:
                if len(self._prompt_tokens) >= MAX_COUNTED_REQUESTS:  # never finished: forget (a bound)
                    self._prompt_tokens.clear()
                self._prompt_tokens[req_context.req_id] = tokens
        return RequestOffloadingContext()

    def prepare_load(self, keys: Any, req_context: ReqContext, **kwargs: Any) -> LoadStoreSpec:
        if self.recorder is not None and req_context is not None:
            self._trace(req_context)
        keys = list(keys)
        self._observe(keys, req_context)
        ctx = [access_context(k, req_context) for k in keys] if self.books.request_aware else None
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

    def _first_seen(self, req_context: ReqContext) -> None:
        """Note a request's prompt the first time the manager hears of it with its keys known: at its first lookup
        the request context holds every full chunk of the prompt (vLLM's scheduler sets each offload key's
        end-token position before it looks any up), in prompt order. Recorded once its lookups settle
        (:meth:`_trace`). The engine thread only copies the keys."""
        if len(self._traced) >= MAX_COUNTED_REQUESTS:  # requests never finished (not vLLM's way): forget
            self._traced.clear()
        positions = getattr(req_context, "_offload_key_positions", None)  # vLLM 0.32/0.33 ReqContext
        if not positions:
            self._traced[req_context.req_id] = ((), 0)
            return
        keys = tuple(bytes(k) for k in positions)  # insertion order: vLLM adds a request's keys chunk by chunk
        whole = positions[next(reversed(positions))]
        self._traced[req_context.req_id] = (keys, self._prompt_tokens.pop(req_context.req_id, whole))

    def _trace(self, req_context: ReqContext) -> None:
        """Record a request once its lookups settled (its first load, its first store, or its end, whichever
        comes first): its prompt's chunks, the prompt's length as sent (vLLM announced it; the whole chunks' length
        where it did not) and the tokens each tier served it (as ``hit_tokens{tier}`` counted them). A request first
        seen at its end is recorded then, with the chunks it has by then (generated ones too)."""
        req_id = req_context.req_id
        if req_id not in self._traced:
            self._first_seen(req_context)
        pending = self._traced.get(req_id)
        if pending is None:  # recorded already
            return
        self._traced[req_id] = None
        keys, prompt_tokens = pending
        if not keys:
            return
        hits: Counter[str] = Counter()
        for served in (self._counted.get(req_id) or {}).values():
            if served is not None:
                hits[self.books.served_by(served)[0]] += self.spec.tokens_per_chunk
        self.recorder.record(keys, prompt_tokens, hit_tokens=dict(hits))  # type: ignore[union-attr]

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.recorder is not None:
            self._trace(req_context)
            self._traced.pop(req_context.req_id, None)
            self._prompt_tokens.pop(req_context.req_id, None)
        self._counted.pop(req_context.req_id, None)
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
        if self.recorder is not None and req_context is not None:
            self._trace(req_context)
        keys = list(keys)
        self._observe(keys, req_context)
        ctx = [access_context(k, req_context) for k in keys]
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
    def on_schedule_end(self, context: Any = None) -> None:
        self.books.poll()
        if (not _HAS_RESET_FLUSHED and self.books.engine_fences
                and time.monotonic() - self.books.reset_at > RESET_FENCE_GRACE_S):
            # vLLM 0.32 neither completes the jobs in flight at a reset nor says when the workers are done with
            # them (0.33's on_reset_flushed). Its workers copy within a step (CPU) or a few ms (CUDA): after the
            # grace period the fenced rows are free to reuse.
            self.books.reset_flushed()

    def _woken(self, inbox: Any) -> None:
        """The control file changed (the watch's thread): step for a while, so the books read it and announce."""
        self._wake_until = time.monotonic() + WAKE_S
        wake(inbox)

    def has_pending_work(self) -> bool:
        self.books.poll()
        if self.books.has_pending_work() or time.monotonic() < self._wake_until:
            return True
        # The poll above may have just collected the last write-throughs of an idle engine: ask vLLM for one more
        # step so get_stats reports them (else the counters wait for the next request). Bounded, in case this
        # vLLM does not collect stats every step.
        if self._stats_seen != self._stats_state() and self._extra_steps < MAX_STATS_STEPS:
            self._extra_steps += 1
            return True
        return False

    def _stats_state(self) -> tuple[int, ...]:
        books = self.books
        return (sum(books.counters.values()), sum(books.load_failures.values()),
                sum(books.remote_load_failures.values()), sum(books.breakers.bypassed_stores.values()),
                *(sum(n for counts in slot.tier.reasons().values() for n in counts.values()) for slot in books.slots))

    def reset_cache(self) -> None:
        self.books.reset_host()
        self._requests.clear()

    def on_reset_flushed(self) -> None:
        self.books.reset_flushed()

    def take_events(self) -> Iterable[Any]:
        """KV cache events of the host tier (medium CPU) and of every tier behind it, placed as the tier says
        (``Tier.event_place``: medium, locality, and its kind as the ownership, prefixed by its place in the lookup
        order); vLLM's publisher turns them into BlockStored/BlockRemoved. A store is announced as one a removal
        will end (``removal_expected``), so vLLM keeps the chunk's tokens for the events until its last tier
        removes it (``self_describing_kv_events``)."""
        slots = self.books.slots
        for event in self.books.take_events():
            keys = [OffloadKey(k) for k in event.keys]
            if event.tier < 0:
                yield offloading_event(keys=keys, medium=Medium.CPU, removed=event.removed,
                                       metadata_only=event.metadata_only, removal_expected=not event.removed)
                continue
            place = slots[event.tier].tier.event_place
            yield offloading_event(keys=keys, medium=getattr(Medium, place.medium, Medium.CPU),
                                   removed=event.removed, locality=Locality(place.locality),
                                   ownership=f"{event.tier + 1}:{place.owner}", removal_expected=not event.removed)

    # ---- metrics / lifecycle ----
    def get_stats(self) -> OffloadingConnectorStats | None:
        books = self.books
        self._stats_seen = self._stats_state()
        self._extra_steps = 0
        stats = OffloadingConnectorStats()
        stats.set_gauge(M.HOST_USED_BYTES.name, books.host_used_bytes)
        stats.set_gauge(M.HOST_CAPACITY_BYTES.name, books.host_capacity_bytes)
        for reason, n in self.flat_codec_tiers.items():
            stats.set_gauge(M.FLAT_CODEC_TIERS.name, n, (reason,))
        for slot in books.slots:
            # Each tier by its name in the policy, and its address (what the label carried before tiers had names).
            tier, labels = slot.tier, (slot.name, slot.tier.address)
            stats.set_gauge(M.TIER_USED_BYTES.name, tier.used_bytes, labels)
            stats.set_gauge(M.TIER_CAPACITY_BYTES.name, tier.capacity_bytes, labels)
            for kind, value in tier.gauges().items():
                stats.set_gauge(M.TIER_GAUGES[kind].name, value, labels)
            for kind, by_reason in tier.reasons().items():
                metric = M.TIER_REASONS[kind].name
                for reason, n in by_reason.items():
                    self._delta(stats, metric, f"{kind}:{slot.name}:{reason}", n, (slot.name, reason))
        for kind, n in books.load_failures.items():
            self._delta(stats, M.LOAD_FAILURES.name, "fail:" + kind, n, (kind,))
        self._delta(stats, M.PROMOTIONS.name, "promotions", books.counters["promotions"])
        self._delta(stats, M.FS_STORES.name, "fs_stores", books.counters["fs_stores"])
        self._delta(stats, M.HOST_EVICTIONS.name, "host_evictions", books.counters["host_evictions"])
        breakers = books.breakers
        for breaker in breakers.breakers:
            for reason, on in breaker.bypass_gauges().items():
                stats.set_gauge(M.TIER_BYPASSED.name, on, (breaker.name, reason))
        for name, n in breakers.bypassed_lookups.items():
            self._delta(stats, M.TIER_MISSES.name, "tier_miss:" + name, n, (name, M.BYPASSED))
        for name, n in breakers.bypassed_stores.items():
            self._delta(stats, M.TIER_STORES_SKIPPED.name, "tier_store_skipped:" + name, n, (name, M.BYPASSED))
        for reason, n in breakers.control_errors.items():
            self._delta(stats, M.CONTROL_ERRORS.name, "control_error:" + reason, n, (reason,))
        if breakers.generation is not None:
            stats.set_gauge(M.CONTROL_GENERATION.name, breakers.generation)
        tokens = self.spec.tokens_per_chunk
        for name, n in books.hit_keys.items():
            self._delta(stats, M.HIT_TOKENS.name, "hit_tokens:" + name, n * tokens, (name,))
        self._delta(stats, M.LOOKUP_TOKENS.name, "lookup_tokens", books.counters["lookup_keys"] * tokens)
        self._delta(stats, M.REMOTE_HITS.name, "remote_hits", books.counters["remote_promotions"])
        self._delta(stats, M.REMOTE_STORES.name, "remote_stores", books.counters["remote_stores"])
        return stats

    def _delta(self, stats: OffloadingConnectorStats, metric: str, key: str, total: int,
               labels: tuple[str, ...] = ()) -> None:
        new = total - self._reported[key]
        if new > 0:
            stats.increase_counter(metric, new, labels)
            self._reported[key] = total

    def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self.recorder is not None:
            self.recorder.close()
        self.books.close()
        self.region.close(unlink=True)


def _front_end_cleanup(extra_config: Any) -> None:
    """Register the exit-time removal of dead host regions (:func:`remove_dead_regions_at_exit`) for the configured
    ``host_shm_dir``; a config it cannot read is left to the engine core's own start-up to report."""
    shm_dir = (extra_config or {}).get("host_shm_dir", DEFAULT_HOST_SHM_DIR) if hasattr(extra_config, "get") \
        else None
    if isinstance(shm_dir, str) and shm_dir.startswith("/"):
        remove_dead_regions_at_exit(shm_dir)


def trace_meta(spec: KvtierOffloadingSpec, manager: KvtierOffloadingManager) -> dict[str, Any]:
    """What ``kvtier replay`` needs to model this engine (the recording's ``trace-meta.json``): a block is one
    offload chunk; each tier by the name the breakers and metrics use, its medium, capacity in chunks and policy."""
    cfg = spec.kvtier
    books = manager.books
    tiers = [{"name": books.breakers[0].name, "medium": "cpu", "capacity_blocks": int(spec.n_rows),
              "eviction_policy": cfg.eviction_policy, "admission": cfg.admission}]
    for slot in books.slots:
        policy = slot.tier.replay_policy
        tiers.append({"name": slot.name, "medium": slot.tier.origin, "capacity_blocks": int(slot.tier.capacity_blocks),
                      "eviction_policy": policy.eviction_policy, "admission": policy.admission,
                      **({"shared": True} if policy.shared else {})})
    device = _device_blocks()
    groups = getattr(spec.config, "groups", None) or ()
    device_tokens = getattr(groups[0], "tokens_per_block", None) if groups else None
    return {"tokens_per_block": int(spec.tokens_per_chunk), "block_bytes": int(spec.row_bytes),
            "device_blocks": device,
            "device_block_tokens": int(device_tokens) if device and isinstance(device_tokens, int) else None,
            "engine": "vllm", "tiers": tiers}


def _device_blocks(max_frames: int = 16) -> int | None:
    """vLLM's GPU block count (its null block included), or None. vLLM sizes its KV cache before it builds the
    scheduler, but hands an offloading spec only an ``OffloadingConfig`` without it; the connector building this
    manager holds it (its ``kv_cache_config.num_blocks``) a few frames up. Read-only and bounded; None where this
    vLLM builds the manager some other way (replay then leaves the device tier out)."""
    return find_in_callers(lambda f: positive_int(getattr(f.get("kv_cache_config"), "num_blocks", None), 2),
                           start=1, max_frames=max_frames)


def _announced_prompt_tokens(max_frames: int = 4) -> int | None:
    """The prompt length of the request vLLM's scheduler is announcing (``on_new_request``), or None. vLLM hands the
    manager a ``ReqContext`` without the prompt; the connector calling it holds the ``Request`` (its
    ``num_prompt_tokens``) a frame or two up. Read-only and bounded, like :func:`_device_blocks`; None where this
    vLLM announces requests some other way (the recording then writes the whole chunks' length)."""
    return find_in_callers(lambda f: positive_int(getattr(f.get("request"), "num_prompt_tokens", None), 0),
                           start=2, max_frames=max_frames)


def _trace_recorder(spec: KvtierOffloadingSpec, manager: KvtierOffloadingManager, trace_dir: str) -> Any:
    from ...trace import TraceRecorder

    cfg = spec.kvtier
    try:
        recorder = TraceRecorder(trace_dir, cfg.trace_max_bytes, cfg.trace_files, trace_meta(spec, manager))
    except OSError as exc:
        raise ConfigError(f"kv_connector_extra_config.trace_dir: cannot record into {trace_dir!r} "
                          f"({exc.strerror or exc})") from None
    _log.info("kvtier: recording a trace of this engine's requests into %s (at most %d bytes over %d files)",
              trace_dir, cfg.trace_max_bytes, cfg.trace_files)
    return recorder


# vLLM 0.33 calls on_reset_flushed once the workers reported every job in flight at a reset; 0.32 has no such call.
_HAS_RESET_FLUSHED = "on_reset_flushed" in vars(OffloadingManager)
RESET_FENCE_GRACE_S = 30.0
# Steps an idle engine is kept stepping so its stats report work finished after its last request.
MAX_STATS_STEPS = 3
# Running requests whose counted lookups are remembered (a bound, not a tuning knob: vLLM finishes every request).
MAX_COUNTED_REQUESTS = 65536

# Where a host-resident chunk's bytes came from (the books' origin) as vLLM's cache-hit source: vLLM has no "remote"
# source; EXTERNAL_UNSPECIFIED is its bucket for a remote store.
_SOURCES = {HOST: CacheHitSource.HOST, DISK: CacheHitSource.DISK, REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
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
        self.layout = kv_layout(spec.config, pages)
        chunk = spec.layout_decision.layout
        wrong = (check_worker_pages(chunk, pages, max(1, int(spec.config.parallel.world_size)))
                 if chunk is not None else None)
        if wrong is not None:  # the scheduler would quantise K as V or across layers: refuse rather than corrupt
            raise ConfigError(f"kv_connector_extra_config.tiers[].config.codec: {wrong}; use codec 'none' with this "
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
