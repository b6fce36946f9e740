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
from tests.v1.kv_offload.tiering.test_fs_tier import *  # noqa: E402,F401,F403  (vLLM's tests and fixtures)

from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext  # noqa: E402

_LAYOUT = "vLLM fs tier's file layout (tier.file_mapper paths, its batch_store_block/O_DIRECT/C extension)"
_INTERNALS = "reads vLLM FileSystemTierManager internals ({})"
EXCLUDED: dict[tuple[str, str], str] = {}


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
