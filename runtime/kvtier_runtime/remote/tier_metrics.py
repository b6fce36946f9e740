"""The metrics one remote tier exports (``kvtier_runtime_*``, defined in :mod:`kvtier_runtime.metrics`), behind named
methods. What every tier counts alike (capacity, occupancy, evictions, lookups, promotions and demotions) is in
:class:`kvtier_runtime.tiers.metrics.TierMetrics`; a remote tier adds its misses and failed stores by reason and
whether its store is up."""
from __future__ import annotations

import threading
from collections import Counter

from .. import metrics
from ..tiers.metrics import TierMetrics

__all__ = ["RemoteMetrics"]


class RemoteMetrics(TierMetrics):
    """What one remote tier counts, in :mod:`kvtier_runtime.metrics` (labelled by the tier's name), and the same
    counts kept here for the engine's own stats (vLLM exports those from its API server)."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.misses: Counter[str] = Counter()
        self.store_failures: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._up = metrics.REMOTE_UP.labels(name)
        self._up.set(0)
        self._refused = metrics.REMOTE_REFUSED.labels(name)
        self._refused.set(0)

    def miss(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.misses[reason] += n
        metrics.REMOTE_MISSES.labels(self.name, reason).inc(n)

    def store_failed(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.store_failures[reason] += n
        metrics.REMOTE_STORE_FAILURES.labels(self.name, reason).inc(n)

    # The job queue counts a job's late keys through error(); a late key is a miss (load) or a failed store.
    def error(self, kind: str, n: int = 1) -> None:
        self.miss(kind, n)

    def previous_key_read(self) -> None:
        metrics.REMOTE_PREVIOUS_KEY_READS.labels(self.name).inc()

    def key_reload(self) -> None:
        metrics.REMOTE_KEY_RELOADS.labels(self.name).inc()

    def up(self, on: bool) -> None:
        self._up.set(1 if on else 0)

    def refused(self, on: bool) -> None:
        self._refused.set(1 if on else 0)
