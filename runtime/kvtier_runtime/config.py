"""The one contract shared by the operator and the runtime (torch-free, kopf-free).

The operator renders engine configuration that names the runtime's plug-ins; the runtime parses the keyword
arguments the engine passes back. Both sides import the names and the parser from here, so a renamed class or
key breaks a test instead of a deployment.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

# Names of the runtime's policies and codecs as a KVCachePolicy spells them.
EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc", "s3fifo", "prefix2q")
ADMISSION_POLICIES: tuple[str, ...] = ("none", "doorkeeper", "threshold")
CODECS: tuple[str, ...] = ("none", "fp8", "fp8_e5m2", "int8", "int4")
# The one default of a tier's eviction policy, on both sides (API ``evictionPolicy``, runtime configs): lru, the
# one every backend supports (native takes lru or arc, lmcache lru only).
DEFAULT_EVICTION_POLICY = "lru"
# What the replay tools try when no policy is named: prefix2q measured best on the shared Mooncake-style trace
# (docs/performance.md). A recommendation, not a default: it needs backend kvtier.
RECOMMENDED_EVICTION_POLICY = "prefix2q"
# With admission "threshold": a block is stored on its Nth offer unless spec.offload.storeThreshold says otherwise.
DEFAULT_ADMISSION_THRESHOLD = 2

# vLLM loads out-of-tree pieces by class name + module path (CachePolicyFactory, SecondaryTierFactory).
# All vLLM imports live in this one adapter module.
VLLM_ADAPTER_MODULE = "kvtier_runtime.engines.vllm_adapter"
VLLM_SECONDARY_TIER_CLASS = "KvtierFilesystemTier"


_STEMS = {"lru": "LRU", "arc": "ARC", "s3fifo": "S3FIFO", "prefix2q": "Prefix2Q"}
_CACHE_POLICY_CLASS = re.compile(
    r"^Kvtier(?P<stem>%s)(?P<admission>%s)?(?P<threshold>[1-9][0-9]{0,5})?CachePolicy$" % (
        "|".join(sorted(_STEMS.values(), key=len, reverse=True)),
        "|".join(a.capitalize() for a in ADMISSION_POLICIES if a != "none")))


@dataclass(frozen=True)
class CachePolicyChoice:
    """What a vLLM ``CachePolicy`` class name carries: eviction, admission and the admission threshold.

    vLLM builds the CPU tier's policy as ``cls(cache_capacity)``: the class name is the only channel from the
    rendered config to the policy object, so a threshold other than the default is part of the name
    (``KvtierLRUThreshold5CachePolicy``); the default keeps the short name (``KvtierLRUThresholdCachePolicy``).
    """

    eviction: str = DEFAULT_EVICTION_POLICY
    admission: str = "none"
    admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD

    def __post_init__(self) -> None:
        _one_of("evictionPolicy", self.eviction, EVICTION_POLICIES)
        _one_of("admission", self.admission, ADMISSION_POLICIES)
        _positive_int("admission_threshold", self.admission_threshold)

    @property
    def class_name(self) -> str:
        suffix = "" if self.admission == "none" else self.admission.capitalize()
        if self.admission == "threshold" and self.admission_threshold != DEFAULT_ADMISSION_THRESHOLD:
            suffix += str(self.admission_threshold)
        return f"Kvtier{_STEMS[self.eviction]}{suffix}CachePolicy"

    @classmethod
    def from_class_name(cls, name: str) -> "CachePolicyChoice":
        match = _CACHE_POLICY_CLASS.match(name)
        if not match:
            raise ConfigError(f"eviction_policy: {name!r} is not a kvtier CachePolicy class "
                              "(Kvtier<Eviction>[<Admission>[<threshold>]]CachePolicy)")
        eviction = next(k for k, v in _STEMS.items() if v == match["stem"])
        admission = (match["admission"] or "none").lower()
        if match["threshold"] and admission != "threshold":
            raise ConfigError(f"eviction_policy: {name!r}: only threshold admission takes a number")
        threshold = int(match["threshold"]) if match["threshold"] else DEFAULT_ADMISSION_THRESHOLD
        return cls(eviction, admission, threshold)


def vllm_cache_policy_class(eviction: str, admission: str = "none",
                            admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD) -> str:
    """Class name of the vLLM ``CachePolicy`` for an eviction/admission pair, e.g. ``KvtierS3FIFOCachePolicy``."""
    return CachePolicyChoice(eviction, admission, admission_threshold).class_name


class ConfigError(ValueError):
    """A runtime configuration value broke a rule; the message names the key and the rule."""


@dataclass(frozen=True)
class FilesystemTierConfig:
    """Keyword arguments of kvtier's filesystem tier, as rendered into a vLLM ``secondary_tiers`` entry."""

    root_dir: str
    capacity_bytes: int
    codec: str = "none"
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    admission: str = "none"
    # With admission "threshold": a block is stored on its Nth offer.
    admission_threshold: int = DEFAULT_ADMISSION_THRESHOLD
    n_read_threads: int = 16
    n_write_threads: int = 16
    # Blocks whose measured codec error exceeds the codec's budget are stored with a wider codec.
    codec_fallback: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.root_dir, str) or not self.root_dir.startswith("/"):
            raise ConfigError(f"root_dir: {self.root_dir!r} must be an absolute path")
        _positive_int("capacity_bytes", self.capacity_bytes)
        _positive_int("admission_threshold", self.admission_threshold)
        _positive_int("n_read_threads", self.n_read_threads)
        _positive_int("n_write_threads", self.n_write_threads)
        _one_of("codec", self.codec, CODECS)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("admission", self.admission, ADMISSION_POLICIES)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "FilesystemTierConfig":
        """Parse the tier dict's keys; keys this version does not know are kept in ``extra``, not lost."""
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("root_dir", "capacity_bytes") if k not in kwargs]
        if missing:
            raise ConfigError(f"{missing[0]}: required")
        return cls(
            **{k: v for k, v in kwargs.items() if k in known},
            extra={k: v for k, v in kwargs.items() if k not in known},
        )

    def to_kwargs(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: {value!r} must be a positive integer")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
