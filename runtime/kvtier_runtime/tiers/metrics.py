"""What every tier behind the host tier counts the same way (``kvtier_runtime_*``, defined in
:mod:`kvtier_runtime.metrics`, labelled by the tier's name): its capacity and occupancy, its evictions, the engine's
lookups of it, and blocks moved to or from it. Each medium adds its own faults (the filesystem tier's errors and
backoff, the remote tier's misses by reason and up/down) in a subclass of :class:`TierMetrics`
(``fs/tier_metrics.py``, ``remote/tier_metrics.py``)."""
from __future__ import annotations

import threading
from typing import Any

from .. import metrics

__all__ = ["TierMetrics"]


class TierMetrics:
    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        metrics.CAPACITY_BYTES.labels(name).set(capacity_bytes)
        self._occupancy = metrics.OCCUPANCY_BYTES.labels(name)
        # Entries evicted so far, kept here for the engine's own stats (read from the tier, never back from the
        # process-wide registry). An int's += is not atomic across threads: guarded.
        self.evictions = 0
        self._evictions_lock = threading.Lock()
        self._children: dict[tuple[Any, str, str], tuple[Any, Any, Any]] = {}

    def occupancy(self, nbytes: int) -> None:
        self._occupancy.set(nbytes)

    def evicted(self, n: int) -> None:
        with self._evictions_lock:
            self.evictions += n
        metrics.EVICTIONS.labels(self.name).inc(n)

    def probed(self, hit: bool) -> None:
        """One key looked up for the engine (the books' lookup of a key the host tier missed)."""
        metrics.LOOKUPS.labels(self.name).inc()
        if hit:
            metrics.HITS.labels(self.name).inc()

    def looked_up(self, asked: int, hits: int) -> None:
        """``asked`` keys looked up for the engine in one run, ``hits`` of them found."""
        metrics.LOOKUPS.labels(self.name).inc(asked)
        metrics.HITS.labels(self.name).inc(hits)

    def promoted(self, peer: str, nbytes: int, seconds: float, n: int = 1) -> None:
        """``n`` blocks (``nbytes`` in all, in ``seconds``) copied from this tier into ``peer``."""
        self._moved(metrics.PROMOTIONS, self.name, peer, nbytes, seconds, n)

    def demoted(self, peer: str, nbytes: int, seconds: float, n: int = 1) -> None:
        """``n`` blocks (``nbytes`` in all, in ``seconds``) copied from ``peer`` into this tier."""
        self._moved(metrics.DEMOTIONS, peer, self.name, nbytes, seconds, n)

    def moved(self, src: str, dst: str, nbytes: int, seconds: float, n: int = 1) -> None:
        """``n`` blocks copied from ``src`` to ``dst``, one of which is this tier: a promotion out of it or a
        demotion into it."""
        if src == self.name:
            self.promoted(dst, nbytes, seconds, n)
        else:
            self.demoted(src, nbytes, seconds, n)

    def _moved(self, counter: Any, src: str, dst: str, nbytes: int, seconds: float, n: int) -> None:
        # A tier moves blocks between a handful of (src, dst) pairs, once per block: the labelled children are
        # looked up once per pair (a ``labels`` call costs more than the three updates together).
        children = self._children.get((counter, src, dst))
        if children is None:
            children = self._children[(counter, src, dst)] = (
                counter.labels(src, dst), metrics.BYTES_MOVED.labels(src, dst),
                metrics.TRANSFER_SECONDS.labels(src, dst))
        blocks, moved, seconds_hist = children
        blocks.inc(n)
        moved.inc(nbytes)
        seconds_hist.observe(seconds)
