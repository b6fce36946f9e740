"""The metrics one filesystem tier exports (``kvtier_runtime_*``, defined in :mod:`kvtier_runtime.metrics`), behind
named methods, so the tier's other modules say what happened and this one says how it is counted. What every tier
counts alike (capacity, occupancy, evictions, lookups, promotions and demotions) is in
:class:`kvtier_runtime.tiers.metrics.TierMetrics`.

Labels: ``tier`` is the tier's name; promotions and demotions are labelled with the tier blocks come from or go
to (``peer``: the host tier's name), passed per call since the books set it after construction."""
from __future__ import annotations

from .. import metrics
from ..tiers.metrics import TierMetrics


class FilesystemMetrics(TierMetrics):
    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self._backoff = metrics.FS_BACKOFF.labels(name)
        self._backoff.set(0)
        self._backoff_on = False

    def error(self, kind: str, n: int = 1) -> None:
        """A fault of ``kind`` (enospc, eio, corrupt, truncated, mismatch, missing, timeout, unlink, ...)."""
        metrics.FS_ERRORS.labels(self.name, kind).inc(n)

    def backoff(self, on: bool) -> None:
        # Told after every block written: the gauge is set only when it changes.
        if on != self._backoff_on:
            self._backoff_on = on
            self._backoff.set(1 if on else 0)

    def rejected(self, reason: str) -> None:
        """A store refused before any I/O (backoff, not-admitted, no-room, busy, mismatch, ...)."""
        metrics.STORES_REJECTED.labels(self.name, reason).inc()
