"""The tiered KV block store (device -> host -> filesystem). Imports torch; kept out of the package root."""
from __future__ import annotations

from .cost import CostModel
from .memory_tier import MemoryTier
from .tiered import LoadResult, PutResult, TieredStore

__all__ = ["CostModel", "LoadResult", "MemoryTier", "PutResult", "TieredStore"]
