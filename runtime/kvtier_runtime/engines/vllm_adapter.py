"""The module path vLLM loads kvtier's plug-ins from (``spec_module_path``, ``cache_policy_module_path``,
``module_path`` of a secondary tier): rendered configs and users' configs name it
(``kvtier_runtime.config.VLLM_ADAPTER_MODULE``), so it stays. The plug-ins live in :mod:`kvtier_runtime.engines.vllm`,
one module each; this module re-exports them (it imports vllm through them).
"""
from __future__ import annotations

from .vllm import cache_policy as _cache_policy
from .vllm.cache_policy import CACHE_POLICY_CLASSES, KvtierCachePolicy
from .vllm.offloading import (
    RESET_FENCE_GRACE_S,
    KvtierHostSpec,
    KvtierOffloadingManager,
    KvtierOffloadingSpec,
    KvtierOffloadingWorker,
)
from .vllm.secondary_tier import (
    KvtierFilesystemTier,
    run_identity,
)
from .vllm_support import POLICY_REFUSALS

# CachePolicyFactory resolves ``getattr(import_module(cache_policy_module_path), eviction_policy)``.
globals().update(CACHE_POLICY_CLASSES)


def __getattr__(name: str) -> type[KvtierCachePolicy]:
    """Classes whose name carries a threshold (``KvtierLRUThreshold5CachePolicy``), made on first use (once: both
    modules then hold the same class)."""
    cls = getattr(_cache_policy, name)  # AttributeError naming the module for a name that is no policy class
    globals()[name] = cls
    return cls


__all__ = [
    "KvtierOffloadingSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingWorker",
    "KvtierHostSpec",
    "CACHE_POLICY_CLASSES",
    "KvtierCachePolicy",
    "KvtierFilesystemTier",
    "POLICY_REFUSALS",
    "RESET_FENCE_GRACE_S",
    "run_identity",
    *CACHE_POLICY_CLASSES,
]
