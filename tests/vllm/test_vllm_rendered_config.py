"""The renderer's ``backend: kvtier`` output loads kvtier's plug-ins through vLLM's own factories and works.

Nothing is rebuilt by hand here: the policy document goes through the operator's parser and vLLM renderer, and the
``kv_connector_extra_config`` it emits (from the ``--kv-transfer-config`` argument and from the config file) is
handed to vLLM's OffloadingSpecFactory / TieringOffloadingSpec as the engine would. Only the sizes and paths are
test-sized (a policy may name any path).
"""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

import yaml  # noqa: E402
from foundation.policies import cpu, disk, policy  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_driver import BLOCK_BYTES, Scheduler, key, offloading_config  # noqa: E402

from kvtier_operator.api.validation import parse_policy  # noqa: E402
from kvtier_operator.render import render  # noqa: E402
from kvtier_runtime.config import VLLM_ADAPTER_MODULE, VLLM_SECONDARY_TIER_CLASS, vllm_cache_policy_class  # noqa: E402
from kvtier_runtime.engines.vllm_adapter import KvtierFilesystemTier  # noqa: E402


def rendered_extra_config(tmp_path) -> dict:
    doc = policy(
        backend="kvtier",
        tiers=[
            cpu(size="256Ki", evictionPolicy="s3fifo", admission="doorkeeper"),
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


def test_rendered_kvtier_config_loads_through_vllm_factories(tmp_path, engine_id):
    extra = rendered_extra_config(tmp_path)
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
