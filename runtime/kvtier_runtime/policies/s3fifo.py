"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with 2-bit clock, and a ghost FIFO.

New keys enter the small queue (10% of the bytes). A key leaving the small queue that was hit since insertion
moves to main; one that was not becomes a ghost and is evicted ("quick demotion": most blocks are never reused,
so they should leave after a short probation). A key that returns while it is a ghost goes straight to main.
Main is a FIFO-reinsertion clock: a key with a non-zero hit count is reinserted with the count decremented.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key
from .ghost import GhostList

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    small_fraction = 0.10

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        super().__init__(capacity_bytes, admission)
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._small_bytes = 0
        self._freq: dict[Key, int] = {}
        self._small_target = max(1, int(capacity_bytes * self.small_fraction))
        self._ghost = GhostList(capacity_bytes - self._small_target or 1)

    def peek_victim(self) -> Key | None:
        queues = (self._small, self._main) if self._small_bytes >= self._small_target or not self._main else (
            self._main, self._small)
        for q in queues:
            for key in q:
                if key not in self._pins and self._freq[key] == 0:
                    return key
        return None

    def touch(self, key: Key, ctx: AccessContext | None = None) -> bool:
        freq = self._freq.get(key)
        if freq is None:
            return False
        if self.admission is not None:
            self.admission.record_access(key)
        if freq < _MAX_FREQ:
            self._freq[key] = freq + 1
        return True

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        self._freq[key] = 0
        if self._ghost.discard(key):
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        self._freq[key] = min(_MAX_FREQ, self._freq[key] + 1)

    def _order_remove(self, key: Key) -> None:
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            self._small_bytes -= self._sizes[key]
        else:
            del self._main[key]

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        if self._small_bytes >= self._small_target or not self._main:
            victim = self._evict_small(blocked)
            if victim is not None:
                return victim
        victim = self._evict_main(blocked)
        if victim is not None:
            return victim
        victim = self._evict_small(blocked)
        if victim is not None:
            return victim
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _evict_small(self, blocked: Callable[[Key], bool]) -> Key | None:
        small, main, freq, sizes = self._small, self._main, self._freq, self._sizes
        for _ in range(len(small)):
            key, _none = small.popitem(last=False)
            if blocked(key):
                small[key] = None  # rotate: a pinned block keeps its place in probation
                continue
            size = sizes[key]
            self._small_bytes -= size
            if freq[key] > 0:
                freq[key] = 0
                main[key] = None
                continue
            del freq[key]
            self._ghost.add(key, size)
            return key
        return None

    def _evict_main(self, blocked: Callable[[Key], bool]) -> Key | None:
        main, freq = self._main, self._freq
        for _ in range((_MAX_FREQ + 1) * len(main)):
            key, _none = main.popitem(last=False)
            if blocked(key):
                main[key] = None
                continue
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
                main[key] = None
                continue
            del freq[key]
            return key
        return None

    def _order_clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._freq.clear()
        self._small_bytes = 0
        self._ghost.clear()
