"""What the tiers behind the host tier share, whatever their medium: the :class:`~.base.Tier` protocol the books
drive (with :class:`~.base.EventPlace` and :class:`~.base.TierChanges`: how its KV events place it, what entered and
left it) and :class:`~.base.KeyState`
(:mod:`.base`), the job queue each tier owns, with deadlines and results handed
out once (:mod:`.jobs`), what every tier serves from it alike (:mod:`.queued`), exponential backoff (:mod:`.backoff`), key files (:mod:`.keys`), the CRC (:mod:`.checksum`),
the sealed-value envelope both formats share (:mod:`.envelope`), the metrics every tier counts alike (:mod:`.metrics`)
and the registry that builds a tier by medium (:mod:`.registry`).

The filesystem tier (:mod:`kvtier_runtime.fs`) and the remote tier (:mod:`kvtier_runtime.remote`) import from here
and never from each other. Importing this package imports no torch.
"""
from __future__ import annotations

from .base import EventPlace, KeyState, Tier, TierChanges

__all__ = ["EventPlace", "KeyState", "Tier", "TierChanges"]
