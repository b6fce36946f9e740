"""The block store of the engine path: :class:`OffloadBooks` (which chunk is where, in vLLM's scheduler process)
over a host :class:`MemoryTier` (slots in the shared host region) and zero or more
:class:`~kvtier_runtime.fs.tier.FilesystemTier` behind it. Imports torch; kept out of the package root."""
from __future__ import annotations

from .books import DISK, HIT, HIT_PENDING, HOST, MISS, RETRY, OffloadBooks, TierEvent
from .memory_tier import MemoryTier

__all__ = ["DISK", "HIT", "HIT_PENDING", "HOST", "MISS", "RETRY", "MemoryTier", "OffloadBooks", "TierEvent"]
