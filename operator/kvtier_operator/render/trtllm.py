"""TensorRT-LLM configuration: the YAML for ``--extra_llm_api_options`` (works on old and new releases).

``kv_cache_config`` facts: ``host_cache_size`` is bytes (unset = no host offload), ``tokens_per_block`` a power
of two, ``secondary_offload_min_priority`` 0-100, ``disk_cache_size``/``disk_cache_path`` from 1.3 only (the CRD
rejects a filesystem tier without a stated engineVersion >= 1.3).
"""
from __future__ import annotations

from typing import Any

from ..api import v1alpha1 as api
from .model import CONFIG_DIR, CONFIG_FILE, RenderedConfig, dump_yaml, mount_path, workload_storage


def render_trtllm(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], config_map_name: str) -> RenderedConfig:
    kv: dict[str, Any] = {"enable_block_reuse": True, "tokens_per_block": spec.block_size}
    if spec.gpu.memory_utilization is not None:
        kv["free_gpu_memory_fraction"] = spec.gpu.memory_utilization
    if spec.gpu.kv_cache_dtype != "auto":
        kv["dtype"] = "fp8"
    volumes, mounts, memory = workload_storage(spec, tiers, config_map_name, cpu_tier_in_shm=False)
    if memory is not None:
        kv["host_cache_size"] = memory.cpu_tier_bytes
        kv["secondary_offload_min_priority"] = spec.offload.min_priority
    disk = next((t for t in tiers if t.medium == "filesystem"), None)
    if disk is not None:
        kv["disk_cache_size"] = disk.size_bytes
        kv["disk_cache_path"] = mount_path(disk)
    document = {"kv_cache_config": kv}
    return RenderedConfig(
        engine="trtllm",
        args=["--extra_llm_api_options", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        config_args=["--extra_llm_api_options", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        files={CONFIG_FILE: dump_yaml(document, sort_keys=False)},
        volumes=volumes,
        volume_mounts=mounts,
        host_memory=memory,
        tiers=[t.name for t in tiers],
    )
