"""Admission filters: decide whether a missing block is worth storing before any eviction is spent on it.

Most KV blocks are never reused (one-off prompt tails), so storing them only pushes out blocks that would have
been hit. A filter wraps any eviction policy (``EvictionPolicy(capacity, admission=...)``).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar

from ..config import DEFAULT_ADMISSION_THRESHOLD
from .base import AccessContext, AdmissionFilter, Key

if TYPE_CHECKING:
    from .base import EvictionPolicy


def _hash64(key: Key, seed: int) -> int:
    """A process-independent 64-bit hash (Python's str/bytes hash is salted per process)."""
    if isinstance(key, int):
        x = (key * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
        x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return x ^ (x >> 29)
    data = key if isinstance(key, bytes) else repr(key).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, salt=seed.to_bytes(8, "little")).digest(), "little")


class BloomFilter:
    """A fixed-size Bloom filter over ``n_bits`` bits with ``n_hashes`` hash functions."""

    def __init__(self, n_bits: int, n_hashes: int = 3) -> None:
        self.n_bits = max(64, n_bits)
        self.n_hashes = n_hashes
        self._bits = bytearray((self.n_bits + 7) // 8)

    def _positions(self, key: Key) -> list[int]:
        h1 = _hash64(key, 1)
        h2 = _hash64(key, 2) | 1
        return [(h1 + i * h2) % self.n_bits for i in range(self.n_hashes)]

    def add(self, key: Key) -> bool:
        """Set the key's bits; whether it (probably) was present already."""
        present = True
        bits = self._bits
        for pos in self._positions(key):
            byte, bit = divmod(pos, 8)
            if not bits[byte] & (1 << bit):
                present = False
                bits[byte] |= 1 << bit
        return present

    def __contains__(self, key: Key) -> bool:
        bits = self._bits
        return all(bits[p >> 3] & (1 << (p & 7)) for p in self._positions(key))

    def clear(self) -> None:
        self._bits = bytearray(len(self._bits))


class DoorkeeperAdmission(AdmissionFilter):
    """TinyLFU's doorkeeper: admit a key on its second offer within a window; memory is one Bloom filter.

    The filter is reset every ``window`` offers, so a key must come back within roughly ``window`` misses to be
    stored. ``window`` defaults to 4x the number of entries the policy holds, measured when first used.
    """

    name: ClassVar[str] = "doorkeeper"

    def __init__(self, window: int | None = None, bits_per_key: int = 10) -> None:
        self.window = window
        self.bits_per_key = bits_per_key
        self._bloom: BloomFilter | None = None
        self._offers = 0

    def _ensure(self, policy: EvictionPolicy, size: int) -> BloomFilter:
        if self._bloom is None:
            if self.window is None:
                self.window = max(64, 4 * policy.capacity_bytes // size)
            self._bloom = BloomFilter(self.window * self.bits_per_key)
        return self._bloom

    def admit(self, key: Key, size: int, policy: EvictionPolicy, ctx: AccessContext | None = None) -> bool:
        bloom = self._ensure(policy, size)
        self._offers += 1
        if self._offers > self.window:  # type: ignore[operator]
            bloom.clear()
            self._offers = 1
        return bloom.add(key)

    def clear(self) -> None:
        if self._bloom is not None:
            self._bloom.clear()
        self._offers = 0


class ThresholdAdmission(AdmissionFilter):
    """Store a key only on its N-th offer (vLLM's ``store_threshold``, Dynamo's "disk after 2 hits").

    Offer counts are exact but bounded: at most ``max_tracked`` keys are remembered, the least recently
    offered forgotten first.
    """

    name: ClassVar[str] = "threshold"

    def __init__(self, n: int = DEFAULT_ADMISSION_THRESHOLD, max_tracked: int = 1 << 20) -> None:
        if n < 1:
            raise ValueError(f"n: {n!r} must be >= 1")
        self.n = n
        self.max_tracked = max_tracked
        self._counts: OrderedDict[Key, int] = OrderedDict()

    def admit(self, key: Key, size: int, policy: EvictionPolicy, ctx: AccessContext | None = None) -> bool:
        counts = self._counts
        count = counts.pop(key, 0) + 1
        if count >= self.n:
            return True  # stored now; a later offer (after eviction) starts counting again
        counts[key] = count
        if len(counts) > self.max_tracked:
            counts.popitem(last=False)
        return False

    def clear(self) -> None:
        self._counts.clear()
