"""Hit ratios from per-access hit flags, and what each one counts.

block hit ratio  = hits / block accesses
prefix hit ratio = (sum over requests of the length of the request's leading run of hits) / block accesses
(only a contiguous prefix of a request's KV can be reused, so a hit after the first miss saves nothing).
"""
from __future__ import annotations

from collections.abc import Sequence


def prefix_hit_count(hits: Sequence[bool], lengths: Sequence[int]) -> int:
    """Sum over requests (consecutive slices of ``hits`` of the given lengths) of the leading run of hits."""
    total = 0
    start = 0
    for n in lengths:
        run = 0
        for j in range(start, start + n):
            if not hits[j]:
                break
            run += 1
        total += run
        start += n
    return total


def flatten(requests: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """All accesses in order, and the number of blocks of each request."""
    keys: list[int] = []
    for r in requests:
        keys.extend(r)
    return keys, [len(r) for r in requests]
