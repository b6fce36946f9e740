"""The metrics one filesystem tier exports (``kvtier_runtime_*``, defined in :mod:`kvtier_runtime.metrics`), behind
named methods, so the tier's other modules say what happened and this one says how it is counted.

Labels: ``tier`` is the tier's name; promotions and demotions are labelled with the tier blocks come from or go
to (``peer``: the host tier's name), passed per call since the books set it after construction."""
from __future__ import annotations

from .. import metrics


class TierMetrics:
    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        metrics.CAPACITY_BYTES.labels(name).set(capacity_bytes)
        self._backoff = metrics.FS_BACKOFF.labels(name)
        self._backoff.set(0)
        self._occupancy = metrics.OCCUPANCY_BYTES.labels(name)

    def error(self, kind: str, n: int = 1) -> None:
        """A fault of ``kind`` (enospc, eio, corrupt, truncated, mismatch, missing, timeout, unlink, ...)."""
        metrics.FS_ERRORS.labels(self.name, kind).inc(n)

    def backoff(self, on: bool) -> None:
        self._backoff.set(1 if on else 0)

    def rejected(self, reason: str) -> None:
        """A store refused before any I/O (backoff, not-admitted, no-room, busy, mismatch, ...)."""
        metrics.STORES_REJECTED.labels(self.name, reason).inc()

    def probed(self, hit: bool) -> None:
        """One key looked up for the engine (the books' lookup of a key the host tier missed)."""
        metrics.LOOKUPS.labels(self.name).inc()
        if hit:
            metrics.HITS.labels(self.name).inc()

    def looked_up(self, asked: int, hits: int) -> None:
        metrics.LOOKUPS.labels(self.name).inc(asked)
        metrics.HITS.labels(self.name).inc(hits)

    def evicted(self, n: int) -> None:
        metrics.EVICTIONS.labels(self.name).inc(n)

    def occupancy(self, nbytes: int) -> None:
        self._occupancy.set(nbytes)

    def written(self, peer: str, nbytes: int, seconds: float) -> None:
        """One block demoted from ``peer`` into this tier."""
        metrics.DEMOTIONS.labels(peer, self.name).inc()
        metrics.BYTES_MOVED.labels(peer, self.name).inc(nbytes)
        metrics.TRANSFER_SECONDS.labels(peer, self.name).observe(seconds)

    def read(self, peer: str, nbytes: int, seconds: float) -> None:
        """One block promoted from this tier into ``peer``."""
        metrics.PROMOTIONS.labels(self.name, peer).inc()
        metrics.BYTES_MOVED.labels(self.name, peer).inc(nbytes)
        metrics.TRANSFER_SECONDS.labels(self.name, peer).observe(seconds)
