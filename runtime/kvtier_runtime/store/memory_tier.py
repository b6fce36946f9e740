"""A memory tier: one slab of block slots allocated once (device memory, or host memory pinned under CUDA),
with an eviction policy deciding which slot is reused. No allocation happens after construction.

The slab may also be given (``slab=``): kvtier's vLLM offloading spec keeps its host tier in a shared-memory
region that vLLM's worker process copies KV pages into, and this tier keeps that region's books in the scheduler.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import cast

import torch

from ..policies import AccessContext, get_policy


class MemoryTier:
    def __init__(
        self,
        name: str,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        *,
        eviction_policy: str = "lru",
        admission: str | None = None,
        admission_threshold: int | None = None,
        pin_memory: bool | None = None,
        slab: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_nbytes = math.prod(self.block_shape) * dtype.itemsize
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < self.block_nbytes:
            raise ValueError(
                f"{name}.capacity_bytes: {capacity_bytes!r} must be an integer >= one block ({self.block_nbytes})"
            )
        self.n_slots = capacity_bytes // self.block_nbytes
        if slab is not None:
            if tuple(slab.shape[1:]) != self.block_shape or slab.dtype != dtype or slab.shape[0] < 1:
                raise ValueError(f"{name}.slab: {slab.dtype}{list(slab.shape)} is not a stack of "
                                 f"{dtype}{list(self.block_shape)} blocks")
            self.n_slots = min(self.n_slots, int(slab.shape[0]))
            self.slab = slab
            self.pinned_memory = bool(pin_memory)
        else:
            if pin_memory is None:
                pin_memory = self.device.type == "cpu" and torch.cuda.is_available()
            self.slab = torch.empty((self.n_slots, *self.block_shape), dtype=dtype, device=self.device,
                                    pin_memory=bool(pin_memory) and self.device.type == "cpu")
            self.pinned_memory = bool(pin_memory) and self.device.type == "cpu"
        # One view per slot, made once: indexing the slab per transfer costs more than the bookkeeping around it.
        self._views = list(self.slab.unbind(0))
        self.policy = get_policy(eviction_policy, self.n_slots * self.block_nbytes, admission=admission,
                                 admission_threshold=admission_threshold)
        # Slots are handed out as vLLM's CPU manager hands out chunk ids: never-used slots in increasing order
        # first, then released ones, last released first.
        self._n_fresh_used = 0
        self._free: list[int] = []
        self._slot_of: dict[bytes, int] = {}
        # Reserved slots whose bytes have not arrived yet: present for placement, absent for reading.
        self._pending: set[bytes] = set()

    @property
    def capacity_bytes(self) -> int:
        return self.policy.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.policy.used_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def keys(self) -> list[bytes]:
        return [k for k in self._slot_of if k not in self._pending]

    def held_keys(self) -> list[bytes]:
        """Every key holding a slot, filled or reserved (a snapshot: the caller may remove keys while walking it)."""
        return list(self._slot_of)

    def is_ready(self, key: bytes) -> bool:
        """Held and filled (a reserved slot becomes ready when the plan that reserved it has copied into it)."""
        return key in self._slot_of and key not in self._pending

    def mark_ready(self, key: bytes) -> None:
        self._pending.discard(key)

    def view(self, key: bytes) -> torch.Tensor:
        return self._views[self._slot_of[key]]

    def slot_of(self, key: bytes) -> int:
        return self._slot_of[key]

    def touch(self, key: bytes, ctx: AccessContext | None = None) -> bool:
        return self.policy.touch(key, ctx)

    def reserve(self, key: bytes, ctx: AccessContext | None = None) -> tuple[int, list[tuple[bytes, int]]] | None:
        """A slot for a new ``key`` and the (key, slot) pairs evicted to make room, or None (not admitted, or
        every slot pinned). Evicted slots keep their bytes until the caller overwrites them, so the caller can
        still demote them first."""
        if key in self._slot_of:
            raise ValueError(f"key {key!r} is already in tier {self.name}")
        if not self.policy.admit(key, self.block_nbytes, ctx):
            return None
        evicted = self.policy.insert(key, self.block_nbytes, ctx)
        if evicted is None:
            return None
        # The policy holds this tier's keys, which are bytes.
        victims = self._release(cast("list[bytes]", evicted))
        slot = self._take_slot()
        self._slot_of[key] = slot
        self._pending.add(key)
        return slot, victims

    def admit(self, key: bytes, ctx: AccessContext | None = None) -> bool:
        """Whether the admission filter would store a missing ``key`` (the offer is recorded)."""
        return self.policy.admit(key, self.block_nbytes, ctx)

    def reserve_run(
        self, keys: Sequence[bytes], ctx: Sequence[AccessContext | None] | None = None,
        protected: Collection[bytes] = (),
    ) -> tuple[list[int], list[tuple[bytes, int]]] | None:
        """Slots for every one of ``keys`` (all new, already admitted) or ``None`` and no change at all.

        Room is made first, in one atomic eviction that never picks a key of ``protected`` (the caller passes the
        whole offer: a store must not evict part of itself or a chunk the same request just stored)."""
        for key in keys:
            if key in self._slot_of:
                raise ValueError(f"key {key!r} is already in tier {self.name}")
        need = len(keys) * self.block_nbytes - self.policy.free_bytes
        evicted: list[bytes] = []
        if need > 0:
            found = self.policy.evict(need, protected)
            if found is None:
                return None
            evicted = cast("list[bytes]", found)
        victims = self._release(evicted)
        slots: list[int] = []
        for i, key in enumerate(keys):
            more = self.policy.insert(key, self.block_nbytes, ctx[i] if ctx is not None else None)
            if more:  # room was made above; an insert that evicts again would break the slot arithmetic
                raise AssertionError(f"{self.name}: insert evicted {len(more)} entries after room was made")
            slot = self._take_slot()
            self._slot_of[key] = slot
            self._pending.add(key)
            slots.append(slot)
        return slots, victims

    def rekey(self, old: bytes, new: object) -> None:
        """Hold ``old``'s slot under the key ``new``: ``old`` is gone for lookups, its slot (and its pins) stay
        until ``new`` is unpinned and removed. A cache reset fences a slot a transfer may still touch this way."""
        slot = self._slot_of.pop(old)
        policy = self.policy
        pins = 0
        while policy.is_pinned(old):
            policy.unpin(old)
            pins += 1
        policy.remove(old)
        self._pending.discard(old)
        if policy.insert(new, self.block_nbytes) != []:
            raise AssertionError(f"{self.name}: re-keying {old!r} evicted an entry")
        for _ in range(pins):
            policy.pin(new)
        self._slot_of[new] = slot  # type: ignore[index]
        self._pending.add(new)  # type: ignore[arg-type]

    def reset_slots(self) -> None:
        """Hand slots out from 0 again (only when the tier is empty, e.g. after a cache reset)."""
        if self._slot_of:
            raise ValueError(f"{self.name}: {len(self._slot_of)} slots are still held")
        self._n_fresh_used = 0
        self._free.clear()

    def _take_slot(self) -> int:
        if self._n_fresh_used < self.n_slots:
            self._n_fresh_used += 1
            return self._n_fresh_used - 1
        return self._free.pop()

    def _release(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        victims = [(k, self._slot_of.pop(k)) for k in keys]
        for k, slot in victims:
            self._pending.discard(k)
            self._free.append(slot)
        return victims

    def remove(self, key: bytes) -> bool:
        slot = self._slot_of.get(key)
        if slot is None:
            return False
        self.policy.remove(key)
        del self._slot_of[key]
        self._pending.discard(key)
        self._free.append(slot)
        return True

    def pin(self, key: bytes) -> bool:
        if key not in self._slot_of:
            return False
        self.policy.pin(key)
        return True

    def unpin(self, key: bytes) -> None:
        self.policy.unpin(key)

    def is_pinned(self, key: bytes) -> bool:
        return self.policy.is_pinned(key)
