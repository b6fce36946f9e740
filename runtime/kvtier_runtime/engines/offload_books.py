"""The books of kvtier's vLLM offloading spec: which chunk is where, in the scheduler process (no vllm import).

Tiers: a host tier (:class:`~kvtier_runtime.store.memory_tier.MemoryTier` over the shared
:class:`~.host_region.HostRegion`, slots chosen by a kvtier eviction policy) and behind it zero or more durable
filesystem tiers (:class:`~kvtier_runtime.fs.tier.FilesystemTier`, bounded, checksummed, optionally compressed).

Flow, and why it is split this way:

* vLLM's worker copies engine pages <-> host rows (``prepare_store``/``prepare_load`` hand it slot numbers).
* Every chunk that reaches the host tier is also written to each filesystem tier (write-through, from the host
  row, by the tier's own thread pool), so a host eviction never has to wait for a disk write.
* A chunk found only on disk is *promoted* into a host slot by the tier's read threads while ``lookup`` answers
  ``retry``; the engine asks again on its next step and then loads it from the host row like any host hit.
  vLLM 0.32's worker cannot report a failed load (it asserts success), so every disk read -- the only step
  that can meet an I/O error or a corrupt file -- happens here, before vLLM is told ``hit``: a failed read is a
  ``miss`` that vLLM recomputes, counted in :attr:`load_failures`, never a wrong block.

Nothing here blocks on the disk: lookups read in-memory indexes, disk work is queued, completions are collected by
:meth:`poll` (called on every lookup/store and at the end of each scheduler step).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..fs.tier import FilesystemTier, JobResult, KeyState
from ..policies import AccessContext
from ..store.memory_tier import MemoryTier

log = logging.getLogger(__name__)

HIT, HIT_PENDING, RETRY, MISS = "hit", "hit_pending", "retry", "miss"
HOST, DISK = "host", "disk"


@dataclass
class _Promotion:
    key: bytes
    tier: int
    started: float


@dataclass
class _WriteThrough:
    keys: tuple[bytes, ...]
    tier: int


class OffloadBooks:
    """Host slots + filesystem tiers for one engine. Keys are vLLM's offload keys (bytes); on disk they carry
    ``key_suffix`` (a digest of the run identity) so different models sharing a directory never mix."""

    def __init__(
        self,
        host: MemoryTier,
        fs_tiers: Sequence[FilesystemTier] = (),
        *,
        fs_rows: Sequence[torch.Tensor] | None = None,
        key_suffix: bytes = b"",
    ) -> None:
        self.host = host
        self.fs_tiers = list(fs_tiers)
        # Per filesystem tier, the host rows as that tier sees them (the KV dtype its codec quantizes); same memory.
        self._fs_rows = list(fs_rows) if fs_rows is not None else [host.slab] * len(self.fs_tiers)
        self._suffix = key_suffix
        self._origin: dict[bytes, str] = {}  # host-resident key -> where its bytes came from
        self._promotions: dict[tuple[int, int], _Promotion] = {}  # (tier, fs job id) -> promotion
        self._writes: dict[tuple[int, int], _WriteThrough] = {}
        self._writing: set[bytes] = set()  # keys whose worker store is in flight
        self.load_failures: Counter[str] = Counter()  # by kind: corrupt, missing, eio, ...
        self.counters: Counter[str] = Counter()  # promotions, promotion_failures, fs_stores, host_evictions...

    # ---- keys ---------------------------------------------------------------------------------------------
    def fs_key(self, key: bytes) -> bytes:
        return bytes(key) + self._suffix

    # ---- lookups ------------------------------------------------------------------------------------------
    def lookup(self, key: bytes, ctx: AccessContext | None = None) -> str:
        self.poll()
        host = self.host
        if key in host:
            if not host.is_ready(key):
                return HIT_PENDING if key in self._writing else RETRY  # a store or a promotion is in flight
            return HIT
        fkey = self.fs_key(key)
        for i, tier in enumerate(self.fs_tiers):
            if tier.state(fkey) is KeyState.HIT:
                return RETRY if self._promote(key, i, ctx) else MISS
        return MISS

    def source(self, key: bytes) -> str:
        return self._origin.get(key, HOST)

    def _promote(self, key: bytes, tier_index: int, ctx: AccessContext | None) -> bool:
        reserved = self.host.reserve(key, ctx)
        if reserved is None:
            self.counters["promotion_no_room"] += 1
            return False
        slot, victims = reserved
        self._forget(victims)
        self.host.pin(key)
        tier = self.fs_tiers[tier_index]
        job = tier.submit_load([self.fs_key(key)], [self._fs_rows[tier_index][slot]], ctx)
        self._promotions[(tier_index, job)] = _Promotion(key, tier_index, time.monotonic())
        self.counters["promotions_started"] += 1
        return True

    # ---- loads (host -> engine) -------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        slots = []
        for key in keys:
            self.host.pin(key)
            slots.append(self.host.slot_of(key))
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self.host and self.host.is_pinned(key):
                self.host.unpin(key)

    def touch(self, keys: Iterable[bytes], ctx: AccessContext | None = None) -> None:
        for key in keys:
            if key in self.host:
                self.host.touch(key, ctx)

    # ---- stores (engine -> host -> disk) ------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], ctx: AccessContext | None = None
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """(keys to store, their host slots, keys evicted to make room); ``None`` if none can be stored.

        Keys already held (host, or a filesystem tier) are skipped. Storing stops at the first key the host tier
        cannot take (every slot pinned, or refused by admission), so what is stored is a run of the prefix."""
        self.poll()
        to_store: list[bytes] = []
        slots: list[int] = []
        evicted: list[bytes] = []
        refused = False
        for key in keys:
            if key in self.host or self._on_disk(key):
                continue
            reserved = self.host.reserve(key, ctx)
            if reserved is None:
                refused = True
                self.counters["host_store_refusals"] += 1
                break
            slot, victims = reserved
            evicted += self._forget(victims)
            self.host.pin(key)
            self._writing.add(key)
            self._origin[key] = HOST
            to_store.append(key)
            slots.append(slot)
        if refused and not to_store:
            return None
        return to_store, slots, evicted

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        done: list[bytes] = []
        for key in keys:
            if key not in self._writing:
                continue
            self._writing.discard(key)
            self.host.unpin(key)
            if success:
                self.host.mark_ready(key)
                done.append(key)
            else:
                self.host.remove(key)
                self._origin.pop(key, None)
        if done:
            self._write_through(done)

    def _write_through(self, keys: list[bytes]) -> None:
        for i, tier in enumerate(self.fs_tiers):
            todo = [k for k in keys if tier.state(self.fs_key(k)) is KeyState.MISS]
            if not todo:
                continue
            for key in todo:
                self.host.pin(key)  # the row must not be reused before the tier has read it
            rows = [self._fs_rows[i][self.host.slot_of(k)] for k in todo]
            job = tier.submit_store([self.fs_key(k) for k in todo], rows)
            self._writes[(i, job)] = _WriteThrough(tuple(todo), i)

    def _on_disk(self, key: bytes) -> bool:
        fkey = self.fs_key(key)
        return any(t.state(fkey) is not KeyState.MISS for t in self.fs_tiers)

    def _forget(self, victims: Sequence[tuple[bytes, int]]) -> list[bytes]:
        keys = [k for k, _ in victims]
        for key in keys:
            self._origin.pop(key, None)
        self.counters["host_evictions"] += len(keys)
        return keys

    # ---- completions --------------------------------------------------------------------------------------
    def poll(self) -> None:
        if not self._promotions and not self._writes:
            return
        for i, tier in enumerate(self.fs_tiers):
            for result in tier.get_finished():
                self._finish(i, result)

    def _finish(self, tier_index: int, result: JobResult) -> None:
        promo = self._promotions.pop((tier_index, result.job_id), None)
        if promo is not None:
            key = promo.key
            self.host.unpin(key)
            if result.ok[0]:
                self.host.mark_ready(key)
                self._origin[key] = DISK
                self.counters["promotions"] += 1
            else:
                kind = result.errors.get(0, "other")
                self.load_failures[kind] += 1
                self.host.remove(key)
                self._origin.pop(key, None)
                log.warning("kvtier: reading a block from %s failed (%s); vLLM recomputes it",
                            self.fs_tiers[tier_index].name, kind)
            return
        write = self._writes.pop((tier_index, result.job_id), None)
        if write is None:
            return
        for key, ok in zip(write.keys, result.ok):
            if key in self.host:
                self.host.unpin(key)
            self.counters["fs_stores" if ok else "fs_store_refusals"] += 1

    def has_pending_work(self) -> bool:
        return bool(self._promotions or self._writes)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for queued disk work (shutdown, tests)."""
        deadline = time.monotonic() + timeout_s
        while self.has_pending_work() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.005)

    def close(self) -> None:
        self.drain()
        for tier in self.fs_tiers:
            tier.close()

    # ---- observation --------------------------------------------------------------------------------------
    @property
    def host_used_bytes(self) -> int:
        return self.host.used_bytes

    @property
    def host_capacity_bytes(self) -> int:
        return self.host.capacity_bytes
