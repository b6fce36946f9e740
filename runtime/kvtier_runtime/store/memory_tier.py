"""A memory tier: one slab of block slots allocated once (device memory, or host memory pinned under CUDA),
with an eviction policy deciding which slot is reused. No allocation happens after construction.

The slab may also be given (``slab=``): kvtier's vLLM offloading spec keeps its host tier in a shared-memory
region that vLLM's worker process copies KV pages into, and this tier keeps that region's books in the scheduler.
"""
from __future__ import annotations

import math
from typing import Sequence

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
        self.policy = get_policy(eviction_policy, self.n_slots * self.block_nbytes, admission=admission)
        self._free = list(range(self.n_slots - 1, -1, -1))
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

    def is_ready(self, key: bytes) -> bool:
        """Held and filled (a reserved slot becomes ready when the plan that reserved it has copied into it)."""
        return key in self._slot_of and key not in self._pending

    def mark_ready(self, key: bytes) -> None:
        self._pending.discard(key)

    def view(self, key: bytes) -> torch.Tensor:
        return self._views[self._slot_of[key]]

    def slot_view(self, slot: int) -> torch.Tensor:
        return self._views[slot]

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
        victims = [(k, self._slot_of.pop(k)) for k in evicted]
        for k, slot in victims:
            self._pending.discard(k)
            self._free.append(slot)
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._pending.add(key)
        return slot, victims

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
