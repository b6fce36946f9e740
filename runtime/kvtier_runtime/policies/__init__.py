"""Eviction and admission policies of kvtier's tiers (pure Python, torch-free).

``get_policy("s3fifo", capacity_bytes, admission="doorkeeper")`` builds one; ``POLICIES`` and ``ADMISSIONS``
name them all. Names match :mod:`kvtier_runtime.config` (``EVICTION_POLICIES``, ``ADMISSION_POLICIES``).
"""
from __future__ import annotations

from collections.abc import Callable

from ..config import DEFAULT_ADMISSION_THRESHOLD
from .adaptive import AdaptivePolicy
from .admission import DoorkeeperAdmission, ThresholdAdmission
from .arc import ARCPolicy
from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key, PinnedEntryError
from .lru import LRUPolicy
from .prefix2q import Prefix2QPolicy
from .s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
    Prefix2QPolicy.name: Prefix2QPolicy,
    AdaptivePolicy.name: AdaptivePolicy,
}

# "none" means no filter: every offer is admitted.
ADMISSIONS: dict[str, Callable[[], AdmissionFilter] | None] = {
    "none": None,
    DoorkeeperAdmission.name: DoorkeeperAdmission,
    ThresholdAdmission.name: ThresholdAdmission,
}


def get_admission(name: str | AdmissionFilter | None, threshold: int | None = None) -> AdmissionFilter | None:
    """An admission filter by name (``None``/``"none"`` for no filter); an instance is returned as is.

    ``threshold``: the offer on which ``threshold`` admission stores a block (its default when None). Every
    configured value must reach the filter: a configured threshold silently replaced by the default was a bug.
    """
    if name is None or isinstance(name, AdmissionFilter):
        return name
    if name not in ADMISSIONS:
        raise ValueError(f"admission: {name!r} is not one of {', '.join(ADMISSIONS)}")
    factory = ADMISSIONS[name]
    if factory is None:
        return None
    if name == ThresholdAdmission.name:
        return ThresholdAdmission(DEFAULT_ADMISSION_THRESHOLD if threshold is None else threshold)
    return factory()


def get_policy(
    name: str, capacity_bytes: int, admission: str | AdmissionFilter | None = None,
    admission_threshold: int | None = None,
) -> EvictionPolicy:
    """A fresh policy by name with an optional admission filter (name or instance)."""
    if name not in POLICIES:
        raise ValueError(f"eviction policy: {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name](capacity_bytes, admission=get_admission(admission, admission_threshold))


__all__ = [
    "ADMISSIONS",
    "AdaptivePolicy",
    "POLICIES",
    "ARCPolicy",
    "AccessContext",
    "AdmissionFilter",
    "DoorkeeperAdmission",
    "EvictionPolicy",
    "Key",
    "LRUPolicy",
    "PinnedEntryError",
    "Prefix2QPolicy",
    "S3FIFOPolicy",
    "ThresholdAdmission",
    "get_admission",
    "get_policy",
]
