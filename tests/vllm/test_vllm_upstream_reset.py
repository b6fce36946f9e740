"""vLLM 0.33.0's own cache-reset scheduler tests (``tests/v1/kv_connector/unit/offloading_connector/
test_scheduler.py``, ``test_cache_reset_*``), run unchanged against kvtier (issue 29).

A real engine scheduler with vLLM's ``OffloadingConnector``; the tests play the workers' reports. Variants
(tests/vllm/upstream.py): ``vllm`` (the control: vLLM's ``TieringOffloadingSpec`` with its ``example`` secondary
tier), ``kvtier-spec`` (kvtier's spec through ``spec_name``/``spec_module_path``, its host tier alone: vLLM's
``example`` tier is an in-memory test tier that completes at the next poll, and kvtier's spec has no such tier --
its filesystem tier is the ``kvtier-tier`` variant's subject), ``kvtier-tier`` (vLLM's tiering spec with kvtier's
``SecondaryTierManager`` in place of ``example``). Only ``_make_tiering_engine_scheduler``, the factory the tests
build their engine with, is replaced; EXCLUDED lists what does not apply, with the reason.

vLLM's helper names ``facebook/opt-125m`` from the Hugging Face hub for the engine's model config; nothing here
reaches the hub, so every variant (the control too) gets a small locally generated Llama instead
(e2e/vllm_cpu/model.py). The scheduler never runs the model; only its config (layers, heads, dtype) is read.
"""
from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub look-up here only waits for a network that is not there

from upstream import ADAPTER, apply_exclusion, import_upstream

pytestmark = pytest.mark.vllm

upstream = import_upstream("tests.v1.kv_connector.unit.offloading_connector.test_scheduler")
from tests.v1.kv_connector.unit.offloading_connector.test_scheduler import (  # noqa: E402,F401
    test_cache_reset_fence_held_too_long_warns_on_idle_steps,
    test_cache_reset_fence_ignores_reports_of_other_jobs,
    test_cache_reset_holds_promotions_until_flushed_jobs_report,
    test_cache_reset_without_in_flight_jobs_holds_nothing,
)
from tests.v1.kv_connector.unit.utils import create_scheduler  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

_EXAMPLE = "plants a chunk in vLLM's ExampleSecondaryTierManager (secondary.chunks) to be promoted"
EXCLUDED: dict[tuple[str, str], str] = {
    ("test_cache_reset_holds_promotions_until_flushed_jobs_report[promotes=True]", "kvtier-spec"): _EXAMPLE,
    ("test_cache_reset_holds_promotions_until_flushed_jobs_report[promotes=True]", "kvtier-tier"): _EXAMPLE,
    ("test_cache_reset_without_in_flight_jobs_holds_nothing", "kvtier-tier"):
        "gives the cascade to the secondary tier 10 scheduler steps taken back to back, no wall-clock time: vLLM's "
        "in-memory example tier completes at the next poll, kvtier's tier writes files on its own threads (it "
        "settles in 2-4 steps taken 1 ms apart, checked by hand)",
}


def _scheduler(extra_config: dict):
    """The body of vLLM's _make_tiering_engine_scheduler with another kv_connector_extra_config."""
    vllm_config = upstream.create_vllm_config(block_size=4, max_num_batched_tokens=64)
    vllm_config.scheduler_config.async_scheduling = False
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra_config)
    scheduler = create_scheduler(vllm_config, num_blocks=64)
    connector = scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    assert connector.connector_scheduler is not None
    return scheduler, connector.connector_scheduler.manager


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    from vllm_cpu import model  # e2e/ is on the test path (pyproject: pythonpath)

    return model.ensure_model(tmp_path_factory.getbasetemp() / "models", hidden_size=64, num_layers=2, num_heads=2,
                              num_kv_heads=2, intermediate_size=128, vocab_words=200)


@pytest.fixture(autouse=True, params=["vllm", "kvtier-spec", "kvtier-tier"])
def variant(request, monkeypatch, tmp_path, local_model):
    name = request.param
    monkeypatch.setattr(upstream, "create_vllm_config",
                        functools.partial(upstream.create_vllm_config, model=str(local_model)))
    if name != "vllm":
        apply_exclusion(EXCLUDED, request, name)
    cpu_bytes = 16 * SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    fs = {"root_dir": str(tmp_path / "fs"), "capacity_bytes": 64 << 20}
    if name == "kvtier-spec":
        def make(secondary_tiers):
            unknown = [t for t in secondary_tiers if t.get("type") != "example"]
            assert not unknown, f"no kvtier-spec translation for {unknown}"
            return _scheduler({"spec_name": "KvtierOffloadingSpec", "spec_module_path": ADAPTER,
                               "cpu_bytes_to_use": cpu_bytes, "host_shm_dir": str(tmp_path / "shm")})
        monkeypatch.setattr(upstream, "_make_tiering_engine_scheduler", make)
    elif name == "kvtier-tier":
        def make(secondary_tiers):
            tiers = [{"type": "KvtierFilesystemTier", "module_path": ADAPTER, **fs} if t.get("type") == "example"
                     else t for t in secondary_tiers]
            return _scheduler({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                               "secondary_tiers": tiers})
        monkeypatch.setattr(upstream, "_make_tiering_engine_scheduler", make)
    return name
