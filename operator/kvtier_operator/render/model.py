"""What a renderer returns, and what it may know about the target container."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from kvtier_runtime.config import REMOTE_KEY_RULE, ConfigError, check_remote_scope

from ..api import paths
from ..api import v1alpha1 as api

# libyaml's emitter when PyYAML has it: it writes the same bytes as the pure-Python one (tested on every
# rendered form) at a tenth of the CPU, which was two thirds of a reconcile's.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump_yaml(document: Any, *, sort_keys: bool) -> str:
    return yaml.dump(document, Dumper=_DUMPER, sort_keys=sort_keys)


CONFIG_DIR = "/etc/kvtier"
CONFIG_FILE = "engine.yaml"
# The runtime's live control file (kvtier_runtime.store.control), a key of the same ConfigMap: the kubelet swaps a
# ConfigMap volume's files in place, so a tier the SLO guard disables or re-enables reaches the running engine
# without a restart. It is not part of the config hash, which would roll the pods.
CONTROL_FILE = "control.json"
CONFIG_VOLUME = "kvtier-config"
SHM_VOLUME = "kvtier-shm"
# A remote tier's Secrets (password, MAC key, CA bundle) are mounted read-only here, one directory per tier: the
# operator never reads them, the runtime reads the files when the tier starts (redis-py reads the CA per connection).
REMOTE_SECRETS_DIR = "/etc/kvtier-remote"
REMOTE_PASSWORD_FILE = "password"
REMOTE_MAC_KEY_FILE = "mac-key"
# The previous tenant key during a rotation: projected only while its Secret key exists (an optional source), so a
# rotation is two edits of the Secret, no edit of the policy and no restart (docs/security.md).
REMOTE_PREVIOUS_MAC_KEY_FILE = "mac-key.previous"
REMOTE_CA_FILE = "ca.crt"


class RenderError(ValueError):
    """The policy cannot be rendered for this target; the message names the field and the rule."""


@dataclass(frozen=True)
class TargetFacts:
    """Facts about the serving container that change what is rendered."""

    container_name: str = ""
    image: str = ""
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostMemory:
    """What a cpu tier costs the container, in bytes (the headroom check and the memory limit read these)."""

    cpu_tier_bytes: int
    # cpu tier + spec.hostMemoryHeadroom: what the container's memory limit must grow by.
    limit_increase_bytes: int
    # vLLM keeps its cpu tier in /dev/shm, sized to the increase; None where the engine uses pinned memory.
    shm_size_limit_bytes: Optional[int] = None

    def to_dict(self) -> dict[str, int]:
        # These keys are part of the config hash: renaming one would roll every workload on upgrade.
        out = {"cpuTierBytes": self.cpu_tier_bytes, "memoryLimitIncreaseBytes": self.limit_increase_bytes}
        if self.shm_size_limit_bytes is not None:
            out["shmSizeLimitBytes"] = self.shm_size_limit_bytes
        return out


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
    # Env vars from the pod's own fields (name -> the downward API's fieldPath), e.g. the pod IP a KV event topic
    # names, which ``config_args`` reference as $(NAME).
    env_fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    host_memory: Optional[HostMemory] = None
    tiers: list[str] = field(default_factory=list)
    # The engine reads CONTROL_FILE and bypasses the tiers it lists without a restart (backend kvtier): the SLO
    # guard's decisions then travel in the file, not in a new configuration. Neither field is in the config hash.
    live_control: bool = False
    # Rendered tiers the control file disables (the guard's), in rendered order.
    bypassed: list[str] = field(default_factory=list)

    @property
    def resources(self) -> dict[str, int]:
        return self.host_memory.to_dict() if self.host_memory is not None else {}

    def to_dict(self) -> dict[str, Any]:
        out = {
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
        if self.env_fields:  # only when set: a key added for everyone would roll every workload on upgrade
            out["envFields"] = self.env_fields
        return out

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
    return {"name": name, **source}, {"name": name, "mountPath": mount_path(tier)}


TRACE_VOLUME = "kvtier-trace"
# Room in the recording's emptyDir beyond the trace files: trace-meta.json (a few hundred bytes) and its temporary
# copy while it is rewritten.
TRACE_VOLUME_MARGIN = 2**20


def trace_volume(trace: api.TraceSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The emptyDir the engine records its traffic into (spec.trace), sized to the trace files plus the sidecar."""
    return ({"name": TRACE_VOLUME, "emptyDir": {"sizeLimit": str(trace.max_size_bytes + TRACE_VOLUME_MARGIN)}},
            {"name": TRACE_VOLUME, "mountPath": api.TRACE_DIR})


def mount_path(tier: api.TierSpec) -> str:
    """The tier's mount path, judged by the same rules as at admission (api.paths), on the path that is mounted.
    The models already refuse a bad path; this re-check makes a renderer unable to emit one whatever its input."""
    assert tier.path is not None
    problem = paths.mount_path_problem(tier.path)
    if problem:
        raise RenderError(f"spec.tiers[{tier.name}].path: {tier.path!r} {problem}")
    return paths.normal_path(tier.path)


def tier_volume_name(tier_name: str, prefix: str = "kvtier-tier-") -> str:
    """A volume name (at most 63 characters) unique per tier name: long names keep a prefix and a hash, so two
    tiers that share their first 51 characters still get two volumes."""
    name = f"{prefix}{tier_name}"
    if len(name) <= 63:
        return name
    return f"{name[:54]}-{hashlib.sha256(tier_name.encode()).hexdigest()[:8]}"


def remote_secret_files(tier: api.TierSpec) -> tuple[Optional[str], str, str]:
    """Paths of the remote tier's password file (None where not set), the tenant's key file and the previous tenant
    key's file (present only during a rotation) in the container. The key is required (the models refuse a remote
    tier without remote.macKeySecret); the password is never the key."""
    assert tier.remote is not None
    if tier.remote.mac_key_secret is None:
        raise RenderError(f"spec.tiers[{tier.name}].remote.macKeySecret: {REMOTE_KEY_RULE}")
    base = f"{REMOTE_SECRETS_DIR}/{tier.name}"
    password = f"{base}/{REMOTE_PASSWORD_FILE}" if tier.remote.password_secret is not None else None
    return password, f"{base}/{REMOTE_MAC_KEY_FILE}", f"{base}/{REMOTE_PREVIOUS_MAC_KEY_FILE}"


def remote_scope(policy_metadata: dict[str, Any]) -> str:
    """The tenant scope of a policy's remote tiers: its namespace (``default`` where the document names none, as
    kubectl would create it)."""
    scope = policy_metadata.get("namespace") or "default"
    try:
        check_remote_scope("metadata.namespace", scope)
    except ConfigError as err:
        raise RenderError(str(err)) from None
    return scope


def remote_ca_file(tier: api.TierSpec) -> Optional[str]:
    """Path of the remote tier's CA bundle in the container (rediss:// to a store with a private CA), or None."""
    assert tier.remote is not None
    if tier.remote.ca_secret is None:
        return None
    return f"{REMOTE_SECRETS_DIR}/{tier.name}/{REMOTE_CA_FILE}"


def remote_secret_volume(tier: api.TierSpec) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
    """The read-only volume holding a remote tier's password, MAC key and CA files, or None without any. A projected
    volume: the keys may live in different Secrets, only the named keys are projected, and a rotated Secret
    reaches the pod without a restart (a subPath mount would freeze it)."""
    assert tier.remote is not None
    sources: list[dict[str, Any]] = []
    for ref, file in ((tier.remote.password_secret, REMOTE_PASSWORD_FILE), (tier.remote.mac_key_secret, REMOTE_MAC_KEY_FILE),
                      (tier.remote.ca_secret, REMOTE_CA_FILE)):
        if ref is None:
            continue
        sources.append({"secret": {"name": ref.name, "items": [{"key": ref.key, "path": file}]}})
        if isinstance(ref, api.TenantKeyRef):
            # optional: the kubelet skips the item while the Secret lacks the key, and adds or removes the file in
            # place when the key comes and goes, so the runtime sees a rotation without a restart.
            sources.append({"secret": {"name": ref.name, "optional": True,
                                       "items": [{"key": ref.previous, "path": REMOTE_PREVIOUS_MAC_KEY_FILE}]}})
    if not sources:
        return None
    # Its own prefix: a filesystem tier named "<this tier>-secrets" must not get the same volume name.
    name = tier_volume_name(tier.name, prefix="kvtier-remote-")
    return ({"name": name, "projected": {"sources": sources, "defaultMode": 0o440}},
            {"name": name, "mountPath": f"{REMOTE_SECRETS_DIR}/{tier.name}", "readOnly": True})


def shm_volume(size_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": str(size_bytes)}},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    )


def host_memory(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], *,
                cpu_tier_in_shm: bool) -> Optional[HostMemory]:
    """What the cpu tier costs the container, or None without a cpu tier."""
    cpu = next((t for t in tiers if t.medium == "cpu"), None)
    if cpu is None:
        return None
    increase = cpu.size_bytes + spec.host_memory_headroom_bytes
    return HostMemory(cpu.size_bytes, increase, increase if cpu_tier_in_shm else None)


def workload_storage(spec: api.KVCachePolicySpec, tiers: list[api.TierSpec], config_map_name: str, *,
                     cpu_tier_in_shm: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Optional[HostMemory]]:
    """Volumes, mounts and resource changes every engine needs: the config, the tiers' volumes, host memory.

    ``cpu_tier_in_shm``: the engine keeps its cpu tier in /dev/shm (vLLM's mmap), whose tmpfs pages count
    against the container's memory limit; otherwise (TensorRT-LLM's pinned host cache) only the limit grows.
    """
    volume, mount = config_volume(config_map_name)
    volumes, mounts = [volume], [mount]
    memory = host_memory(spec, tiers, cpu_tier_in_shm=cpu_tier_in_shm)
    if memory is not None and memory.shm_size_limit_bytes is not None:
        shm, shm_mount = shm_volume(memory.shm_size_limit_bytes)
        volumes.append(shm)
        mounts.append(shm_mount)
    for tier in tiers:
        if tier.medium == "filesystem":
            volume, mount = tier_volume(tier)
            if any(m["mountPath"] == mount["mountPath"] for m in mounts):
                # Two mounts at one path: the API server would refuse the workload on every retry.
                raise RenderError(f"spec.tiers[{tier.name}].path: {mount['mountPath']!r} is already a mount point; "
                                  "filesystem tiers need distinct paths")
            volumes.append(volume)
            mounts.append(mount)
        elif tier.medium == "remote":
            secret = remote_secret_volume(tier)
            if secret is not None:
                volumes.append(secret[0])
                mounts.append(secret[1])
    return volumes, mounts, memory
