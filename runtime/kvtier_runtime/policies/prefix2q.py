"""Prefix-aware two-class LRU with a ghost history ("prefix2q").

Measured on the shared Mooncake-style trace (docs/performance.md), the signal that separates reused KV
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

Implementation: one OrderedDict per class (oldest first). Every access moves the key to the end, so the current
request's keys sit at the end of their class in head-to-tail order; when the next request starts they are
re-ranked tail-first. An eviction that reaches the current request's keys takes them from the end (its tail).
All operations are O(1) amortised.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key
from .ghost import GhostList


class Prefix2QPolicy(EvictionPolicy):
    name = "prefix2q"
    uses_context = True
    history_factor = 4

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        super().__init__(capacity_bytes, admission)
        self._once: OrderedDict[Key, None] = OrderedDict()  # class 1, oldest first
        self._again: OrderedDict[Key, None] = OrderedDict()  # class 2, oldest first
        self._history = GhostList(self.history_factor * capacity_bytes)
        self._request: Hashable = None
        self._current: dict[Key, None] = {}  # keys accessed by the current request, in access order

    def _enter(self, key: Key, ctx: AccessContext | None) -> None:
        """Track request boundaries: at a new request, re-rank the previous one's keys tail-first."""
        if ctx is None or ctx.request_id is None:
            if self._current:
                self._flush()
            return
        if ctx.request_id != self._request:
            if self._current:
                self._flush()
            self._request = ctx.request_id
        self._current[key] = None

    def _flush(self) -> None:
        once, again = self._once, self._again
        for key in reversed(self._current):  # tail first ends up oldest
            if key in again:
                again.move_to_end(key)
            elif key in once:
                once.move_to_end(key)
        self._current = {}

    def peek_victim(self) -> Key | None:
        for order in (self._once, self._again):
            victim = self._find(order, self._pins.__contains__)
            if victim is not None:
                return victim
        return None

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        self._enter(key, ctx)
        seen = key in self._history
        self._history.add(key, size)
        (self._again if seen else self._once)[key] = None

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        self._enter(key, ctx)
        self._history.add(key, self._sizes[key])
        if key in self._once:
            del self._once[key]
            self._again[key] = None
        else:
            self._again.move_to_end(key)

    def _order_remove(self, key: Key) -> None:
        if key in self._once:
            del self._once[key]
        else:
            del self._again[key]
        self._current.pop(key, None)

    def _find(self, order: OrderedDict[Key, None], blocked: Callable[[Key], bool]) -> Key | None:
        current = self._current
        for key in order:
            if blocked(key):
                continue
            if key in current:
                # Only the current request's keys are left (they are the newest): take its tail first.
                for tail in reversed(order):
                    if not blocked(tail):
                        return tail
            return key
        return None

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        for order in (self._once, self._again):
            victim = self._find(order, blocked)
            if victim is not None:
                del order[victim]
                self._current.pop(victim, None)
                return victim
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _order_clear(self) -> None:
        self._once.clear()
        self._again.clear()
        self._history.clear()
        self._request = None
        self._current = {}
