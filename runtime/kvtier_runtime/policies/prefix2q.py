"""Prefix-aware two-class LRU with a ghost history ("prefix2q").

Measured on the shared Mooncake-style trace (docs/performance-policies.md), the signal that separates reused KV
blocks from one-offs is simply *having been seen before*: a block on its first access is reused 42% of the time,
on its second 84%. So entries live in two classes ordered by recency:

* class 1 -- blocks seen for the first time (not in the ghost history): evicted first, always;
* class 2 -- blocks hit while cached, or inserted again while the history still remembered them.

The history is a FIFO of recently accessed keys bounded to ``history_factor`` x the capacity in bytes (KV reuse
distances on real traces are several cache sizes long, so S3-FIFO's ghost of one main-queue size forgets them).

Within a class, order is by request then position: with an :class:`AccessContext` the entries of older
requests go first and, inside one request, its tail before its head -- a block is only reusable if all blocks
before it are cached, so losing a head block wastes the whole rest of that prefix. Without a context, access
order is used.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable

from .base import AccessContext, EvictionPolicy, Key
from .ghost import GhostList


class Prefix2QPolicy(EvictionPolicy):
    name = "prefix2q"
    uses_context = True
    history_factor = 4

    def __init__(self, capacity_bytes: int, admission=None) -> None:
        super().__init__(capacity_bytes, admission)
        self._prio: dict[Key, tuple[int, int, int]] = {}  # current (class, request sequence, -position)
        self._heap: list[tuple[tuple[int, int, int], int, Key]] = []  # lazily deleted: stale if prio differs
        self._history = GhostList(self.history_factor * capacity_bytes)
        self._clock = 0
        self._request: Hashable = None
        self._request_seq = 0
        self._tiebreak = 0

    def _rank(self, key: Key, cls: int, ctx: AccessContext | None) -> tuple[int, int, int]:
        self._clock += 1
        if ctx is None or ctx.request_id is None:
            return (cls, self._clock, 0)
        if ctx.request_id != self._request:
            self._request = ctx.request_id
            self._request_seq = self._clock
        return (cls, self._request_seq, -ctx.position)

    def _push(self, key: Key, prio: tuple[int, int, int]) -> None:
        self._prio[key] = prio
        self._tiebreak += 1
        heapq.heappush(self._heap, (prio, self._tiebreak, key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # compact: drop stale entries
            self._heap = [e for e in self._heap if self._prio.get(e[2]) == e[0]]
            heapq.heapify(self._heap)

    def _remember(self, key: Key, size: int) -> bool:
        """Record an access in the history; whether the key was remembered already."""
        seen = key in self._history
        self._history.add(key, size)
        return seen

    def peek_victim(self) -> Key | None:
        for prio, _, key in sorted(self._heap):
            if self._prio.get(key) == prio and key not in self._pins:
                return key
        return None

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        cls = 2 if self._remember(key, size) else 1
        self._push(key, self._rank(key, cls, ctx))

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        self._remember(key, self._sizes[key])
        self._push(key, self._rank(key, 2, ctx))

    def _order_remove(self, key: Key) -> None:
        del self._prio[key]  # its heap entries are now stale

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        heap, prio = self._heap, self._prio
        skipped = []
        try:
            while heap:
                entry = heapq.heappop(heap)
                key = entry[2]
                if prio.get(key) != entry[0]:
                    continue  # stale
                if blocked(key):
                    skipped.append(entry)
                    continue
                del prio[key]
                return key
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _order_clear(self) -> None:
        self._prio.clear()
        self._heap.clear()
        self._history.clear()
        self._clock = 0
        self._request = None
        self._request_seq = 0
        self._tiebreak = 0
