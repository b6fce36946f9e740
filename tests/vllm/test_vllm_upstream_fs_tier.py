"""vLLM 0.33.0's own filesystem-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py``), run unchanged against
kvtier's ``SecondaryTierManager`` plug-in (issue 29).

Variants (tests/vllm/upstream.py): ``vllm`` (the control: vLLM's ``FileSystemTierManager``) and ``kvtier-tier``
(:class:`kvtier_runtime.engines.vllm_adapter.KvtierFilesystemTier`, built with the same arguments plus a capacity,
which kvtier's tier requires and vLLM's has not). The adaptation layer replaces what the tests build their tier
with (the name ``FileSystemTierManager`` in vLLM's module, used by its fixtures and tests) and one helper,
``lookup_and_wait``, which waits by reading vLLM's tier internals (``tier._lookup_manager._pending_results``):
kvtier's lookup answers from memory at once (RETRY while a store is in flight), so the helper polls ``lookup``
instead. vLLM's assertions are untouched; EXCLUDED lists what does not apply to kvtier, with the reason.
"""
from __future__ import annotations

import time

import pytest
from upstream import apply_exclusion, import_upstream

pytestmark = pytest.mark.vllm

upstream = import_upstream("tests.v1.kv_offload.tiering.test_fs_tier")
from tests.v1.kv_offload.tiering.test_fs_tier import *  # noqa: E402, F403  (vLLM's tests and fixtures)
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext  # noqa: E402

_LAYOUT = "vLLM fs tier's file layout (tier.file_mapper paths, its batch_store_block/O_DIRECT/C extension)"
_INTERNALS = "reads vLLM FileSystemTierManager internals ({})"
_POOL = "reads vLLM fs tier's thread pool (tier._pool queues and threads)"
_STORE_KEYS = "asserts vLLM fs tier's private store-job table (tier._store_job_keys)"
EXCLUDED: dict[tuple[str, str], str] = {
    ("test_shutdown_discards_pending_tasks", "kvtier-tier"): _POOL,
    ("test_store_load_roundtrip_without_o_direct", "kvtier-tier"): _INTERNALS.format("tier._use_o_direct"),
    ("test_failed_load_corrects_verdict_and_removes_corrupt_file", "kvtier-tier"):
        _INTERNALS.format("tier._lookup_manager, its cached verdicts"),
    ("test_batched_partial_load_failure_keeps_loaded_blocks", "kvtier-tier"):
        _INTERNALS.format("tier._lookup_manager, its cached verdicts"),
    ("test_mixed_job_results_emit_event_only_for_successful_job", "kvtier-tier"):
        "injects failures into vLLM fs tier's own I/O function (fs.manager.batch_store_block)",
    ("test_partially_failed_store_emits_no_event", "kvtier-tier"):
        "injects failures into vLLM fs tier's own I/O function (fs.manager.batch_store_block)",
    ("test_fs_tier_cross_tp_round_trip", "kvtier-tier"): _LAYOUT + ": file_mapper.base_path and per-rank files",
    ("test_failed_load_after_abort_does_not_break_newer_probe", "kvtier-tier"):
        "deliberate difference, 'synchronous lookup' (docs/vllm.md): kvtier's tier answers lookup from its "
        "in-memory index at once, so there is no background probe to abort and the answer is HIT, not RETRY",
    ("test_batched_load_first_block_fails_marks_whole_batch", "kvtier-tier"):
        "deliberate difference, 'synchronous lookup' (docs/vllm.md): after a failed batched promotion vLLM's tier "
        "remembers a per-request MISS for the whole batch; kvtier's lookup reports the tier's state (the failed "
        "block is gone: MISS; the readable blocks after it: HIT -- the scheduler stops at the first miss anyway). "
        "The successful_keys half of this test (None when the first block fails) holds for kvtier too",
    ("test_transient_load_failure_leaves_file", "kvtier-tier"):
        "deliberate difference, 'a failed read is never served again' (docs/vllm.md): kvtier deletes a block "
        "whose read failed for any reason; vLLM keeps the file after a transient error and reads it again",
    ("test_events_disabled_by_default", "kvtier-tier"): _STORE_KEYS,
    ("test_events_require_global_kv_events_flag", "kvtier-tier"): _STORE_KEYS,
    ("test_factory_forwards_locality_to_fs_tier", "kvtier-tier"):
        "builds vLLM's own tier by type 'fs' through SecondaryTierFactory and checks its class",
    ("test_invalid_path_raises_at_construction", "kvtier-tier"):
        "deliberate difference, 'degraded start' (docs/vllm.md): kvtier's tier with an unusable directory starts "
        "refusing stores and serves what it can, logged and in kvtier_runtime_fs_backoff; vLLM's raises OSError",
}


def _kvtier_fs_tier(offloading_spec, primary_kv_view, tier_type, root_dir, n_read_threads=16, n_write_threads=16,
                    **kwargs):
    from kvtier_runtime.engines.vllm_adapter import KvtierFilesystemTier

    return KvtierFilesystemTier(offloading_spec, primary_kv_view, tier_type, root_dir=root_dir,
                                capacity_bytes=256 << 20, n_read_threads=n_read_threads,
                                n_write_threads=n_write_threads, **kwargs)


def _lookup_and_wait(tier, keys, ctx=upstream._CTX, timeout: float = 1.0):
    for k in keys:
        tier.lookup(k, ctx)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in results:
            return results
        time.sleep(0.01)
    return [tier.lookup(k, ctx) for k in keys]


@pytest.fixture(autouse=True, params=["vllm", "kvtier-tier"])
def variant(request, monkeypatch):
    name = request.param
    if name == "kvtier-tier":
        apply_exclusion(EXCLUDED, request, name)
        monkeypatch.setattr(upstream, "FileSystemTierManager", _kvtier_fs_tier)
        monkeypatch.setattr(upstream, "lookup_and_wait", _lookup_and_wait)
    return name
