"""vLLM 0.33 configuration: an explicit ``--kv-transfer-config`` and the flags around it.

Facts (checked against the vllm 0.33.0 wheel): the OffloadingConnector reads ``kv_connector_extra_config``;
``spec_name`` selects ``CPUOffloadingSpec`` or ``TieringOffloadingSpec`` (secondary tiers need the latter);
``cpu_bytes_to_use`` is bytes across all TP workers; ``block_size`` is tokens per offloaded chunk;
``eviction_policy`` names a built-in policy or, with ``cache_policy_module_path``, a class; secondary tier dicts
carry ``type`` (+ ``module_path`` out of tree) and the tier's constructor kwargs. ``--kv-offloading-size`` is not
used: it silently overwrites the connector. ``backend: kvtier`` renders kvtier's own spec (``spec_name:
KvtierOffloadingSpec`` + ``spec_module_path``), which vLLM 0.32 and 0.33 load through ``OffloadingSpecFactory``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from kvtier_runtime.config import (
    VLLM_ADAPTER_MODULE,
    VLLM_BUILTIN_EVICTION_POLICIES,
    VLLM_OFFLOADING_SPEC_CLASS,
    CachePolicyChoice,
    FilesystemTierConfig,
    OffloadSpecConfig,
    RemoteTierConfig,
    TierConfig,
    TierEntry,
)

from ..api import v1alpha1 as api
from .model import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONTROL_FILE,
    RenderedConfig,
    RenderError,
    dump_yaml,
    mount_path,
    remote_ca_file,
    remote_secret_files,
    trace_volume,
    workload_storage,
)

# Replicas share a remote tier only if their block hashes agree: sha256 over CBOR is reproducible across processes,
# Python versions and languages (vLLM's default sha256 pickles, which may differ between images).
SHARED_PREFIX_HASH = "sha256_cbor"

LMCACHE_FILE = "lmcache.yaml"


def _engine_flags(spec: api.KVCachePolicySpec) -> dict[str, Any]:
    flags: dict[str, Any] = {"block-size": spec.block_size}
    if spec.gpu.memory_utilization is not None:
        flags["gpu-memory-utilization"] = spec.gpu.memory_utilization
    if spec.gpu.kv_cache_dtype != "auto":
        flags["kv-cache-dtype"] = spec.gpu.kv_cache_dtype
    return flags


def _shared_hash_flags(tiers: list[api.TierSpec]) -> dict[str, Any]:
    return {"prefix-caching-hash-algo": SHARED_PREFIX_HASH} if any(t.medium == "remote" for t in tiers) else {}


# The pod IP, from the downward API: a KV event topic names the pod by it (kv@<pod IP>@<model>, as llm-d's indexer
# expects), and the container's args reference it as $(KVTIER_POD_IP), which the kubelet expands.
POD_IP_ENV = "KVTIER_POD_IP"


def _events(spec: api.KVCachePolicySpec) -> api.EventsSpec | None:
    return spec.events if spec.events is not None and spec.events.enabled else None


def _events_flags(events: api.EventsSpec) -> dict[str, str]:
    """vLLM's ``--kv-events-config`` as dotted keys (``kv-events-config.endpoint: ...``), which vLLM's parser merges
    with the pod's own ``--kv-events-config.topic`` (a nested dict in the file would be replaced by it). Strings: a
    dotted key from the file needs a value after it."""
    flags = {"kv-events-config.enable_kv_cache_events": "true", "kv-events-config.publisher": "zmq",
             "kv-events-config.endpoint": events.endpoint}
    if events.binds:  # subscribers that missed batches ask the pod for them again
        flags["kv-events-config.replay_endpoint"] = f"tcp://*:{events.port + 1}"
    return flags


def events_topic_args(events: api.EventsSpec, scope: str) -> list[str]:
    """What the container's args add for ``spec.events``: the pod's own topic, ``kv@<pod IP>@<scope>/<model>``. The
    index's key of every block starts from the topic's model name, so the scope (the policy's namespace) enters
    every key: another namespace's identical prompt never scores here (docs/routing.md)."""
    return ["--kv-events-config.topic", f"kv@$({POD_IP_ENV})@{scope}/{events.model}"]


def _kvtier_extra_config(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], scope: str) -> dict[str, Any]:
    """kvtier's own offloading spec: its host tier (the cpu tier) and the tiers behind it in the policy's order
    (filesystem and remote, each under the policy's name, which the control file and the per-tier metrics speak),
    with kvtier's policies and codecs (loaded by vLLM's OffloadingSpecFactory from ``spec_module_path``)."""
    cpu = tiers[0]
    config = OffloadSpecConfig(
        host_name=cpu.name,
        tiers=tuple(TierEntry(t.name, t.medium, _tier_config(spec, t, scope)) for t in tiers[1:]),
        control_file=f"{CONFIG_DIR}/{CONTROL_FILE}",
        recompute_tokens_per_s=spec.offload.recompute_tokens_per_second,
        cpu_bytes_to_use=cpu.size_bytes,
        eviction_policy=cpu.eviction,
        admission=cpu.admission,
        admission_threshold=spec.offload.admission_threshold,
        **_trace_config(spec),
    )
    extra: dict[str, Any] = {"spec_name": VLLM_OFFLOADING_SPEC_CLASS, "spec_module_path": VLLM_ADAPTER_MODULE,
                             "offload_prompt_only": spec.offload.prompt_only}
    if spec.offload.chunk_tokens is not None:
        extra["block_size"] = spec.offload.chunk_tokens
    extra.update(config.to_extra_config())
    return extra


def _trace_config(spec: api.KVCachePolicySpec) -> dict[str, Any]:
    """The recorder's keys (OffloadSpecConfig.trace_*) when spec.trace is enabled; the folder is the emptyDir
    :func:`trace_volume` mounts."""
    if spec.trace is None or not spec.trace.enabled:
        return {}
    return {"trace_dir": api.TRACE_DIR, "trace_max_bytes": spec.trace.max_size_bytes,
            "trace_files": spec.trace.files}


def _overlap(a: str, b: str) -> bool:
    """One mount path is the other or lies inside it (paths in normal form)."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _tier_config(spec: api.KVCachePolicySpec, tier: api.TierSpec, scope: str) -> TierConfig:
    """The runtime config of a tier behind the host tier, by the tier's medium (the CRD allows filesystem and
    remote there); with spec.events, every tier announces its chunks (vLLM's per-tier ``enable_kv_events``)."""
    config: TierConfig = _remote_tier_config(tier, scope) if tier.medium == "remote" else _fs_tier_config(spec, tier)
    if _events(spec) is not None:
        config = replace(config, extra={**config.extra, "enable_kv_events": True})
    return config


def _fs_tier_config(spec: api.KVCachePolicySpec, tier: api.TierSpec) -> FilesystemTierConfig:
    assert tier.path is not None
    return FilesystemTierConfig(
        root_dir=mount_path(tier),
        capacity_bytes=tier.size_bytes,
        codec=tier.compression,
        eviction_policy=tier.eviction,
        admission=tier.admission,
        admission_threshold=spec.offload.admission_threshold,
        n_read_threads=tier.read_threads,
        n_write_threads=tier.write_threads,
    )


def _remote_tier_config(tier: api.TierSpec, scope: str) -> RemoteTierConfig:
    """``scope``: the policy's namespace, the first part of every store key (each namespace its own chunks, index
    and budget; a store ACL user per namespace confines it)."""
    assert tier.remote is not None
    password, key, previous = remote_secret_files(tier)
    return RemoteTierConfig(url=tier.remote.url, capacity_bytes=tier.size_bytes, codec=tier.compression,
                            password_file=password, mac_key_file=key, previous_mac_key_file=previous,
                            ca_file=remote_ca_file(tier), scope=scope, username=tier.remote.username)


def _offloading_extra_config(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], scope: str) -> dict[str, Any]:
    if spec.backend == "kvtier":
        return _kvtier_extra_config(spec, tiers, scope)
    cpu, secondary = tiers[0], [t for t in tiers[1:] if t.medium == "filesystem"]
    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec" if secondary else "CPUOffloadingSpec",
        "cpu_bytes_to_use": cpu.size_bytes,
        "offload_prompt_only": spec.offload.prompt_only,
    }
    if spec.offload.chunk_tokens is not None:
        extra["block_size"] = spec.offload.chunk_tokens
    if spec.offload.store_threshold and not secondary:
        extra["store_threshold"] = spec.offload.store_threshold
    if cpu.eviction in VLLM_BUILTIN_EVICTION_POLICIES:
        extra["eviction_policy"] = cpu.eviction
    else:  # kvtier's policy inside vLLM's own manager, through vLLM's CachePolicyFactory
        extra["eviction_policy"] = CachePolicyChoice(cpu.eviction).class_name
        extra["cache_policy_module_path"] = VLLM_ADAPTER_MODULE
    if secondary:
        extra["secondary_tiers"] = [_secondary_tier(spec, t) for t in secondary]
    return extra


def _secondary_tier(spec: api.KVCachePolicySpec, tier: api.TierSpec) -> dict[str, Any]:
    assert tier.path is not None
    # vLLM's own fs tier has no size limit: the volume's size limit is the only bound (see docs).
    out: dict[str, Any] = {"type": "fs", "root_dir": mount_path(tier), "n_read_threads": tier.read_threads,
                           "n_write_threads": tier.write_threads}
    if _events(spec) is not None:
        out["enable_kv_events"] = True
    return out


def _lmcache_config(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec]) -> dict[str, Any]:
    cpu = tiers[0]
    # LMCache sizes are GiB as floats.
    config: dict[str, Any] = {
        "chunk_size": spec.offload.chunk_tokens or 256,
        "local_cpu": True,
        "max_local_cpu_size": round(cpu.size_bytes / 2**30, 3),
        "cache_policy": "LRU",
    }
    disk = next((t for t in tiers if t.medium == "filesystem"), None)
    if disk is not None:
        # A URL: a path with spaces, '%' or '#' must be percent-encoded or LMCache reads another path.
        config["local_disk"] = f"file://{quote(mount_path(disk).rstrip('/'))}/"
        config["max_local_disk_size"] = round(disk.size_bytes / 2**30, 3)
    return config


def render_vllm(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], config_map_name: str, *,
                scope: str) -> RenderedConfig:
    """``scope``: the tenant scope of the remote tiers' store keys (the policy's namespace)."""
    flags = _engine_flags(spec)
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    if tiers and spec.backend == "lmcache":
        flags["kv-transfer-config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                       "kv_load_failure_policy": "recompute"}
        files[LMCACHE_FILE] = dump_yaml(_lmcache_config(spec, tiers), sort_keys=True)
        env["LMCACHE_CONFIG_FILE"] = f"{CONFIG_DIR}/{LMCACHE_FILE}"
    elif tiers:
        flags.update(_shared_hash_flags(tiers))
        flags["kv-transfer-config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": _offloading_extra_config(spec, tiers, scope),
        }
    events = _events(spec)
    config_args = ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    env_fields: dict[str, str] = {}
    if events is not None:
        flags.update(_events_flags(events))
        config_args += events_topic_args(events, scope)
        env_fields[POD_IP_ENV] = "status.podIP"
    files[CONFIG_FILE] = dump_yaml(flags, sort_keys=False)

    args: list[str] = []
    for key, value in flags.items():
        args += [f"--{key}", json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)]

    volumes, mounts, memory = workload_storage(spec, tiers, config_map_name, cpu_tier_in_shm=True)
    if spec.trace is not None and spec.trace.enabled:
        if spec.backend != "kvtier":
            raise RenderError(f"spec.trace.enabled: {api.TRACE_BACKEND_RULE}")
        if tiers:  # no tier enabled: no offloading spec runs, nothing records
            volume, mount = trace_volume(spec.trace)
            clash = next((m["mountPath"] for m in mounts if _overlap(m["mountPath"], mount["mountPath"])), None)
            if clash is not None:
                raise RenderError(f"spec.trace: the recording's folder {api.TRACE_DIR} overlaps the mount at "
                                  f"{clash!r}; move that tier's path")
            volumes.append(volume)
            mounts.append(mount)
    return RenderedConfig(
        engine="vllm",
        args=args,
        config_args=config_args,
        env=env,
        env_fields=env_fields,
        files=files,
        volumes=volumes,
        volume_mounts=mounts,
        host_memory=memory,
        tiers=[t.name for t in tiers],
        live_control=bool(tiers) and spec.backend == "kvtier",
    )
