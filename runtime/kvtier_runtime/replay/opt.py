"""Belady's OPT/MIN with demand insertion: on a miss the block is inserted and, when full, the cached block whose
next use lies farthest in the future is evicted. This maximises block hits for a given capacity (in blocks) and
is the bound kvtier replay reports next to every online policy.

Next-use positions are computed in one backward pass; the cache is a max-heap keyed by next use with lazy
deletion, so the whole run is O(N log N).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

NEVER = 1 << 62  # next use of a block that is not accessed again


def next_uses(keys: Sequence[int]) -> list[int]:
    """For each position i, the next position j > i with keys[j] == keys[i], or NEVER."""
    out = [NEVER] * len(keys)
    last: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        out[i] = last.get(k, NEVER)
        last[k] = i
    return out


def opt_hits(keys: Sequence[int], capacity: int) -> list[bool]:
    """Hit (True) or miss of every access under OPT with ``capacity`` blocks."""
    if capacity <= 0:
        return [False] * len(keys)
    nxt = next_uses(keys)
    cached: dict[int, int] = {}  # key -> its next use (the heap entry that is current)
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped on pop
    hits = [False] * len(keys)
    push, pop = heapq.heappush, heapq.heappop
    for i, k in enumerate(keys):
        nu = nxt[i]
        if k in cached:
            hits[i] = True
        elif len(cached) >= capacity:
            while True:
                neg, victim = pop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[k] = nu
        push(heap, (-nu, k))
        if len(heap) > 4 * capacity + 64:  # drop stale entries so the heap stays O(capacity)
            heap = [(-v, key) for key, v in cached.items()]
            heapq.heapify(heap)
    return hits
