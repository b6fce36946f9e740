"""Least recently used, with vLLM 0.33's request awareness: a running request's tail chunks go before its prefix.

Without request context (trace replay, ``ctx=None``) this is plain LRU: evict the entry whose last access is
oldest, kept in an ``OrderedDict`` (the fast path).

The first access that carries a request (``ctx.request_id`` not None) switches the policy to vLLM's ranking
(``vllm/v1/kv_offload/cpu/policies/lru.py``): every entry has a rank, the smallest is evicted first.

* An access without a request gets a fresh rank (it is the most recent).
* A request gets one rank when first seen; its chunks rank ``(request rank, -position)``, so within a request
  the tail (larger position) goes before the head, and a chunk only moves to a later rank, never back
  (``touch`` with a request context is vLLM's ``on_request_access``).
* When the request finishes, the caller touches its chunks tail to head without context (vLLM's
  ``on_request_finished``): the head becomes the most recent.

So the name ``lru`` means the same in ``backend: native`` (vLLM's policy) and ``backend: kvtier``.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeGuard

from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key

_MAX_TRACKED_REQUESTS = 65_536


class LRUPolicy(EvictionPolicy):
    name = "lru"
    # Callers with request context report each chunk a request reads or re-offers (touch with ctx) and, when
    # the request finishes, touch its chunks tail to head without context.
    request_aware = True

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        super().__init__(capacity_bytes, admission)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first (plain mode)
        # Ranked mode (after the first access with a request): rank per key, a lazy min-heap of (rank, seq, key).
        self._ranked = False
        self._rank: dict[Key, tuple[int, int]] = {}
        self._heap: list[tuple[tuple[int, int], int, Key]] = []
        self._seq = itertools.count()
        self._next_rank = 0
        self._request_rank: OrderedDict[Hashable, int] = OrderedDict()

    # ---- ranked mode ------------------------------------------------------------------------------------
    def _switch_to_ranks(self) -> None:
        self._ranked = True
        for key in self._order:
            self._next_rank += 1
            self._set_rank(key, (self._next_rank, 0))
        self._order.clear()

    def _set_rank(self, key: Key, rank: tuple[int, int]) -> None:
        self._rank[key] = rank
        heapq.heappush(self._heap, (rank, next(self._seq), key))
        if len(self._heap) > max(64, 4 * len(self._rank)):
            self._heap = [(r, next(self._seq), k) for k, r in self._rank.items()]
            heapq.heapify(self._heap)

    def _fresh_rank(self) -> tuple[int, int]:
        self._next_rank += 1
        return (self._next_rank, 0)

    def _rank_of_request(self, request_id: Hashable) -> int:
        rank = self._request_rank.get(request_id)
        if rank is None:
            self._next_rank += 1
            rank = self._request_rank[request_id] = self._next_rank
            if len(self._request_rank) > _MAX_TRACKED_REQUESTS:
                self._request_rank.popitem(last=False)
        return rank

    def _request_position_rank(self, ctx: AccessContext) -> tuple[int, int]:
        return (self._rank_of_request(ctx.request_id), -int(ctx.position))

    @staticmethod
    def _has_request(ctx: AccessContext | None) -> TypeGuard[AccessContext]:
        return ctx is not None and ctx.request_id is not None

    def forget_request(self, request_id: Hashable) -> None:
        """The request finished: its rank is not needed any more (its chunks keep theirs)."""
        self._request_rank.pop(request_id, None)

    def forget_requests(self) -> None:
        """A cache reset: a request that goes on afterwards is ranked as new (vLLM's cache generation)."""
        self._request_rank.clear()

    # ---- public -----------------------------------------------------------------------------------------
    def peek_victim(self) -> Key | None:
        if self._ranked:
            best = None
            for entry in self._heap:
                rank, seq, key = entry
                if self._rank.get(key) == rank and key not in self._pins and (best is None or (rank, seq) < best[:2]):
                    best = (rank, seq, key)
            return None if best is None else best[2]
        for key in self._order:
            if key not in self._pins:
                return key
        return None

    def touch(self, key: Key, ctx: AccessContext | None = None) -> bool:
        # Hot path of trace replay: one dict probe and one move, no hook call.
        if key not in self._sizes:
            return False
        if self.admission is not None:
            self.admission.record_access(key)
        if not self._ranked:
            if not self._has_request(ctx):
                self._order.move_to_end(key)
                return True
            self._switch_to_ranks()
        self._order_touch(key, ctx)
        return True

    def insert(self, key: Key, size: int, ctx: AccessContext | None = None) -> list[Key] | None:
        # Hot path of trace replay: with nothing pinned, LRU's victims are simply the oldest entries, so the
        # base class's general path (blocked-key checks, hooks) is skipped. Same result, fewer calls.
        sizes = self._sizes
        if self._ranked or self._has_request(ctx) or self._pins or key in sizes or type(size) is not int \
                or size <= 0 or size > self.capacity_bytes:
            return super().insert(key, size, ctx)
        need = self._used + size - self.capacity_bytes
        evicted: list[Key] = []
        if need > 0:
            popitem = self._order.popitem
            freed = 0
            while freed < need:
                victim = popitem(last=False)[0]
                freed += sizes.pop(victim)
                evicted.append(victim)
            self._used -= freed
        sizes[key] = size
        self._used += size
        self._order[key] = None
        return evicted

    # ---- hooks ------------------------------------------------------------------------------------------
    def _prepare_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        if not self._ranked and self._has_request(ctx):
            self._switch_to_ranks()

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        if not self._ranked:
            self._order[key] = None
            return
        self._set_rank(key, self._request_position_rank(ctx) if self._has_request(ctx) else self._fresh_rank())

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        if not self._ranked:
            self._order.move_to_end(key)
            return
        if self._has_request(ctx):  # vLLM's on_request_access: only ever later, never back
            rank = self._request_position_rank(ctx)
            if self._rank[key] >= rank:
                return
        else:
            rank = self._fresh_rank()
        self._set_rank(key, rank)

    def _order_remove(self, key: Key) -> None:
        if self._ranked:
            del self._rank[key]
        else:
            del self._order[key]

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        if not self._ranked:
            order = self._order
            for key in order:
                if not blocked(key):
                    del order[key]
                    return key
            raise AssertionError("no evictable entry although the base class counted enough evictable bytes")
        heap, ranks = self._heap, self._rank
        deferred = []
        try:
            while heap:
                entry = heapq.heappop(heap)
                rank, _, key = entry
                if ranks.get(key) != rank:
                    continue  # stale: the key was re-ranked or removed
                if blocked(key):
                    deferred.append(entry)
                    continue
                del ranks[key]
                return key
        finally:
            for entry in deferred:
                heapq.heappush(heap, entry)
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _order_clear(self) -> None:
        self._order.clear()
        self._rank.clear()
        self._heap.clear()
        self._request_rank.clear()
        self._ranked = False
        self._next_rank = 0
