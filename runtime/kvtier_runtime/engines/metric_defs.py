"""The metrics kvtier's engine plug-ins export through the engine (vLLM's ``vllm:kv_offload_*`` family), defined
once: name, kind, help and label names. Pure (no vllm, no torch): the plug-ins turn these into the engine's metadata
(:func:`kvtier_runtime.engines.vllm.metric_metadata.vllm_metric_definitions`). The operator's SLO reader queries two of
them by name (it imports only the runtime's config contract; a test checks its patterns match these names).

Two sets, one per backend that runs kvtier code inside vLLM:

* :data:`SPEC_METRICS` -- ``backend: kvtier`` (kvtier's own offloading spec: host, filesystem and remote tiers);
* :data:`FS_TIER_METRICS` -- ``backend: native`` with kvtier's filesystem tier behind vLLM's CPU tier.

``backend: lmcache`` runs no kvtier code in the engine: LMCache exports its own metrics and kvtier defines none.
The runtime's process-wide ``kvtier_runtime_*`` metrics (every tier's capacity, evictions, lookups...) are another
family, defined in :mod:`kvtier_runtime.metrics`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BYPASSED", "FLAT_REASONS", "FS_TIER_METRICS", "ROOT_LABEL", "SPEC_METRICS", "TIER_GAUGES", "TIER_REASONS",
    "EngineMetric", "prometheus_pattern",
]


@dataclass(frozen=True)
class EngineMetric:
    """One metric an engine plug-in exports. ``name`` is as the engine registers it (a counter's samples carry
    ``_total`` after it in Prometheus)."""

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("gauge", "counter"):
            raise ValueError(f"kind: {self.kind!r} of {self.name} must be 'gauge' or 'counter'")

    @property
    def sample_name(self) -> str:
        """The name of its samples in Prometheus: a counter's gets ``_total``."""
        return self.name + "_total" if self.kind == "counter" else self.name


def prometheus_pattern(metric: EngineMetric) -> str:
    """A ``__name__`` regex matching ``metric``'s samples whether the engine's exporter kept vLLM's ``:`` or wrote
    ``_`` (an exporter that sanitises names does)."""
    engine, sep, rest = metric.sample_name.partition(":")
    return f"{engine}[:_]{rest}" if sep else metric.sample_name


# Reason codes (the ``reason`` label of FLAT_CODEC_TIERS): why a lossy tier encodes with the flat codec.
FLAT_REASONS = (
    "kv_groups",           # more than one KV cache group
    "tensor_parallel",     # ranks whose shares of a host row are not each one layer-major chunk (pipeline...)
    "mla",                 # a latent (MLA) cache: one vector per token, no K/V heads for K/V scales to follow
    "kv_dtype",            # KV dtype the layout codecs do not quantise
    "shape_unknown",       # heads or head size not available in the scheduler process
    "backend_unknown",     # attention backend not known in the scheduler process
    "unsupported_layout",  # a backend/layout/ISA the layout codecs have no checked page order for
    "size_mismatch",       # the described chunk does not add up to the bytes vLLM reports per block
)
# The reason of a lookup or store a bypassed tier was not asked for (TIER_MISSES, TIER_STORES_SKIPPED).
BYPASSED = "bypassed"
# The label naming a native-backend filesystem tier by its directory.
ROOT_LABEL = "root_dir"

# ---- backend: kvtier (KvtierOffloadingSpec) ------------------------------------------------------------------
_SPEC = "vllm:kv_offload_kvtier_"
_TIER = ("tier",)
# A tier behind the host tier: ``tier`` its name in the policy; ``address`` (``url`` on the remote tier's own series)
# its directory or store url, which ``tier`` (or ``url`` alone) carried before tiers were named: kept one release,
# so a dashboard can move from the address to the name (docs/vllm.md, upgrading).
_NAMED = ("tier", "address")
_NAMED_URL = ("tier", "url")

HOST_USED_BYTES = EngineMetric(_SPEC + "host_used_bytes", "gauge", "Bytes held by kvtier's host tier.")
HOST_CAPACITY_BYTES = EngineMetric(_SPEC + "host_capacity_bytes", "gauge", "Capacity of kvtier's host tier in bytes.")
TIER_USED_BYTES = EngineMetric(_SPEC + "tier_used_bytes", "gauge",
                               "Bytes held by a kvtier tier behind the host tier (filesystem or remote).", _NAMED)
TIER_CAPACITY_BYTES = EngineMetric(_SPEC + "tier_capacity_bytes", "gauge",
                                   "Capacity of a kvtier tier behind the host tier (filesystem or remote).", _NAMED)
TIER_BACKOFF = EngineMetric(_SPEC + "tier_backoff", "gauge",
                            "1 while a kvtier filesystem tier refuses stores after repeated I/O errors, else 0.", _NAMED)
LOAD_FAILURES = EngineMetric(
    _SPEC + "load_failures", "counter",
    "Blocks a kvtier filesystem tier could not serve (corrupt, missing, eio...); vLLM recomputed them.", ("kind",))
PROMOTIONS = EngineMetric(_SPEC + "promotions", "counter",
                          "Blocks read from a kvtier filesystem tier into the host tier.")
FS_STORES = EngineMetric(_SPEC + "fs_stores", "counter", "Blocks written through to kvtier's filesystem tiers.")
HOST_EVICTIONS = EngineMetric(_SPEC + "host_evictions", "counter", "Blocks evicted from kvtier's host tier.")
FLAT_CODEC_TIERS = EngineMetric(
    _SPEC + "flat_codec_tiers", "gauge",
    "Lossy kvtier tiers encoding with the flat codec because the KV layout could not be described, by "
    f"reason ({', '.join(FLAT_REASONS)}).", ("reason",))
REMOTE_USED_BYTES = EngineMetric(
    _SPEC + "remote_used_bytes", "gauge",
    "Bytes kvtier's chunks of this model take in a remote tier's store (all replicas; an upper bound). Deprecated: "
    "tier_used_bytes{tier, address} (kept one release).", _NAMED_URL)
REMOTE_CAPACITY_BYTES = EngineMetric(_SPEC + "remote_capacity_bytes", "gauge",
                                     "kvtier's budget in a remote tier's store. Deprecated: tier_capacity_bytes{tier, "
                                     "address} (kept one release).", _NAMED_URL)
REMOTE_UP = EngineMetric(_SPEC + "remote_up", "gauge", "1 while a remote tier's store answers, else 0.", _NAMED_URL)
REMOTE_HITS = EngineMetric(_SPEC + "remote_hits", "counter", "Chunks read from a remote tier into the host tier.")
REMOTE_MISSES = EngineMetric(
    _SPEC + "remote_misses", "counter",
    "Chunks a remote tier did not serve, by tier and reason (absent, evicted, down, timeout, forged, ...); vLLM "
    "recomputed them.", ("tier", "reason"))
REMOTE_STORES = EngineMetric(_SPEC + "remote_stores", "counter", "Chunks written through to remote tiers.")
REMOTE_STORE_FAILURES = EngineMetric(
    _SPEC + "remote_store_failures", "counter",
    "Chunks a remote tier did not store, by tier and reason (full, down, timeout, ...).", ("tier", "reason"))
TIER_BYPASSED = EngineMetric(
    _SPEC + "tier_bypassed", "gauge",
    "1 while a kvtier tier is bypassed, by reason (slow: loading from it cost more than recomputing; disabled: the "
    "control file disables it), else 0.", ("tier", "reason"))
TIER_MISSES = EngineMetric(
    _SPEC + "tier_misses", "counter",
    f"Lookups a kvtier tier was not asked, by reason ({BYPASSED}); vLLM recomputed them unless a later tier served "
    "them.", ("tier", "reason"))
TIER_STORES_SKIPPED = EngineMetric(
    _SPEC + "tier_stores_skipped", "counter",
    f"Chunks not written through to a kvtier tier, by reason ({BYPASSED}).", ("tier", "reason"))
CONTROL_ERRORS = EngineMetric(
    _SPEC + "control_file_errors", "counter",
    "Versions of kvtier's control file refused (the last good state kept), by reason (too_large, unparsable, "
    "invalid, unknown_tier, unreadable).", ("reason",))
CONTROL_GENERATION = EngineMetric(
    _SPEC + "control_file_generation", "gauge",
    "The generation of the kvtier control file in force (absent until a file with one is read).")
HIT_TOKENS = EngineMetric(
    _SPEC + "hit_tokens", "counter",
    "Prompt tokens kvtier served, by the tier that held them (the host tier, or the filesystem or remote tier a "
    "chunk was promoted from): the measured side of what kvtier replay predicts.", _TIER)
LOOKUP_TOKENS = EngineMetric(_SPEC + "lookup_tokens", "counter",
                             "Prompt tokens vLLM looked up in kvtier (settled lookups: hit or miss).")

# What a tier reports of itself (``Tier.gauges()``, ``Tier.reasons()``), by kind: the metric it is exported as. A
# tier is labelled by its name and its address; a reason count also by its reason.
TIER_GAUGES: dict[str, EngineMetric] = {
    "backoff": TIER_BACKOFF, "up": REMOTE_UP, "remote_used_bytes": REMOTE_USED_BYTES,
    "remote_capacity_bytes": REMOTE_CAPACITY_BYTES}
TIER_REASONS: dict[str, EngineMetric] = {"misses": REMOTE_MISSES, "store_failures": REMOTE_STORE_FAILURES}

SPEC_METRICS: tuple[EngineMetric, ...] = (
    HOST_USED_BYTES, HOST_CAPACITY_BYTES, TIER_USED_BYTES, TIER_CAPACITY_BYTES, TIER_BACKOFF, LOAD_FAILURES, PROMOTIONS,
    FS_STORES, HOST_EVICTIONS, FLAT_CODEC_TIERS, REMOTE_USED_BYTES, REMOTE_CAPACITY_BYTES, REMOTE_UP, REMOTE_HITS,
    REMOTE_MISSES, REMOTE_STORES, REMOTE_STORE_FAILURES, TIER_BYPASSED, TIER_MISSES, TIER_STORES_SKIPPED,
    CONTROL_ERRORS, CONTROL_GENERATION, HIT_TOKENS, LOOKUP_TOKENS,
)

# ---- backend: native, kvtier's filesystem tier behind vLLM's CPU tier (KvtierFilesystemTier) ------------------
_FS = "vllm:kv_offload_kvtier_fs_"
_ROOT = (ROOT_LABEL,)

FS_USED_BYTES = EngineMetric(_FS + "used_bytes", "gauge", "Bytes held by a kvtier filesystem tier.", _ROOT)
FS_CAPACITY_BYTES = EngineMetric(_FS + "capacity_bytes", "gauge", "Configured capacity of a kvtier filesystem tier.",
                                 _ROOT)
FS_BACKOFF = EngineMetric(_FS + "backoff", "gauge",
                          "1 while a kvtier filesystem tier refuses stores after repeated I/O errors.", _ROOT)
FS_STORED_CHUNKS = EngineMetric(_FS + "stored_chunks", "counter", "Chunks written to a kvtier filesystem tier.",
                                _ROOT)
FS_LOADED_CHUNKS = EngineMetric(_FS + "loaded_chunks", "counter",
                                "Chunks read back from a kvtier filesystem tier into the CPU tier.", _ROOT)
FS_REFUSED_CHUNKS = EngineMetric(
    _FS + "refused_chunks", "counter",
    "Chunks a kvtier filesystem tier declined to store, by reason (not-admitted, no-room, backoff, busy).",
    _ROOT + ("reason",))
FS_FAILED_CHUNKS = EngineMetric(
    _FS + "failed_chunks", "counter",
    "Chunk transfers of a kvtier filesystem tier that failed, by kind (corrupt, missing, enospc, eio...).",
    _ROOT + ("kind",))
FS_EVICTED_CHUNKS = EngineMetric(_FS + "evicted_chunks", "counter", "Chunks evicted from a kvtier filesystem tier.",
                                 _ROOT)

FS_TIER_METRICS: tuple[EngineMetric, ...] = (
    FS_USED_BYTES, FS_CAPACITY_BYTES, FS_BACKOFF, FS_STORED_CHUNKS, FS_LOADED_CHUNKS, FS_REFUSED_CHUNKS,
    FS_FAILED_CHUNKS, FS_EVICTED_CHUNKS,
)
