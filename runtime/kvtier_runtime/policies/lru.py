"""Least recently used: evict the entry whose last access is oldest."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .base import AccessContext, EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_bytes: int, admission=None) -> None:
        super().__init__(capacity_bytes, admission)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def peek_victim(self) -> Key | None:
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
        self._order.move_to_end(key)
        return True

    def insert(self, key: Key, size: int, ctx: AccessContext | None = None) -> list[Key] | None:
        # Hot path of trace replay: with nothing pinned, LRU's victims are simply the oldest entries, so the
        # base class's general path (blocked-key checks, hooks) is skipped. Same result, fewer calls.
        sizes = self._sizes
        if self._pins or key in sizes or type(size) is not int or size <= 0 or size > self.capacity_bytes:
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

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        self._order[key] = None

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        self._order.move_to_end(key)

    def _order_remove(self, key: Key) -> None:
        del self._order[key]

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        order = self._order
        for key in order:
            if not blocked(key):
                del order[key]
                return key
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _order_clear(self) -> None:
        self._order.clear()
