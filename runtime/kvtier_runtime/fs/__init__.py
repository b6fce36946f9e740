"""kvtier's durable, bounded filesystem tier (block files with checksummed headers, O_DIRECT where supported).

Importing this package imports torch (through the tier); the format and path helpers alone do not need it:
``kvtier_runtime.fs.format`` and ``kvtier_runtime.fs.paths`` are pure.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tier import FilesystemTier, JobResult, KeyState, LookupRun

__all__ = ["FilesystemTier", "JobResult", "KeyState", "LookupRun"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import tier

        return getattr(tier, name)
    raise AttributeError(name)
