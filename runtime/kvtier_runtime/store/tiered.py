"""The tiered block store: device -> host -> filesystem, with promotion, demotion, pins and a cost model.

Every operation is turned into a *plan* of block transfers, then executed level by level from the slowest
destination to the fastest. That order is what makes slot reuse safe without extra copies: when a new block
takes the slot of an evicted one, the evicted block's demotion (which reads that slot) is in a deeper level and so
runs before the write into the slot. All blocks reserved by a plan are pinned until it finished, so a plan never
evicts what it is moving.

Operations run on one worker thread and return futures (``put`` and ``load`` are asynchronous); ``put_sync``
and ``load_sync`` run a plan in the caller's thread. Plans never interleave (one plan lock). ``lookup``, ``pin``
and ``unpin`` are synchronous and cheap, and see only blocks whose bytes have arrived. With CUDA, device copies
go on a side stream and a plan's future completes only after that stream is synchronised.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from .. import metrics
from ..fs.tier import FilesystemTier, KeyState
from ..policies import AccessContext
from .cost import CostModel
from .memory_tier import MemoryTier

WriteMode = Literal["through", "back"]
ENGINE = "engine"
_FROM_FS = object()  # a transfer whose source is a filesystem-tier read


@dataclass(frozen=True)
class PutResult:
    keys: tuple[bytes, ...]
    ok: tuple[bool, ...]  # the block is held by at least one tier after the put

    @property
    def success(self) -> bool:
        return all(self.ok)


@dataclass(frozen=True)
class LoadResult:
    """``hits`` leading keys were delivered (promoted to the top tier and copied to ``outs`` when given).

    ``sources[i]`` is the tier key ``i`` came from; ``stopped`` says why the run ended before all keys
    (``miss``, ``skipped`` by the cost model, ``no-room`` in an upper tier, or a filesystem read error kind).
    ``outs[i]`` for ``i >= hits`` is unspecified (it may hold a valid later block, never a wrong one for a hit)."""

    hits: int
    sources: tuple[str, ...]
    stopped: str | None = None


@dataclass(slots=True)
class _Transfer:
    level: int  # destination level; -1 = the caller's output tensor
    key: bytes
    src: object  # a tensor, or _FROM_FS
    dst: torch.Tensor | None  # None for a filesystem destination
    src_name: str
    dst_name: str


@dataclass
class _Plan:
    transfers: list[_Transfer] = field(default_factory=list)
    reserved: list[tuple[int, bytes]] = field(default_factory=list)  # (level, key) pinned by this plan
    pinned_fs: list[bytes] = field(default_factory=list)


class TieredStore:
    """Blocks of one shape and dtype in up to three tiers (top first): device, host, filesystem.

    ``write`` gives the write mode of each tier below the top: ``through`` (every put is written there too) or
    ``back`` (a block reaches the tier only when evicted from the tier above). Capacities are bytes.
    """

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        device_capacity_bytes: int | None = None,
        host_capacity_bytes: int | None = None,
        fs: FilesystemTier | None = None,
        device: torch.device | str | None = None,
        write: Mapping[str, WriteMode] | None = None,
        eviction_policy: str = "lru",
        admission: str | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        write = dict(write or {})
        for name, mode in write.items():
            if name not in ("host", "fs"):
                raise ValueError(f"write: {name!r} is not a tier below the top (host, fs)")
            if mode not in ("through", "back"):
                raise ValueError(f"write.{name}: {mode!r} is not 'through' or 'back'")
        if device_capacity_bytes is None and host_capacity_bytes is None and fs is None:
            raise ValueError("tiers: configure at least one of device_capacity_bytes, host_capacity_bytes, fs")
        if fs is not None and device_capacity_bytes is not None and host_capacity_bytes is None \
                and self.device.type != "cpu":
            raise ValueError("host_capacity_bytes: required with a CUDA device tier and an fs tier "
                             "(filesystem blocks reach the device through host memory)")
        if fs is not None and (fs.block_shape != self.block_shape or fs.dtype != dtype):
            raise ValueError(f"fs: tier holds {fs.dtype}{list(fs.block_shape)}, store is {dtype}{list(block_shape)}")

        self._tiers: list[MemoryTier | FilesystemTier] = []
        self._modes: list[str] = []
        if device_capacity_bytes is not None:
            self._tiers.append(MemoryTier("device", block_shape, dtype, device_capacity_bytes, self.device,
                                          eviction_policy=eviction_policy, admission=admission))
            self._modes.append("top")
        if host_capacity_bytes is not None:
            self._tiers.append(MemoryTier("host", block_shape, dtype, host_capacity_bytes, "cpu",
                                          eviction_policy=eviction_policy, admission=admission))
            self._modes.append("top" if not self._modes else write.get("host", "back"))
        if fs is not None:
            fs.peer = self._tiers[-1].name if self._tiers else ENGINE
            self._tiers.append(fs)
            self._modes.append("top" if not self._modes else write.get("fs", "back"))
        self.block_nbytes = _nbytes(self.block_shape, dtype)
        self.cost_model = cost_model
        self._lock = threading.RLock()  # guards tier metadata (lookups and pins come from any thread)
        # One plan runs at a time (worker or a *_sync caller): plans interleaving their reservations and
        # multi-level copies would need per-slot ownership to stay correct, and a batch is already the unit of
        # parallel work (the filesystem tier runs its I/O on its own pools).
        self._plan_lock = threading.Lock()
        # per key, one tuple of tier levels per pin() call, so unpin() undoes exactly the latest call
        self._user_pins: dict[bytes, list[tuple[int, ...]]] = defaultdict(list)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtier-store")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for tier in self._tiers:
            metrics.CAPACITY_BYTES.labels(tier.name).set(tier.capacity_bytes)
        self._update_occupancy()

    # ---- introspection ----------------------------------------------------------------------------------
    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._tiers)

    def tier(self, name: str) -> MemoryTier | FilesystemTier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"tier: {name!r} is not one of {', '.join(self.tier_names)}")

    def write_mode(self, name: str) -> str:
        return self._modes[self.tier_names.index(name)]

    def _holds(self, level: int, key: bytes) -> bool:
        tier = self._tiers[level]
        if isinstance(tier, FilesystemTier):
            return tier.state(key) is KeyState.HIT
        return tier.is_ready(key)

    # ---- synchronous, cheap -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], ctx: AccessContext | None = None) -> dict[str, int]:
        """Per tier, the longest run of leading keys it holds; ``any`` = the run held by some tier."""
        out: dict[str, int] = {}
        with self._lock:
            for level, tier in enumerate(self._tiers):
                if isinstance(tier, FilesystemTier):
                    out[tier.name] = tier.lookup(keys, ctx).hits
                    continue
                n = 0
                for key in keys:
                    if not tier.is_ready(key):
                        break
                    n += 1
                metrics.LOOKUPS.labels(tier.name).inc(min(len(keys), n + 1))
                metrics.HITS.labels(tier.name).inc(n)
                out[tier.name] = n
            n_any = 0
            for key in keys:
                if not any(self._holds(level, key) for level in range(len(self._tiers))):
                    break
                n_any += 1
        out["any"] = n_any
        return out

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` from being evicted from every tier that holds them now (reference counted)."""
        with self._lock:
            for key in keys:
                self._user_pins[key].append(tuple(lv for lv, t in enumerate(self._tiers) if t.pin(key)))

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                calls = self._user_pins.get(key)
                if not calls:
                    raise ValueError(f"keys: {key!r} is not pinned")
                for level in calls.pop():
                    self._tiers[level].unpin(key)
                if not calls:
                    del self._user_pins[key]

    # ---- asynchronous operations ------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            ctx: AccessContext | None = None) -> "Future[PutResult]":
        """Store blocks (they must stay unchanged until the future is done) in the top tier and every
        write-through tier; evicted blocks move down to write-back tiers."""
        self._check_blocks(keys, blocks)
        return self._worker.submit(self._put, [bytes(k) for k in keys], list(blocks), ctx)

    def _check_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(blocks):
            raise ValueError(f"blocks: {len(blocks)} blocks for {len(keys)} keys")
        for b in blocks:
            if tuple(b.shape) != self.block_shape or b.dtype != self.dtype:
                raise ValueError(f"blocks: a {b.dtype}{list(b.shape)} block, the store holds "
                                 f"{self.dtype}{list(self.block_shape)}")

    def load(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor] | None = None,
             ctx: AccessContext | None = None) -> "Future[LoadResult]":
        """Promote the leading run of ``keys`` to the top tier (filesystem -> host -> device) and copy them into
        ``outs`` when given. A promotion from the filesystem that the cost model says is slower than recomputing
        ends the run (counted in ``kvtier_runtime_promotions_skipped``)."""
        if outs is not None and len(outs) != len(keys):
            raise ValueError(f"outs: {len(outs)} tensors for {len(keys)} keys")
        return self._worker.submit(self._load, [bytes(k) for k in keys], None if outs is None else list(outs), ctx)

    def put_sync(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                 ctx: AccessContext | None = None) -> PutResult:
        """``put`` run in the calling thread (for callers that already own a transfer thread); it waits for a
        plan the worker is running, so plans never interleave."""
        self._check_blocks(keys, blocks)
        return self._put([bytes(k) for k in keys], list(blocks), ctx)  # takes the plan lock

    def load_sync(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor] | None = None,
                  ctx: AccessContext | None = None) -> LoadResult:
        """``load`` run in the calling thread (see put_sync)."""
        if outs is not None and len(outs) != len(keys):
            raise ValueError(f"outs: {len(outs)} tensors for {len(keys)} keys")
        return self._load([bytes(k) for k in keys], None if outs is None else list(outs), ctx)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- planning ---------------------------------------------------------------------------------------
    def _place(self, level: int, key: bytes, src: object, src_name: str, plan: _Plan,
               ctx: AccessContext | None) -> bool:
        """Plan a copy of ``key`` from ``src`` into tier ``level`` (reserving room, planning demotions of the
        blocks that room costs). False if the tier declined (admission, or everything pinned)."""
        tier = self._tiers[level]
        if isinstance(tier, FilesystemTier):
            if tier.state(key) is KeyState.MISS:
                plan.transfers.append(_Transfer(level, key, src, None, src_name, tier.name))
            return True
        if key in tier:
            tier.touch(key, ctx)
            return True
        got = tier.reserve(key, ctx)
        if got is None:
            return False
        slot, victims = got
        tier.pin(key)
        plan.reserved.append((level, key))
        if victims:
            metrics.EVICTIONS.labels(tier.name).inc(len(victims))
        for vkey, vslot in victims:
            below = level + 1
            if below < len(self._tiers) and self._modes[below] == "back" and not self._holds(below, vkey):
                self._place(below, vkey, tier.slot_view(vslot), tier.name, plan, None)
        plan.transfers.append(_Transfer(level, key, src, tier.slot_view(slot), src_name, tier.name))
        return True

    # ---- execution --------------------------------------------------------------------------------------
    def _execute(self, plan: _Plan) -> dict[bytes, str]:
        """Run a plan deepest level first; returns the keys whose filesystem *read* failed, with the reason.

        Their later transfers are skipped (their slots hold no valid bytes). A failed filesystem *write* only
        loses that copy; the filesystem tier counts it and the memory copies stand."""
        failed: dict[bytes, str] = {}
        by_level: dict[int, list[_Transfer]] = defaultdict(list)
        for t in plan.transfers:
            by_level[t.level].append(t)
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        if self._stream is not None:
            # Blocks handed in by the engine were produced on its (default) stream.
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with stream_ctx:
            for level in sorted(by_level, reverse=True):
                transfers = by_level[level]
                dst_tier = self._tiers[level] if level >= 0 else None
                if isinstance(dst_tier, FilesystemTier):
                    dst_tier.wait(dst_tier.submit_store([t.key for t in transfers], [t.src for t in transfers]),
                                  timeout=None)
                    continue
                from_fs = [t for t in transfers if t.src is _FROM_FS]
                if from_fs:
                    fs = self._tiers[-1]  # the filesystem tier is always the last one
                    assert isinstance(fs, FilesystemTier)
                    res = fs.wait(fs.submit_load([t.key for t in from_fs], [t.dst for t in from_fs]), timeout=None)
                    for i, reason in res.errors.items():
                        failed.setdefault(from_fs[i].key, reason)
                started = time.perf_counter()
                moved: dict[tuple[str, str], int] = defaultdict(int)
                for t in transfers:
                    if t.src is _FROM_FS or t.key in failed:
                        continue
                    assert t.dst is not None and isinstance(t.src, torch.Tensor)
                    t.dst.copy_(t.src, non_blocking=True)
                    moved[(t.src_name, t.dst_name)] += 1
                if self._stream is not None:
                    self._stream.synchronize()
                self._record(moved, time.perf_counter() - started)
        return failed

    def _record(self, moved: Mapping[tuple[str, str], int], seconds: float) -> None:
        # One histogram observation per batch: observing per block costs more than a 2 MiB copy's bookkeeping.
        order = {name: i for i, name in enumerate(self.tier_names)}
        for (src, dst), n in moved.items():
            up = src != ENGINE and (dst == ENGINE or order.get(src, 0) > order.get(dst, 0))
            if src != ENGINE and dst != ENGINE:
                (metrics.PROMOTIONS if up else metrics.DEMOTIONS).labels(src, dst).inc(n)
            metrics.BYTES_MOVED.labels(src, dst).inc(n * self.block_nbytes)
            metrics.TRANSFER_SECONDS.labels(src, dst).observe(seconds)  # the pass these copies shared

    def _release(self, plan: _Plan, failed: Mapping[bytes, str]) -> None:
        with self._lock:
            for level, key in plan.reserved:
                tier = self._tiers[level]
                tier.unpin(key)
                if key in failed:
                    if not tier.is_pinned(key):  # its slot never received valid bytes
                        tier.remove(key)
                else:
                    tier.mark_ready(key)
            for key in plan.pinned_fs:
                fs = self._tiers[-1]
                fs.unpin(key)
        self._update_occupancy()

    def _update_occupancy(self) -> None:
        for tier in self._tiers:
            if isinstance(tier, MemoryTier):
                metrics.OCCUPANCY_BYTES.labels(tier.name).set(tier.used_bytes)

    # ---- operations (worker thread) ---------------------------------------------------------------------
    def _flush(self, plan: _Plan, failed: dict[bytes, str]) -> _Plan:
        """Execute and release ``plan`` (collecting read failures into ``failed``); return a fresh plan."""
        got: dict[bytes, str] = {}
        try:
            got = self._execute(plan) if plan.transfers else {}
        finally:
            self._release(plan, got)
        failed.update(got)
        return _Plan()

    def _put(self, keys: list[bytes], blocks: list[torch.Tensor], ctx: AccessContext | None) -> PutResult:
        with self._plan_lock:
            return self._put_locked(keys, blocks, ctx)

    def _put_locked(self, keys: list[bytes], blocks: list[torch.Tensor], ctx: AccessContext | None) -> PutResult:
        plan = _Plan()
        failed: dict[bytes, str] = {}
        placed: list[bool] = []
        for key, block in zip(keys, blocks):
            ok = False
            for level, mode in enumerate(self._modes):
                if mode not in ("top", "through"):
                    continue
                with self._lock:
                    done = self._place(level, key, block, ENGINE, plan, ctx)
                if not done and plan.reserved:
                    # The tier is full of blocks this batch pinned: move them on, then retry.
                    plan = self._flush(plan, failed)
                    with self._lock:
                        done = self._place(level, key, block, ENGINE, plan, ctx)
                ok = ok or done
            placed.append(ok)
        self._flush(plan, failed)
        with self._lock:
            ok_t = tuple(p and any(self._holds(lv, k) for lv in range(len(self._tiers))) for k, p in zip(keys, placed))
        return PutResult(tuple(keys), ok_t)

    def _hold_source(self, plan: _Plan, level: int, key: bytes, ctx: AccessContext | None) -> bool:
        """Pin ``key`` where it is read from, for the life of ``plan``; False if it is no longer there."""
        tier = self._tiers[level]
        if isinstance(tier, FilesystemTier):
            if tier.pin(key):
                plan.pinned_fs.append(key)
                return True
            return False
        if not tier.is_ready(key):
            return False
        tier.touch(key, ctx)
        tier.pin(key)
        plan.reserved.append((level, key))
        return True

    def _load(self, keys: list[bytes], outs: list[torch.Tensor] | None, ctx: AccessContext | None) -> LoadResult:
        with self._plan_lock:
            return self._load_locked(keys, outs, ctx)

    def _load_locked(self, keys: list[bytes], outs: list[torch.Tensor] | None,
                     ctx: AccessContext | None) -> LoadResult:
        # Pin the whole leading run where it is now, so promoting one key never pushes a later key of the same
        # request down (or out) before it is read.
        held: list[tuple[int, bytes]] = []
        with self._lock:
            for key in keys:
                levels = [lv for lv in range(len(self._tiers)) if self._holds(lv, key)]
                if not levels:
                    break
                for lv in levels:
                    if self._tiers[lv].pin(key):
                        held.append((lv, key))
        try:
            return self._load_pinned(keys, outs, ctx)
        finally:
            with self._lock:
                for lv, key in held:
                    self._tiers[lv].unpin(key)
            self._update_occupancy()

    def _load_pinned(self, keys: list[bytes], outs: list[torch.Tensor] | None,
                     ctx: AccessContext | None) -> LoadResult:
        plan = _Plan()
        failed: dict[bytes, str] = {}
        sources: list[str] = []
        stopped: str | None = None
        for i, key in enumerate(keys):
            with self._lock:
                level = next((lv for lv in range(len(self._tiers)) if self._holds(lv, key)), None)
                if level is None:
                    stopped = "miss"
                    break
                src_tier = self._tiers[level]
                if isinstance(src_tier, FilesystemTier) and level > 0 and self.cost_model is not None:
                    path = [t.name for t in self._tiers[1 : level + 1]]
                    if not self.cost_model.worth_promoting(path, self.block_nbytes):
                        metrics.PROMOTIONS_SKIPPED.labels(src_tier.name).inc()
                        stopped = "skipped"
                        break
                self._hold_source(plan, level, key, ctx)
            reached, lost = level, False
            for up in range(level - 1, -1, -1):
                below = self._tiers[up + 1]
                upper = self._tiers[up]
                with self._lock:
                    if isinstance(upper, MemoryTier) and key in upper:
                        if not upper.is_ready(key):
                            break  # another plan is filling it there: read from where it is ready
                        self._hold_source(plan, up, key, ctx)  # appeared meanwhile: hold it for our read
                        reached = up
                        continue
                    src = _FROM_FS if isinstance(below, FilesystemTier) else below.view(key)
                    done = self._place(up, key, src, below.name, plan, ctx)
                if not done and len(plan.reserved) > 1:
                    # Upper tier full of this batch's blocks: finish them (and this key's lower hops) first.
                    plan = self._flush(plan, failed)
                    if key in failed:
                        break
                    with self._lock:
                        if not self._hold_source(plan, up + 1, key, ctx):
                            lost = True  # evicted by another plan between the two flushes
                            break
                        src = _FROM_FS if isinstance(below, FilesystemTier) else below.view(key)
                        done = self._place(up, key, src, below.name, plan, ctx)
                if not done:
                    break
                reached = up
            if key in failed:
                break
            if lost:
                stopped = "miss"
                break
            if isinstance(self._tiers[reached], FilesystemTier):
                # No memory tier can take it (all held by this request): read it straight into a CPU output.
                if outs is None or outs[i].device.type != "cpu":
                    stopped = "no-room"
                    break
                plan.transfers.append(_Transfer(-1, key, _FROM_FS, outs[i], self._tiers[reached].name, ENGINE))
                sources.append(src_tier.name)
                continue
            if outs is not None:
                with self._lock:
                    view = self._tiers[reached].view(key)
                plan.transfers.append(_Transfer(-1, key, view, outs[i], self._tiers[reached].name, ENGINE))
            sources.append(src_tier.name)
        self._flush(plan, failed)
        hits = len(sources)
        for i, key in enumerate(keys[:hits]):
            if key in failed:
                hits, stopped = i, failed[key]
                break
        if hits < len(keys) and stopped is None:
            stopped = failed.get(keys[hits], "miss")
        return LoadResult(hits, tuple(sources[:hits]), stopped if hits < len(keys) else None)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
