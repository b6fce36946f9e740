"""kvtier's spec, built by vLLM 0.33's factory, picks the codec of its compressed tiers from what vLLM tells it:
the layout-aware codec when the chunk is described, else the flat codec with a reason in its metrics.

This machine has no accelerator, so vLLM 0.33 runs on its ``UnspecifiedPlatform`` (the attention backend is not
known in the scheduler: ``backend_unknown``). Where a test needs the CPU backend's answer it replaces only that
platform probe (``_attention_backend``) and says so; the model config, vLLM's OffloadingConfig and the worker's
canonical KV caches are real.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

import torch  # noqa: E402
from kvtier_runtime.codecs import KVChunkCodec  # noqa: E402
from kvtier_runtime.config import ConfigError  # noqa: E402
from kvtier_runtime.engines.metric_defs import FLAT_CODEC_TIERS  # noqa: E402
from kvtier_runtime.engines.vllm import model_config  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_driver import offloading_config  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 4, 64, 16
BLOCK = 2 * HEADS * TOKENS * HEAD_DIM * 2  # one layer, float16


def _extra(tmp_path) -> dict:
    from kvtier_runtime.config import VLLM_ADAPTER_MODULE, VLLM_OFFLOADING_SPEC_CLASS

    tier = dict(capacity_bytes=8 << 20, n_read_threads=2, n_write_threads=2)
    return {"spec_name": VLLM_OFFLOADING_SPEC_CLASS, "spec_module_path": VLLM_ADAPTER_MODULE,
            "cpu_bytes_to_use": 16 * BLOCK, "host_shm_dir": str(tmp_path / "shm"),
            "fs_tiers": [dict(tier, root_dir=str(tmp_path / "nvme"), codec="int4"),
                         dict(tier, root_dir=str(tmp_path / "hdd"), codec="none")]}


def _model(tmp_path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 512,
                                               "num_attention_heads": 8, "num_key_value_heads": HEADS,
                                               "head_dim": HEAD_DIM}))
    return str(d)


def _spec(tmp_path, engine_id, model: str):
    config = offloading_config(engine_id, _extra(tmp_path), model=model, kv_dtype="float16", block_bytes=BLOCK)
    return OffloadingSpecFactory.create_spec(config)


def test_without_the_attention_backend_a_lossy_tier_keeps_the_flat_codec_and_reports_why(tmp_path, engine_id):
    spec = _spec(tmp_path, engine_id, _model(tmp_path))
    assert spec.layout_decision.reason == "backend_unknown"
    manager = spec.get_manager()
    try:
        nvme, hdd = manager.books.tiers
        assert not isinstance(nvme.codec, KVChunkCodec)
        # a GPU engine's path: the int4 tier is refused int4 (nothing checks it on attention) and stores int8
        assert nvme.codec.name == "int8" and hdd.codec.name == "none"
        stats = manager.get_stats()
        assert stats._values[FLAT_CODEC_TIERS.name] == {("backend_unknown",): 1}  # the int4 tier, not "none"
    finally:
        manager.shutdown()


def test_an_unreadable_model_config_is_shape_unknown(tmp_path, engine_id):
    spec = _spec(tmp_path, engine_id, str(tmp_path / "no-such-model"))
    assert spec.layout_decision.reason == "shape_unknown"


def test_cpu_backend_gives_the_layout_codec_and_the_worker_checks_its_pages(tmp_path, engine_id, monkeypatch):
    # Stands in for vLLM's CPU platform probe only (this machine's vLLM 0.33 has no CPU platform build).
    monkeypatch.setattr(model_config, "_attention_backend", lambda dtype, tokens, head_dim: ("CPU_ATTN", "vec"))
    spec = _spec(tmp_path, engine_id, _model(tmp_path))
    layout = spec.layout_decision.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_order) == (1, HEADS, HEAD_DIM,
                                                                                           "CPU_VEC")
    manager = spec.get_manager()
    try:
        nvme, hdd = manager.books.tiers
        assert isinstance(nvme.codec, KVChunkCodec) and nvme.codec.declared == layout
        assert FLAT_CODEC_TIERS.name not in manager.get_stats()._values
        # A worker whose cache is not one tensor per layer of the layout's page size must not start.
        kv = torch.zeros((8, BLOCK // 2), dtype=torch.int8)
        wrong = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(kv, BLOCK // 2)],
                                  group_data_refs=[[CanonicalKVCacheRef(0, BLOCK // 2)]])
        with pytest.raises(ConfigError, match=r"tiers\[\]\.config\.codec: the engine's KV cache has 1 tensors"):
            spec.get_worker(wrong)
    finally:
        manager.shutdown()
