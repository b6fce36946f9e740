"""A FIFO of recently evicted keys ("ghosts") bounded in bytes: remembers that a key was cached, not its data."""
from __future__ import annotations

from collections import OrderedDict

from .base import Key


class GhostList:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self.used_bytes = 0

    @property
    def entries(self) -> OrderedDict[Key, int]:
        """The ghosts and their sizes, oldest first: the list itself, for a loop that takes its steps in place (and
        keeps ``used_bytes`` their sum)."""
        return self._sizes

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, key: Key, size: int) -> None:
        old = self._sizes.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        sizes = self._sizes
        sizes[key] = size
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:  # trim(), inlined: add() runs once per miss
            self.used_bytes -= sizes.popitem(last=False)[1]

    def refresh(self, key: Key, size: int) -> None:
        """``add`` for the common case of a key already remembered with the same size: just make it the newest."""
        sizes = self._sizes
        if sizes.get(key) == size:
            sizes.move_to_end(key)
        else:
            self.add(key, size)

    def discard(self, key: Key) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def trim(self, limit_bytes: int) -> None:
        """Forget the oldest ghosts until at most ``limit_bytes`` remain."""
        sizes = self._sizes
        while self.used_bytes > limit_bytes and sizes:
            _, size = sizes.popitem(last=False)
            self.used_bytes -= size

    def clear(self) -> None:
        self._sizes.clear()
        self.used_bytes = 0
