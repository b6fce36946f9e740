"""LRU's prefix hit count at EVERY capacity from one pass, and its inverse: capacity equivalence.

LRU is a stack algorithm: an access hits in an LRU cache of C blocks exactly when its reuse distance (distinct
blocks touched since its previous access) is < C. A request's leading run is at least j long exactly when the
largest distance among its first j accesses is < C, so the prefix hit count at C is the number of those running
maxima below C. Sorting them once answers "what does LRU reach at C" and "what LRU capacity reaches this ratio"
(a policy "worth 1.25x the memory") by bisection.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

_FIRST = float("inf")  # a block's first access misses at any capacity


def reuse_distances(keys: Sequence[int]) -> list[int]:
    """LRU stack distance of every re-access: distinct other blocks touched since the previous access.

    A block is a hit in an LRU cache of C blocks exactly when its distance is < C. O(N log N) with a Fenwick
    tree over access positions holding 1 at each block's latest access.
    """
    n = len(keys)
    tree = [0] * (n + 1)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum over positions [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    out: list[int] = []
    for i, k in enumerate(keys):
        j = last.get(k)
        if j is not None:
            out.append(prefix(i) - prefix(j + 1))
            add(j, -1)
        add(i, 1)
        last[k] = i
    return out


class LRUCurve:
    def __init__(self, keys: Sequence[int], lengths: Sequence[int]) -> None:
        dist = iter(reuse_distances(keys))
        seen: set[int] = set()
        maxima: list[float] = []
        pos = 0
        for n in lengths:
            running = -1.0
            for k in keys[pos:pos + n]:
                d: float
                if k in seen:
                    d = next(dist)
                else:
                    seen.add(k)
                    d = _FIRST
                running = max(running, d)
                if running != _FIRST:  # past a first access, the leading run has ended at any capacity
                    maxima.append(running)
            pos += n
        self._maxima = sorted(maxima)
        self.n_accesses = len(keys)
        self.n_distinct = len(seen)

    def prefix_hits(self, capacity: int) -> int:
        """LRU's prefix hit count with ``capacity`` blocks."""
        return bisect.bisect_left(self._maxima, capacity)

    def prefix_hit_ratio(self, capacity: int) -> float:
        return self.prefix_hits(capacity) / self.n_accesses if self.n_accesses else 0.0

    def capacity_for(self, prefix_hits: int) -> int:
        """The smallest LRU capacity (blocks) with at least ``prefix_hits`` prefix hits (the ``prefix_hits``-th
        smallest running maximum, plus one); the distinct-block count if no capacity reaches it."""
        if prefix_hits <= 0:
            return 0
        if prefix_hits > len(self._maxima):
            return self.n_distinct
        return int(self._maxima[prefix_hits - 1]) + 1


def equivalence(curve: LRUCurve, capacity: int, prefix_hits: int) -> dict[str, Any]:
    """The LRU capacity matching a policy's ``prefix_hits`` at ``capacity``, and the memory factor it is worth."""
    lru_cap = curve.capacity_for(prefix_hits)
    return {"lru_equivalent_capacity_blocks": lru_cap,
            "memory_factor_vs_lru": lru_cap / capacity if capacity else None}
