"""The one base class of every eviction policy: byte accounting, pinning and atomic eviction live here.

A policy subclass adds only its *ordering* (which entry goes next) through five hooks; everything a caller can
observe about capacity is decided in this module, so every policy obeys the same contract and one behavioural
test suite (tests/runtime/policies/test_policies_contract.py) checks them all.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable
from typing import ClassVar, NamedTuple

Key = Hashable


class AccessContext(NamedTuple):
    """Optional request context of one block access.

    ``request_id`` names the request, ``position`` is the block's index in the request's prefix (0 = the first
    block), ``length`` the request's number of blocks. Prefix-aware policies use it so that a request's tail
    blocks go before its head: a block is only reusable when every block before it is cached too.
    """

    request_id: Hashable = None
    position: int = 0
    length: int = 1


class PinnedEntryError(ValueError):
    """An operation would drop an entry that is pinned (a transfer is in flight for it)."""


class AdmissionFilter:
    """Decides whether a missing key is worth storing at all; wraps any eviction policy.

    ``admit`` is called once per *offer* (a miss that the caller would like to store) and records it;
    ``record_access`` sees every hit so frequency-based filters can count them.
    """

    name: ClassVar[str] = "none"

    def admit(self, key: Key, size: int, policy: EvictionPolicy, ctx: AccessContext | None = None) -> bool:
        return True

    def record_access(self, key: Key) -> None:
        """A hit on a cached key (default: not counted)."""

    def clear(self) -> None:
        """Forget every recorded offer and access."""


class EvictionPolicy:
    """A bounded set of keys with sizes in bytes, ordered by a policy.

    Semantics every policy shares (enforced here, not in subclasses):

    * ``used_bytes <= capacity_bytes`` at all times; ``used_bytes`` is the sum of the sizes of present keys.
    * ``insert(key, size)`` evicts only as many bytes as needed to fit ``size``; if that is impossible (the
      entry is larger than the capacity, or the evictable bytes do not suffice because of pinned entries) it
      returns ``None`` and changes nothing at all -- not the keys, not the order, not ghost lists.
      Re-inserting a present key with the same size is a touch and returns ``[]``.
    * ``evict(n_bytes, protected)`` evicts entries until at least ``n_bytes`` were freed, never a pinned entry
      and never one named in ``protected``; atomic in the same way (``None`` and no change when impossible).
    * Pins are reference counted: ``pin`` twice needs ``unpin`` twice. A pinned entry is never evicted and
      ``remove`` of it raises :class:`PinnedEntryError`.
    * ``admit`` asks the admission filter (if any) about a missing key and records the offer; it never changes
      the cached set. Callers do ``if not policy.touch(k) and policy.admit(k, size): policy.insert(k, size)``.
    * ``ctx`` (an :class:`AccessContext` or ``None``) is optional request context; policies that do not use it
      ignore it.

    Keys are opaque hashable values (bytes in the block store, ints in trace replay).

    Subclass hooks (each called only when the base class has already decided the operation succeeds):
    ``_order_insert(key, size, ctx)``, ``_order_touch(key, ctx)``, ``_order_remove(key)`` (explicit removal),
    ``_pop_victim(blocked)`` (choose, unlink and return an entry for which ``blocked(key)`` is false; the base
    class guarantees one exists), ``_order_clear()``; optionally ``_prepare_insert(key, size, ctx)`` (runs before
    room is made, e.g. to adapt to a ghost hit) and ``peek_victim()``.
    """

    name: ClassVar[str] = "base"
    # Whether the ordering reads ``ctx``; callers on a hot path (trace replay) skip building contexts otherwise.
    uses_context: ClassVar[bool] = False
    # Whether the ordering implements vLLM 0.33's request-aware contract (request ranks, a finished request's
    # chunks touched tail to head without context): the vLLM CachePolicy plug-in drives such a policy that way.
    request_aware: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: {capacity_bytes!r} must be a positive integer")
        self.capacity_bytes = capacity_bytes
        self.admission = admission
        self._sizes: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}
        self._used = 0
        self._pinned_bytes = 0

    # ---- observation ------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterable[Key]:
        return iter(list(self._sizes))

    def size_of(self, key: Key) -> int:
        """Size in bytes of a present key (KeyError if absent)."""
        return self._sizes[key]

    def is_pinned(self, key: Key) -> bool:
        return key in self._pins

    def peek_victim(self) -> Key | None:
        """The key the policy would evict next, without evicting it (``None`` if unknown or empty)."""
        return None

    # ---- operations -------------------------------------------------------------------------------------
    def touch(self, key: Key, ctx: AccessContext | None = None) -> bool:
        """Record a hit on ``key``; ``False`` (and nothing recorded) if it is absent."""
        if key not in self._sizes:
            return False
        if self.admission is not None:
            self.admission.record_access(key)
        self._order_touch(key, ctx)
        return True

    def admit(self, key: Key, size: int, ctx: AccessContext | None = None) -> bool:
        """Whether a missing ``key`` of ``size`` bytes should be stored; records the offer with the filter."""
        _check_size(size)
        if self.admission is None:
            return True
        return self.admission.admit(key, size, self, ctx)

    def insert(self, key: Key, size: int, ctx: AccessContext | None = None) -> list[Key] | None:
        """Insert ``key``, evicting what is needed; the evicted keys, or ``None`` with no change if impossible."""
        _check_size(size)
        old = self._sizes.get(key)
        if old is not None:
            if old != size:
                raise ValueError(f"size: {key!r} is cached with {old} bytes, not {size}; remove it first")
            self.touch(key, ctx)
            return []
        need = self._used + size - self.capacity_bytes
        if need > 0 and (size > self.capacity_bytes or need > self._used - self._pinned_bytes):
            return None
        self._prepare_insert(key, size, ctx)
        evicted = self._evict_unchecked(need, ()) if need > 0 else []
        self._sizes[key] = size
        self._used += size
        self._order_insert(key, size, ctx)
        return evicted

    def remove(self, key: Key) -> bool:
        """Drop ``key`` (no ghost entry is recorded); ``False`` if absent, :class:`PinnedEntryError` if pinned."""
        if key not in self._sizes:
            return False
        if key in self._pins:
            raise PinnedEntryError(f"key {key!r} is pinned ({self._pins[key]} references)")
        self._order_remove(key)
        self._used -= self._sizes.pop(key)
        return True

    def pin(self, key: Key) -> None:
        """Add a reference that keeps ``key`` from eviction (KeyError if absent)."""
        size = self._sizes[key]
        count = self._pins.get(key, 0)
        if count == 0:
            self._pinned_bytes += size
        self._pins[key] = count + 1

    def unpin(self, key: Key) -> None:
        """Drop one reference taken by :meth:`pin` (ValueError if ``key`` is not pinned)."""
        count = self._pins.get(key, 0)
        if count == 0:
            raise ValueError(f"key {key!r} is not pinned")
        if count == 1:
            del self._pins[key]
            self._pinned_bytes -= self._sizes[key]
        else:
            self._pins[key] = count - 1

    def evict(self, n_bytes: int, protected: Collection[Key] = ()) -> list[Key] | None:
        """Evict unpinned, unprotected entries until at least ``n_bytes`` are freed; ``None`` (no change) if impossible."""
        if isinstance(n_bytes, bool) or not isinstance(n_bytes, int) or n_bytes < 0:
            raise ValueError(f"n_bytes: {n_bytes!r} must be a non-negative integer")
        if n_bytes == 0:
            return []
        protected = frozenset(k for k in protected if k in self._sizes and k not in self._pins)
        evictable = self._used - self._pinned_bytes - sum(self._sizes[k] for k in protected)
        if n_bytes > evictable:
            return None
        return self._evict_unchecked(n_bytes, protected)

    def clear(self) -> None:
        """Drop every entry, pin, ghost and admission record."""
        self._sizes.clear()
        self._pins.clear()
        self._used = 0
        self._pinned_bytes = 0
        self._order_clear()
        if self.admission is not None:
            self.admission.clear()

    # ---- internals --------------------------------------------------------------------------------------
    def _evict_unchecked(self, n_bytes: int, protected: Collection[Key]) -> list[Key]:
        pins = self._pins
        if protected:
            blocked: Callable[[Key], bool] = lambda k: k in pins or k in protected
        else:
            blocked = pins.__contains__
        sizes = self._sizes
        evicted: list[Key] = []
        freed = 0
        while freed < n_bytes:
            victim = self._pop_victim(blocked)
            freed += sizes.pop(victim)
            evicted.append(victim)
        self._used -= freed
        return evicted

    # ---- hooks ------------------------------------------------------------------------------------------
    def _prepare_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        """Runs once an insert is known to succeed, before room is made (e.g. ARC adapts on a ghost hit)."""

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        raise NotImplementedError

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        raise NotImplementedError

    def _order_remove(self, key: Key) -> None:
        raise NotImplementedError

    def _pop_victim(self, blocked: Callable[[Key], bool]) -> Key:
        raise NotImplementedError

    def _order_clear(self) -> None:
        raise NotImplementedError


def _check_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"size: {size!r} must be a positive integer")
