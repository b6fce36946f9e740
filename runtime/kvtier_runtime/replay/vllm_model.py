"""Replay of a recording as the recorded vLLM engine served it: vLLM's own prefix cache, then kvtier's tiers.

``kvtier replay --trace RECORDING`` without capacity or policy flags uses this model (docs/replay.md, "Fidelity");
the generic model of :mod:`.engine` answers "what would these tiers serve" for any trace. What this one follows,
each point a way vLLM 0.32/0.33 with kvtier's offloading spec differs from the generic model:

* **Device tier first.** vLLM's prefix cache (v1 ``BlockPool``) answers before any offloading tier: a request's
  leading run of blocks still cached on the device is a device hit and kvtier is never asked about it (so the
  host tier's policy does not see that access at all). Capacity is the engine's GPU block count less vLLM's null
  block, in offload chunks; one request runs at a time (the recording is replayed in order), its blocks are
  pinned while it runs and it takes one block beyond its full chunks (the partial last block or the first
  generated token). Eviction is vLLM's free-block queue: a finished request's blocks are freed tail first, so
  its head is the most recently used; blocks without a hash (the partial block) are reused before any cached one;
  a device hit takes its block out of the queue until the request ends. A block recomputed while an older copy
  is still queued is held twice (vLLM keeps both), as vLLM does.
* **Lookups stop at the first miss.** vLLM's connector asks kvtier for the chunks after the device hit, one by
  one, and stops at the first chunk no tier holds; only that leading run is loaded and counted.
* **A host hit is not a use** unless the host policy is request-aware (``lru``): kvtier's manager tells a
  non-request-aware policy only of stores and promotions (vLLM's connector calls no ``touch`` on hits). A
  filesystem hit promotes the chunk into the host tier (an insert there, a use of the filesystem tier's entry).
* **Stores are chunk-level and skip what a tier holds.** After a request with an offloaded hit, vLLM offers only
  the chunks after the loaded ones; after one without, every chunk of the prompt (device hits included). kvtier
  stores into the host tier the offered chunks no tier holds (a chunk held only on disk is not copied back), as a
  prefix cut at the first one the admission filter declines, and writes each stored chunk through to every
  filesystem tier that lacks it.
* **A stored chunk is pinned until its write-through lands.** kvtier keeps a chunk it stored into the host tier
  pinned (not evictable) until every filesystem tier has it; the write-through runs on I/O threads while the
  engine goes on, and a request's chunks (megabytes each) are still being written when the next request, sent
  once the previous one answered, looks up, promotes and stores. The model keeps a request's stored chunks pinned
  through the next ``WRITE_THROUGH_REQUESTS`` requests (none without a filesystem tier). It matters for a policy
  that evicts new chunks first (``prefix2q``): with them pinned it evicts reused ones instead.
* **Prompt only.** The recording holds the prompt's full chunks; generated tokens are not offloaded
  (``offload.promptOnly``), and a prompt's partial last block is never a chunk.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..policies import AccessContext, EvictionPolicy

# Blocks a running request holds beyond its prompt's full chunks: its partial last block or its first generated
# token's slot (vLLM allocates the prompt's blocks and one for the token after it).
EXTRA_BLOCKS_PER_REQUEST = 1
DEVICE = -2  # the serving "tier" of a device hit in the served list (-1 stays a miss)
# Requests after its own through which a request's stored chunks stay pinned in the host tier (their write-through to
# the filesystem tiers in flight). 1 matched the engine test (tests/engine/test_engine_replay_fidelity.py): prefix2q
# on the host tier came within 0.01 of the engine with 1, 0.044 off with 0; adaptive the same with 0 or 1.
WRITE_THROUGH_REQUESTS = 1


class VllmPrefixCache:
    """vLLM's GPU prefix cache as its free-block queue orders it, one running request at a time."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"device capacity: {capacity_blocks} must be at least 1 block")
        self.capacity = capacity_blocks
        self._queue: OrderedDict[int, object] = OrderedDict()  # cached free blocks, evicted from the left
        self._where: dict[object, list[int]] = {}  # key -> its cached blocks (vLLM may hold a key twice)
        self._next = 0

    def __contains__(self, key: object) -> bool:
        return bool(self._where.get(key))

    def __len__(self) -> int:
        return len(self._queue)

    def hit_run(self, keys: Sequence[object]) -> int:
        n = 0
        for key in keys:
            if not self._where.get(key):
                break
            n += 1
        return n

    def serve(self, keys: Sequence[object], hits: int, extra: int = EXTRA_BLOCKS_PER_REQUEST) -> None:
        """Run one request whose first ``hits`` keys were device hits, to its end (its blocks freed)."""
        pinned = []
        for key in keys[:hits]:
            block = self._where[key][0]
            del self._queue[block]
            pinned.append(block)
        need = len(keys) - hits + extra
        uncached = self.capacity - len(self._queue) - hits
        for _ in range(min(max(0, need - uncached), len(self._queue))):
            block, old = self._queue.popitem(last=False)
            self._drop(block, old)
        blocks = pinned
        for key in keys[hits:]:
            block = self._next
            self._next += 1
            self._where.setdefault(key, []).append(block)
            blocks.append(block)
        # Freed tail first: the request's head ends up the most recently used.
        for key, block in zip(reversed(keys), reversed(blocks)):
            self._queue[block] = key
        while len(self._queue) > self.capacity:  # a request larger than the cache (vLLM would not run it whole)
            block, old = self._queue.popitem(last=False)
            self._drop(block, old)

    def _drop(self, block: int, key: object) -> None:
        copies = self._where[key]
        copies.remove(block)
        if not copies:
            del self._where[key]


def engine_context(request: int, pos: int, tokens_per_block: int) -> AccessContext:
    """The context kvtier's manager hands its policies for a request's chunk: the request and the chunk's
    end-token position (vLLM's offload key position), without the request's length."""
    return AccessContext(request, (pos + 1) * tokens_per_block)


def replay_engine_tiers(requests: Sequence[Sequence[int]], device: VllmPrefixCache | None,
                        tiers: list[EvictionPolicy], tokens_per_block: int = 1,
                        write_through_requests: int = WRITE_THROUGH_REQUESTS) -> tuple[list[int], list[int]]:
    """Serve ``requests`` in order; per access the serving tier (``DEVICE``, an index into ``tiers``, or -1 for a
    chunk computed) and per offload tier the chunks stored into it. Each tier sees the calls kvtier's manager
    makes (:class:`~kvtier_runtime.store.books.OffloadBooks`), with the manager's contexts. A request's chunks
    stored into the host tier stay pinned through the next ``write_through_requests`` requests when there is a
    tier to write them through to (0: the write-through lands at once)."""
    if write_through_requests < 0:
        raise ValueError(f"write_through_requests: {write_through_requests} must be 0 or more")
    served: list[int] = []
    stored = [0] * len(tiers)
    host, lower = tiers[0], tiers[1:]
    aware = bool(getattr(host, "request_aware", False))
    writing: list[list[int]] = []  # per recent request, its stored chunks still pinned (oldest request first)
    for rid, req in enumerate(requests):
        while len(writing) > write_through_requests:  # that request's write-through has landed
            for key in writing.pop(0):
                if key in host and host.is_pinned(key):
                    host.unpin(key)
        n = len(req)
        h = device.hit_run(req) if device is not None else 0
        served.extend([DEVICE] * h)
        used: list[int] = []  # chunks the request read or was offered (request-aware host policies)
        external = 0
        for pos in range(h, n):  # vLLM asks chunk by chunk after the device hit, up to the first miss
            key = req[pos]
            if key in host:  # a host hit: not a use of the entry (the load pins it), unless request-aware
                served.append(0)
                if aware:
                    host.touch(key, engine_context(rid, pos, tokens_per_block))
                    used.append(key)
                external += 1
                continue
            tier = next((i for i, p in enumerate(lower, start=1) if key in p), -1)
            if tier < 0:
                break
            ctx = engine_context(rid, pos, tokens_per_block)
            # The promotion: a host slot (admission, then an insert that may evict), then the tier's load.
            if not host.admit(key, 1, ctx) or host.insert(key, 1, ctx) is None:
                break  # no room: the manager answers a miss
            stored[0] += 1
            tiers[tier].touch(key, ctx)
            served.append(tier)
            external += 1
        served.extend([-1] * (n - h - external))
        if device is not None:
            device.serve(req, h)
        # vLLM's chunk-level stores: after an offloaded hit, the chunks after it; else the whole prompt.
        first = h + external if external else 0
        offer = req[first:]
        new: list[tuple[int, int]] = []
        for pos in range(first, n):
            key = req[pos]
            if key in host:
                if aware:
                    host.touch(key, engine_context(rid, pos, tokens_per_block))
                    used.append(key)
                continue
            if any(key in p for p in lower):
                continue  # held on disk: not copied back
            new.append((pos, key))
        admitted = [host.admit(key, 1, engine_context(rid, pos, tokens_per_block)) for pos, key in new]
        if False in admitted:
            new = new[:admitted.index(False)]
        # Room for the whole store at once, never by evicting a chunk of this offer; no room: nothing stored.
        need = len(new) - host.free_bytes
        pinned: list[int] = []
        if new and (need <= 0 or host.evict(need, set(offer)) is not None):
            for pos, key in new:
                host.insert(key, 1, engine_context(rid, pos, tokens_per_block))
                stored[0] += 1
                if aware:
                    used.append(key)
            for i, p in enumerate(lower, start=1):  # the write-through, without a request's context
                for _, key in new:
                    if key not in p and p.admit(key, 1) and p.insert(key, 1) is not None:
                        stored[i] += 1
            if lower and write_through_requests:
                for _, key in new:
                    host.pin(key)
                    pinned.append(key)
        writing.append(pinned)
        if aware:
            for key in reversed(used):  # the request's end: its head the most recent
                if key in host:
                    host.touch(key, None)
    return served, stored
