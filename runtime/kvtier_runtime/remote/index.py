"""The remote tier's capacity: per scope and model identity, a sorted set of the chunks kvtier wrote
(``kvtier:<scope>:<identity>:index``, score = last write or read), trimmed to the tier's capacity after each store
batch by popping and deleting the oldest. Used bytes = entries x the largest value size (its key included), an
upper bound: the store's own eviction may drop values the set still lists, which then read as ``evicted`` misses
and leave the set as they are popped. Replicas of one scope share the set, so the budget is fleet-wide per scope
and model (another scope's trim pops its own set only); concurrent writers may overshoot it by at most one batch
each before the next trim.

Replicas of every policy of one namespace share the scope's index, so a trim could pop another policy's chunks: a
policy with a one-chunk ``size`` would empty the scope for everyone. So a tier pops at most as many chunks as it
added to the index (``ZADD``'s count of new members) and has not popped yet: a small policy removes what it wrote,
oldest first, never more; the budget of a larger one is kept by that one's own trims."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..config import ConfigError
from .client import RemoteStore
from .format import value_bytes
from .identity import index_key
from .tier_metrics import RemoteMetrics

__all__ = ["NOMINAL_KEY_BYTES", "CapacityIndex", "chunk_cost"]

log = logging.getLogger("kvtier_runtime.remote")

# An offload key is a 32-byte block hash + a 4-byte group index: the size the capacity arithmetic assumes (a chunk
# costs the store its value and its key, hex-encoded after the prefix).
NOMINAL_KEY_BYTES = 36
_HEX = frozenset(b"0123456789abcdef")


def chunk_cost(max_payload: int, prefix: bytes) -> int:
    """What one chunk costs the store at most: its value (header, ciphertext, tag) and its key."""
    return value_bytes(max_payload) + len(prefix) + 2 * NOMINAL_KEY_BYTES


def _member(key: bytes) -> bytes:
    return key.hex().encode()


class CapacityIndex:
    """The model's index in the store under ``prefix``: ``capacity_bytes`` hold ``capacity_entries`` chunks of
    ``cost`` bytes (ConfigError when not one)."""

    def __init__(self, *, name: str, store: RemoteStore, prefix: bytes, capacity_bytes: int, cost: int,
                 metrics: RemoteMetrics) -> None:
        self.capacity_entries = capacity_bytes // cost
        if self.capacity_entries < 1:
            raise ConfigError(f"capacity_bytes: {capacity_bytes} bytes hold no chunk of {cost} bytes (one stored "
                              "value)")
        self.name = name
        self.key = index_key(prefix)
        self.cost = cost
        self._prefix = prefix
        self._store = store
        self._metrics = metrics
        self._entries = 0
        # Chunks this tier added to the index and has not popped: the most its trims may pop.
        self._credit = 0
        metrics.occupancy(0)

    @property
    def used_bytes(self) -> int:
        """The model's chunks in the store (as last counted after a store), at the largest value size."""
        return self._entries * self.cost

    def record_writes(self, pipe: Any, keys: Sequence[bytes], now: float) -> None:
        """Add to ``pipe`` the index's update for chunks written now (ZADD: its reply, the members it added, is
        :meth:`trim`'s ``added``), then its size (ZCARD: the last reply, :meth:`trim`'s ``entries``)."""
        pipe.zadd(self.key, {_member(key): now for key in keys})
        pipe.zcard(self.key)

    def write_commands(self, keys: Sequence[bytes], now: float) -> list[tuple[bytes | str, ...]]:
        """:meth:`record_writes` as raw commands (for the tier's own store connections): ZADD, then ZCARD."""
        zadd: list[bytes | str] = ["ZADD", self.key]
        for key in keys:
            zadd += [repr(now), _member(key)]
        return [tuple(zadd), ("ZCARD", self.key)]

    def touch(self, pipe: Any, keys: Sequence[bytes], now: float) -> None:
        """Add to ``pipe``: a read is a use, the chunks move to the young end of the index (XX: only if listed)."""
        pipe.zadd(self.key, {_member(key): now for key in keys}, xx=True)

    def touch_command(self, keys: Sequence[bytes], now: float) -> tuple[bytes | str, ...]:
        """:meth:`touch` as one raw command (for the tier's own load connections)."""
        command: list[bytes | str] = ["ZADD", self.key, "XX"]
        for key in keys:
            command += [repr(now), _member(key)]
        return tuple(command)

    def trim(self, entries: int, added: int) -> list[bytes]:
        """Pop the oldest chunks past the capacity (the index held ``entries`` after this tier's write added
        ``added``), at most as many as this tier added and has not popped, and delete them; the offload keys
        deleted. Best effort: the store's maxmemory stays the hard bound whatever happens here."""
        evicted: list[bytes] = []
        self._credit += max(0, added)
        try:
            over = min(entries - self.capacity_entries, self._credit)
            if over > 0:
                popped = self._store.connect().zpopmin(self.key, over)
                if popped:
                    evicted = self._delete([bytes(member) for member, _ in popped])
                    self._metrics.evicted(len(popped))
                entries -= len(popped)
                self._credit -= len(popped)
        except Exception as exc:
            log.debug("kvtier remote tier %s: trimming the index failed (%s)", self.name, exc)
        self._entries = max(0, entries)
        self._metrics.occupancy(self.used_bytes)
        return evicted

    def _delete(self, members: list[bytes]) -> list[bytes]:
        # Only members kvtier writes (a chunk key's hex) name a key to delete: whatever else the index holds never
        # makes the trim delete a key outside this scope's chunks (the index itself).
        mine = [member for member in members if member and len(member) % 2 == 0 and _HEX.issuperset(member)]
        pipe = self._store.pipeline()
        for member in mine:
            pipe.delete(self._prefix + member)
        pipe.execute(raise_on_error=False)
        return [bytes.fromhex(member.decode()) for member in mine]
