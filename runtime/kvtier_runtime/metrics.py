"""Prometheus metrics of the runtime (prometheus_client, default registry, all named ``kvtier_runtime_*``).

Tier labels are the tier's name (``device``, ``host``, ``fs`` by default); a process with two stores gives them
different names. Metric objects are module-level because prometheus_client refuses to register a name twice.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Transfers of one 2 MiB block take ~40 us (device) to ~2 ms (disk); a batch can take seconds.
_TRANSFER_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)

LOOKUPS = Counter("kvtier_runtime_lookups", "Keys looked up, per tier", ["tier"])
HITS = Counter("kvtier_runtime_hits", "Keys looked up and found ready, per tier", ["tier"])
PROMOTIONS = Counter("kvtier_runtime_promotions", "Blocks copied to a faster tier", ["src", "dst"])
DEMOTIONS = Counter("kvtier_runtime_demotions", "Blocks copied to a slower tier", ["src", "dst"])
BYTES_MOVED = Counter("kvtier_runtime_bytes_moved", "Bytes copied between tiers (or the engine)", ["src", "dst"])
TRANSFER_SECONDS = Histogram(
    "kvtier_runtime_transfer_seconds",
    "Duration of one transfer: a batch of blocks copied together between two memory tiers, or one block file",
    ["src", "dst"],
    buckets=_TRANSFER_BUCKETS,
)
OCCUPANCY_BYTES = Gauge("kvtier_runtime_occupancy_bytes", "Bytes held (or reserved) in a tier", ["tier"])
CAPACITY_BYTES = Gauge("kvtier_runtime_capacity_bytes", "Configured capacity of a tier", ["tier"])
EVICTIONS = Counter("kvtier_runtime_evictions", "Blocks evicted from a tier", ["tier"])
STORES_REJECTED = Counter(
    "kvtier_runtime_stores_rejected", "Stores refused before any I/O, by reason", ["tier", "reason"]
)
FS_ERRORS = Counter(
    "kvtier_runtime_fs_errors",
    "Filesystem tier faults by kind (enospc, eio, corrupt, truncated, mismatch, missing, foreign, torn, other)",
    ["tier", "kind"],
)
FS_BACKOFF = Gauge("kvtier_runtime_fs_backoff", "1 while the filesystem tier refuses stores after errors", ["tier"])
# The remote (Valkey/Redis) tier: every chunk it could not serve or keep is counted here, by reason, never raised.
REMOTE_MISSES = Counter(
    "kvtier_runtime_remote_misses",
    "Chunks the remote tier did not serve, by reason (absent, evicted, down, timeout, auth, forged, key, version, "
    "corrupt, mismatch, ...); vLLM recomputed them",
    ["tier", "reason"],
)
REMOTE_STORE_FAILURES = Counter(
    "kvtier_runtime_remote_store_failures",
    "Chunks the remote tier did not store, by reason (full, down, timeout, auth, mismatch, other)",
    ["tier", "reason"],
)
REMOTE_PREVIOUS_KEY_READS = Counter(
    "kvtier_runtime_remote_previous_key_reads",
    "Values the remote tier opened with the previous tenant key (a key rotation under way: docs/security.md)",
    ["tier"],
)
REMOTE_KEY_RELOADS = Counter(
    "kvtier_runtime_remote_key_reloads",
    "Times the remote tier took new tenant keys from its key files without a restart (a rotation step)",
    ["tier"],
)
REMOTE_REFUSED = Gauge("kvtier_runtime_remote_refused",
                       "1 while the store refuses this remote tier's user (a wrong password or an ACL refusal: this "
                       "tier's fault, the store itself is up)", ["tier"])
REMOTE_UP = Gauge("kvtier_runtime_remote_up", "1 while the remote store answers, 0 while kvtier treats it as down",
                  ["tier"])
