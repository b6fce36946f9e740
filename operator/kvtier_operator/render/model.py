"""What a renderer returns, and what it may know about the target container."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from ..api import v1alpha1 as api
from ..api.units import parse_quantity

CONFIG_DIR = "/etc/kvtier"
CONFIG_FILE = "engine.yaml"
CONFIG_VOLUME = "kvtier-config"
SHM_VOLUME = "kvtier-shm"


class RenderError(ValueError):
    """The policy cannot be rendered for this target; the message names the field and the rule."""


@dataclass(frozen=True)
class TargetFacts:
    """Facts about the serving container that change what is rendered."""

    container_name: str = ""
    image: str = ""
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


@dataclass
class RenderedConfig:
    """Engine configuration for one policy.

    ``args`` is the same configuration as a flag list; ``files`` holds the config file(s) the workload mounts at
    ``CONFIG_DIR``; ``config_args`` is what the container's args must contain to read them.
    """

    engine: str
    args: list[str]
    config_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    tiers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "args": self.args,
            "configArgs": self.config_args,
            "env": self.env,
            "files": self.files,
            "volumes": self.volumes,
            "volumeMounts": self.volume_mounts,
            "resources": self.resources,
            "tiers": self.tiers,
        }

    def config_hash(self) -> str:
        """Stable digest of everything that must roll the pods when it changes."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def config_volume(config_map_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name}},
        {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
    )


def tier_volume(tier: api.TierSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """Volume and mount of a filesystem tier (an emptyDir is sized to the tier)."""
    assert tier.volume is not None and tier.path is not None  # guaranteed by the CRD rules
    name = tier_volume_name(tier.name)
    source = tier.volume.model_dump(by_alias=True, exclude_none=True, mode="json")
    if "emptyDir" in source and "sizeLimit" not in source["emptyDir"]:
        source["emptyDir"]["sizeLimit"] = tier.size
    return {"name": name, **source}, {"name": name, "mountPath": normalized_path(tier.path)}


def normalized_path(path: str) -> str:
    """``/mnt/kvcache/`` and ``/mnt/kvcache`` are one mount point (the CRD refuses "." and ".." segments)."""
    return "/" + "/".join(part for part in path.split("/") if part)


def tier_volume_name(tier_name: str) -> str:
    """A volume name (at most 63 characters) unique per tier name: long names keep a prefix and a hash, so two
    tiers that share their first 51 characters still get two volumes."""
    name = f"kvtier-tier-{tier_name}"
    if len(name) <= 63:
        return name
    return f"{name[:54]}-{hashlib.sha256(tier_name.encode()).hexdigest()[:8]}"


def shm_volume(size_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": str(size_bytes)}},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    )


def host_memory(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec]) -> Optional[tuple[int, int]]:
    """(cpu tier bytes, bytes the container's memory limit must grow by), or None without a cpu tier."""
    cpu = next((t for t in tiers if t.medium == "cpu"), None)
    if cpu is None:
        return None
    cpu_bytes = parse_quantity(cpu.size)
    return cpu_bytes, cpu_bytes + parse_quantity(spec.host_memory_headroom)


def workload_storage(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], config_map_name: str, *,
                     cpu_tier_in_shm: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Volumes, mounts and resource changes every engine needs: the config, the tiers' volumes, host memory.

    ``cpu_tier_in_shm``: the engine keeps its cpu tier in /dev/shm (vLLM's mmap), whose tmpfs pages count
    against the container's memory limit; otherwise (TensorRT-LLM's pinned host cache) only the limit grows.
    """
    volume, mount = config_volume(config_map_name)
    volumes, mounts = [volume], [mount]
    resources: dict[str, Any] = {}
    memory = host_memory(spec, tiers)
    if memory is not None:
        cpu_bytes, increase = memory
        resources = {"cpuTierBytes": cpu_bytes, "memoryLimitIncreaseBytes": increase}
        if cpu_tier_in_shm:
            shm, shm_mount = shm_volume(increase)
            volumes.append(shm)
            mounts.append(shm_mount)
            resources["shmSizeLimitBytes"] = increase
    for tier in tiers:
        if tier.medium == "filesystem":
            volume, mount = tier_volume(tier)
            volumes.append(volume)
            mounts.append(mount)
    return volumes, mounts, resources
