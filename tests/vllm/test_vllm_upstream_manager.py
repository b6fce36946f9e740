"""vLLM 0.33.0's own ``tests/v1/kv_offload/cpu/test_manager.py``, run unchanged against kvtier (issue 29).

Every test of vLLM's file is collected here three times (the ``variant`` fixture, see tests/vllm/upstream.py):
``vllm`` (the control: vLLM's ``CPUOffloadingManager``), ``kvtier-spec`` (kvtier's spec built through vLLM's
``OffloadingSpecFactory``, its manager in place of vLLM's) and ``kvtier-policy`` (vLLM's manager running kvtier's
``CachePolicy`` plug-in). vLLM's assertions are untouched: only ``make_cpu_manager``, the factory the file builds
its object under test with, is replaced.

EXCLUDED lists each test that does not apply to a variant, with the reason.
"""
from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
from upstream import ADAPTER, apply_exclusion, import_upstream

pytestmark = pytest.mark.vllm

upstream = import_upstream("tests.v1.kv_offload.cpu.test_manager")
from kvtier_runtime.config import vllm_cache_policy_class  # noqa: E402
from tests.v1.kv_offload.conftest import make_offloading_config  # noqa: E402
from tests.v1.kv_offload.cpu.test_manager import *  # noqa: E402, F403  (vLLM's tests, collected here)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

_VLLM_INTERNALS = "reads vLLM's CPUOffloadingManager/CachePolicy internals ({})"
_KVTIER_METRICS = ("vLLM CPU manager's own metrics (cpu cache usage/allocation size/stores skipped); kvtier's spec "
                   "reports kvtier_* gauges and counters instead (docs/vllm.md, 'kvtier metrics')")
_POLICY_CLASS = "asserts the policy is vLLM's {} class"
_SPEC_POLICY = ("replaces or inspects the manager's CachePolicy object; kvtier's spec has no CachePolicy (its host "
                "tier orders chunks with a kvtier EvictionPolicy)")

EXCLUDED: dict[tuple[str, str], str] = {
    # -- vLLM's CPU-manager metrics (not kvtier's spec's contract) --
    ("test_filter_reused_manager_reports_stores_skipped_counter", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_reports_cache_usage_gauge", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_reports_allocation_size_histogram", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_reports_allocation_size_on_eviction_failure", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_reports_cache_write_and_read_usage_gauges", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_clears_write_usage_after_failed_store", "kvtier-spec"): _KVTIER_METRICS,
    ("test_cpu_manager_reports_no_config_info_without_info", "kvtier-spec"):
        "CPUOffloadingManager built without its info; a spec always reports its config info",
    ("test_cpu_manager_reports_allocation_size_on_allocation_failure", "kvtier-spec"):
        _VLLM_INTERNALS.format("monkeypatches CPUOffloadingManager._allocate_chunks"),
    # -- tests that read vLLM's manager or policy internals --
    ("test_lru_batch_eviction_failure_is_atomic", "*"): _VLLM_INTERNALS.format("manager._policy, LRUCachePolicy"),
    ("test_lru_repeated_pin_cycles_compact_lazy_heap_entries", "*"):
        _VLLM_INTERNALS.format("LRUCachePolicy._heap"),
    ("test_reset_discards_stale_request_access_classification", "*"):
        _VLLM_INTERNALS.format("ARCCachePolicy.t1/t2"),
    ("TestARCPolicy", "*"): _VLLM_INTERNALS.format("ARCCachePolicy.t1/t2/b1/b2/target_t1_size"),
    ("test_evictable_cache_chunk_count", "*"):
        _VLLM_INTERNALS.format("manager._num_evictable_cache_chunks, manager._policy.evict"),
    ("test_touch_forwards_req_context_to_policy", "kvtier-spec"): _SPEC_POLICY,
    ("test_request_finish_forwards_grouped_deduplicated_accesses", "kvtier-spec"): _SPEC_POLICY,
    ("test_failed_store_records_access_once_and_uses_store_miss_hook", "*"):
        _VLLM_INTERNALS.format("manager._record_request_cache_access, manager._policy hooks"),
    ("test_arc_counts_reuse_once_and_keeps_insertions_in_t1", "*"): _VLLM_INTERNALS.format("ARCCachePolicy.t1/t2"),
    ("test_arc_reuse_wins_if_same_request_later_reinserts_key", "*"):
        _VLLM_INTERNALS.format("ARCCachePolicy.t1/t2"),
    ("test_arc_ghost_hit_adapts_once_per_request_before_insertion", "*"):
        _VLLM_INTERNALS.format("ARCCachePolicy.target_t1_size"),
    ("test_arc_pending_chunk_is_not_a_frequency_hit", "*"): _VLLM_INTERNALS.format("ARCCachePolicy.t1/t2"),
    ("test_lru_insert_orders_positioned_chunks_without_followup_access", "*"):
        _VLLM_INTERNALS.format("builds LRUCachePolicy directly"),
    # -- vLLM's store tracker (store_threshold) is the manager's; kvtier-spec maps it to kvtier's admission --
    ("test_filter_reused_manager", "kvtier-spec"): _VLLM_INTERNALS.format("manager.counts, the store tracker"),
    ("test_store_threshold_does_not_hide_ready_reuse", "kvtier-spec"):
        _VLLM_INTERNALS.format("manager.stores_skipped_in_current_batch"),
}
_ids = itertools.count()


def _spec_manager(tmp_path, num_chunks: int = 4, cache_policy: str = "lru",
                  cache_policy_module_path: str | None = None, enable_events: bool = False,
                  store_threshold: int = 0, max_tracker_size: int = 64_000):
    if cache_policy_module_path is not None:
        raise AssertionError("kvtier's spec takes kvtier's eviction policies by name only")
    extra = {"spec_module_path": ADAPTER, "eviction_policy": cache_policy, "host_shm_dir": str(tmp_path / "shm")}
    if store_threshold >= 2:
        extra.update(admission="threshold", admission_threshold=store_threshold)
    config = make_offloading_config(
        spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=num_chunks * 8, worker_kv_bytes_per_block=8,
        engine_id=f"kvtier-upstream-{os.getpid()}-{next(_ids)}", extra_config=extra)
    config = dataclasses.replace(config, enable_kv_cache_events=enable_events)
    spec = OffloadingSpecFactory.create_spec(config)
    return spec.get_manager()


@pytest.fixture(autouse=True, params=["vllm", "kvtier-spec", "kvtier-policy"])
def variant(request, monkeypatch, tmp_path):
    name = request.param
    if name != "vllm":  # the control runs every test, as vLLM's CI does
        apply_exclusion(EXCLUDED, request, name)
    managers = []
    original = upstream.make_cpu_manager
    if name == "kvtier-spec":
        def make(*args, **kwargs):
            manager = _spec_manager(tmp_path, *args, **kwargs)
            managers.append(manager)
            return manager
        monkeypatch.setattr(upstream, "make_cpu_manager", make)
    elif name == "kvtier-policy":
        def make(num_chunks: int = 4, cache_policy: str = "lru", cache_policy_module_path=None, **kwargs):
            assert cache_policy_module_path is None
            return original(num_chunks=num_chunks, cache_policy=vllm_cache_policy_class(cache_policy),
                            cache_policy_module_path=ADAPTER, **kwargs)
        monkeypatch.setattr(upstream, "make_cpu_manager", make)
    yield name
    for manager in managers:
        manager.shutdown()
