"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), counted in bytes.

T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 are their ghosts. A hit in B1 means T1 was
too small, so the target size ``p`` of T1 grows; a hit in B2 shrinks it. Unlike vLLM's ``arc``, a key that comes
back from either ghost list goes to T2 (it has now been seen twice), as in the paper.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key
from .ghost import GhostList


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        super().__init__(capacity_bytes, admission)
        self._t1: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._t1_bytes = 0
        self._t2_bytes = 0
        self._b1 = GhostList(capacity_bytes)
        self._b2 = GhostList(capacity_bytes)
        self._p = 0.0  # target bytes of T1
        self._incoming_from_b2 = False

    def peek_victim(self) -> Key | None:
        first, second = (self._t1, self._t2) if self._prefer_t1() else (self._t2, self._t1)
        for lst in (first, second):
            for key in lst:
                if key not in self._pins:
                    return key
        return None

    def _prefer_t1(self) -> bool:
        if not self._t1:
            return False
        return self._t1_bytes > self._p or (self._incoming_from_b2 and self._t1_bytes >= self._p)

    def _prepare_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        b1, b2 = self._b1, self._b2
        self._incoming_from_b2 = False
        if key in b1:
            delta = max(b2.used_bytes / max(b1.used_bytes, 1), 1.0) * size
            self._p = min(float(self.capacity_bytes), self._p + delta)
        elif key in b2:
            delta = max(b1.used_bytes / max(b2.used_bytes, 1), 1.0) * size
            self._p = max(0.0, self._p - delta)
            self._incoming_from_b2 = True

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        if self._b1.discard(key) or self._b2.discard(key):
            self._t2[key] = size
            self._t2_bytes += size
        else:
            self._t1[key] = size
            self._t1_bytes += size
        self._incoming_from_b2 = False
        # Directory bounds of the paper: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        c = self.capacity_bytes
        self._b1.trim(max(0, c - self._t1_bytes))
        self._b2.trim(max(0, 2 * c - self._t1_bytes - self._t2_bytes - self._b1.used_bytes))

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        size = self._t1.pop(key, None)
        if size is not None:
            self._t1_bytes -= size
            self._t2[key] = size
            self._t2_bytes += size
        else:
            self._t2.move_to_end(key)

    def _order_remove(self, key: Key) -> None:
        size = self._t1.pop(key, None)
        if size is not None:
            self._t1_bytes -= size
        else:
            self._t2_bytes -= self._t2.pop(key)

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        order = ((self._t1, True), (self._t2, False)) if self._prefer_t1() else ((self._t2, False), (self._t1, True))
        for lst, is_t1 in order:
            for key in lst:
                if blocked(key):
                    continue
                size = lst.pop(key)
                if is_t1:
                    self._t1_bytes -= size
                    self._b1.add(key, size)
                else:
                    self._t2_bytes -= size
                    self._b2.add(key, size)
                return key
        raise AssertionError("no evictable entry although the base class counted enough evictable bytes")

    def _order_clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._t1_bytes = self._t2_bytes = 0
        self._b1.clear()
        self._b2.clear()
        self._p = 0.0
        self._incoming_from_b2 = False
