"""The books of kvtier's vLLM offloading spec: which chunk is where, in the scheduler process (no vllm import).

Tiers: a host tier (:class:`~kvtier_runtime.store.memory_tier.MemoryTier` over the shared
:class:`~kvtier_runtime.engines.host_region.HostRegion`, slots chosen by a kvtier eviction policy) and behind it one
ordered list of tiers (:class:`~kvtier_runtime.tiers.base.Tier`), which the books drive alike whatever their medium:
the vLLM spec puts durable filesystem tiers (:class:`~kvtier_runtime.fs.tier.FilesystemTier`, bounded, checksummed,
optionally compressed) before remote tiers (:class:`~kvtier_runtime.remote.tier.RemoteTier`, a Valkey/Redis store
shared by every replica of the model). Lookup order: host, then the list's order.

Flow, and why it is split this way:

* vLLM's worker copies engine pages <-> host rows (``prepare_store``/``prepare_load`` hand it slot numbers).
* Every chunk that reaches the host tier is also written to each filesystem tier (write-through, from the host
  row, by the tier's own thread pool), so a host eviction never has to wait for a disk write.
* A chunk found only on disk is *promoted* into a host slot by the tier's read threads while ``lookup`` answers
  ``retry``; the engine asks again on its next step and then loads it from the host row like any host hit.
  vLLM 0.32's worker cannot report a failed load (it asserts success), so every disk read -- the only step
  that can meet an I/O error or a corrupt file -- happens here, before vLLM is told ``hit``: a failed read is a
  ``miss`` that vLLM recomputes, counted in :attr:`load_failures`, never a wrong block.

Nothing here blocks on the disk or the network: lookups read in-memory indexes (a remote tier's presence cache; a
key it has not seen yet is probed on its own thread while ``lookup`` answers ``retry``), disk and network work is
queued, completions are collected by :meth:`poll` (called on every lookup/store and at the end of each scheduler
step). Remote tiers see the plain offload key (their store keys carry the model identity); a failed remote read
is counted in :attr:`remote_load_failures` instead of :attr:`load_failures`.

Each tier has a breaker (:mod:`.breaker`, docs/breaker.md): a tier whose loads cost more than recomputing, or that
the control file disables, is bypassed -- lookups skip it (counted), no write-through is queued to it -- while the
other tiers serve; what is in flight finishes as before. Every promotion's busy time feeds its tier's breaker.

Metrics (``kvtier_runtime_*``, labelled by tier name): the books count the host tier's lookups, hits, evictions,
occupancy and capacity, and a filesystem tier's lookups and hits for keys the host tier missed; the filesystem
tiers count their own promotions (disk -> host), demotions (host -> disk), bytes, errors and occupancy. A lookup
vLLM repeats while a promotion runs counts each time it is asked. For the spec's own metrics (``hit_tokens{tier}``,
``lookup_tokens``: what ``kvtier replay`` predicts, measured), :attr:`OffloadBooks.hit_keys` and
``counters["lookup_keys"]`` count settled lookups only (hit or miss), a hit for the tier that held the chunk.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .. import metrics
from ..policies import AccessContext
from ..tiers.base import KeyState, Tier
from ..tiers.jobs import JobResult
from .breaker import BYPASS, PROBE, Breaker, LoadMeter, TierBreakers
from .memory_tier import MemoryTier

log = logging.getLogger(__name__)

HIT, HIT_PENDING, RETRY, MISS = "hit", "hit_pending", "retry", "miss"
HOST, DISK, REMOTE = "host", "disk", "remote"


# What the books count per origin of a tier (``Tier.origin``): a promotion, a write-through stored, one refused.
_COUNTERS = {DISK: ("promotions", "fs_stores", "fs_store_refusals"),
             REMOTE: ("remote_promotions", "remote_stores", "remote_store_refusals")}

# Keys remembered as "the last promotion failed" (each answered miss once): a bound, not a tuning knob.
MAX_FAILED_PROMOTIONS = 4096


@dataclass
class _Promotion:
    key: bytes | _Fence  # a key, or the _Fence that replaced it at a cache reset
    tier: int
    started: float
    probe: bool = False  # the half-open tier's one probe load
    timed: bool = True  # its end is still to be counted in the tier's load cost (not at an expiry)
    t0: float = 0.0  # its start on the breakers' clock


@dataclass
class _WriteThrough:
    keys: tuple[bytes | _Fence, ...]  # a key, or the _Fence that replaced it at a cache reset
    tier: int
    probe: bool = False  # the half-open tier's one probe store job


@dataclass(frozen=True)
class _Fence:
    """The host slot of a key a transfer still used when the cache was reset: not a key any more (lookups miss),
    but the slot stays taken until every transfer that held it has finished."""

    key: bytes
    generation: int


@dataclass(eq=False)
class TierSlot:
    """One tier behind the host tier and what the books keep for it: the tier; its breaker (named as the policy
    names the tier) and that breaker's meter (the tier's load cost); the host rows as the tier sees them (the KV
    dtype its codec quantizes; the same memory); and whether its stores and removals are KV cache events.
    ``index``: its place in the lookup order (a :class:`TierEvent`'s ``tier``)."""

    index: int
    tier: Tier
    breaker: Breaker
    meter: LoadMeter
    rows: torch.Tensor
    events: bool

    @property
    def name(self) -> str:
        return self.breaker.name


class Found(NamedTuple):
    """A lookup's answer (hit, hit_pending, retry, miss) and, for a counted hit, the tier that served the chunk: 0
    the host tier, else 1 + its index in the books' tiers (:meth:`OffloadBooks.served_by` names it)."""

    state: str
    served: int | None = None


@dataclass(frozen=True)
class TierEvent:
    """A KV cache event: ``keys`` were stored in (``removed`` False) or removed from a tier. ``tier`` is -1 for
    the host tier, else the index in the books' ``tiers`` of the tier the keys are announced under (its
    :class:`~kvtier_runtime.tiers.base.EventPlace`). ``metadata_only``: a failed store released keys that were never
    announced as stored (vLLM's convention; no public removal)."""

    keys: tuple[bytes, ...]
    tier: int
    removed: bool
    metadata_only: bool = False


class OffloadBooks:
    """Host slots + the tiers behind them (anything that satisfies ``Tier``: filesystem, remote) for one engine.
    Keys are vLLM's offload keys (bytes); a tier that does not scope keys itself sees them with ``key_suffix`` (a
    digest of the run identity) so different models sharing a directory never mix."""

    def __init__(
        self,
        host: MemoryTier,
        tiers: Sequence[Tier] = (),
        *,
        rows: Sequence[torch.Tensor] | None = None,
        key_suffix: bytes = b"",
        enable_events: bool = False,
        tier_events: Sequence[bool] | None = None,
        breakers: TierBreakers | None = None,
    ) -> None:
        """``tiers``: every tier behind the host tier, in lookup order (the registry builds them in the policy's
        order); a tier index below is an index into this list. ``rows``: per tier, the host rows as that tier sees
        them (the KV dtype its codec quantizes; same memory), the host slab by default. ``tier_events``: per tier,
        whether its stores and removals are KV cache events (with ``enable_events``; default: every tier)."""
        self.host = host
        tiers = list(tiers)
        for tier in tiers:
            if tier.origin not in _COUNTERS:
                raise ValueError(f"tiers: {tier.name} has origin {tier.origin!r}; must be one of "
                                 f"{', '.join(sorted(_COUNTERS))}")
        # A breaker per tier (index 0 the host tier, then tier index + 1): a tier loading slower than recomputing,
        # or disabled by the control file, is bypassed. Default: tiers named as they name themselves, no verdict by
        # cost and no control file, i.e. never bypassed.
        self.breakers = breakers if breakers is not None else TierBreakers(_default_names(host, tiers))
        if len(self.breakers.breakers) != 1 + len(tiers):
            raise ValueError(f"breakers: {len(self.breakers.breakers)} breakers for {1 + len(tiers)} tiers "
                             "(the host tier, then the tiers behind it)")
        views = list(rows) if rows is not None else [host.slab] * len(tiers)
        if len(views) != len(tiers):
            raise ValueError(f"rows: {len(views)} row views for {len(tiers)} tiers (one per tier)")
        self._suffix = key_suffix
        self._promotions: dict[tuple[int, int], _Promotion] = {}  # (tier, fs job id) -> promotion
        self._writes: dict[tuple[int, int], _WriteThrough] = {}
        self._writing: set[bytes] = set()  # keys whose worker store is in flight
        self.load_failures: Counter[str] = Counter()  # by kind: corrupt, missing, eio, ...
        self.remote_load_failures: Counter[str] = Counter()  # by kind: evicted, down, timeout, forged, ...
        self._load_failures_by_origin = {DISK: self.load_failures, REMOTE: self.remote_load_failures}
        # Keys whose promotion just failed: the next lookup answers miss instead of promoting again, so the request
        # that waited recomputes (on a hung disk every promotion times out, and retrying would hold it forever).
        self._promotion_failed: set[bytes] = set()
        self.counters: Counter[str] = Counter()  # promotions, promotion_failures, fs_stores, host_evictions...
        # Settled lookups that hit, by the name of the tier that served the chunk (the breakers' names), and the
        # host-resident keys promoted from a tier (breaker index) whose first hit is still to be counted for it: the
        # one rule of which tier served a chunk, which the spec's load source (vLLM's cached_by_source) and its
        # recording read back through :meth:`find`.
        self.hit_keys: Counter[str] = Counter()
        self._promoted_from: dict[bytes, int] = {}
        self._loading: Counter[bytes] = Counter()  # key -> engine loads in flight (prepare_load not yet completed)
        # Cache resets: the generation, and per fenced key the engine transfers (stores + loads) still holding it.
        self.generation = 0
        self._fenced: dict[_Fence, int] = {}
        self.reset_at = 0.0  # time.monotonic() of the last reset
        # KV cache events: the host tier's when enable_events, a tier's when also tier_events[i] (vLLM's rule for
        # secondary tiers: the global flag and the tier's own ``enable_kv_events``; default: every tier).
        self.events: list[TierEvent] | None = [] if enable_events else None
        wanted = list(tier_events) if tier_events is not None else [True] * len(tiers)
        if len(wanted) != len(tiers):
            raise ValueError(f"tier_events: {len(wanted)} flags for {len(tiers)} tiers (one per tier)")
        # One slot per tier, in lookup order: the tier and everything the books keep for it.
        self.slots: list[TierSlot] = [
            TierSlot(i, tier, self.breakers[i + 1], self.breakers.meters[i + 1], view, enable_events and want)
            for i, (tier, view, want) in enumerate(zip(tiers, views, wanted))]
        self.announced = _Announced(self.slots)
        for slot in self.slots:
            if slot.events:
                slot.tier.record_changes()
            slot.tier.peer = host.name  # promotions/demotions are labelled with the tier they move to or from
        metrics.CAPACITY_BYTES.labels(host.name).set(host.capacity_bytes)
        self._update_occupancy()

    @property
    def tiers(self) -> list[Tier]:
        """The tiers behind the host tier, in lookup order."""
        return [slot.tier for slot in self.slots]

    # ---- keys ---------------------------------------------------------------------------------------------
    def fs_key(self, key: bytes) -> bytes:
        return bytes(key) + self._suffix

    def _tier_key(self, tier: Tier, key: bytes) -> bytes:
        """``key`` as ``tier`` stores it: raw if the tier scopes keys to the model itself, else with the suffix."""
        return bytes(key) if tier.scoped_keys else self.fs_key(key)

    # ---- lookups ------------------------------------------------------------------------------------------
    def lookup(self, key: bytes, ctx: AccessContext | None = None, count: bool = True) -> str:
        """Where ``key`` is: hit, hit_pending, retry (a promotion runs: ask again) or miss. ``count`` False: the
        caller already counted this key's settled lookup (vLLM asks a request's whole prefix again after a retry)."""
        return self.find(key, ctx, count).state

    def find(self, key: bytes, ctx: AccessContext | None = None, count: bool = True) -> Found:
        """:meth:`lookup`, and for a counted hit the tier that served it (:class:`Found`).

        Measured hits per tier (what replay predicts): a lookup counts once it is settled (hit or miss; vLLM asks
        again after retry and hit_pending), and a hit counts for the tier its bytes came from for this load -- the
        first hit after a promotion for the tier it was promoted from, any other for the host tier (the promoted
        row serves it). A caller that keeps ``served`` per request (the spec: vLLM's load source, the recording)
        thus reports each loaded chunk under the tier these counters counted it for."""
        found = self._lookup(key, ctx)
        if not count:
            return Found(found)
        if found == HIT:
            self.counters["lookup_keys"] += 1
            source = self._promoted_from.pop(key, 0) if self._promoted_from else 0
            self.hit_keys[self.breakers[source].name] += 1
            return Found(found, source)
        if found == MISS:
            self.counters["lookup_keys"] += 1
        return Found(found)

    def served_by(self, index: int) -> tuple[str, str]:
        """A :attr:`Found.served` index as (the tier's name, its origin: ``host``, ``disk`` or ``remote``)."""
        if index == 0:
            return self.breakers[0].name, HOST
        slot = self.slots[index - 1]
        return slot.name, slot.tier.origin

    def _lookup(self, key: bytes, ctx: AccessContext | None) -> str:
        self.poll()
        host = self.host
        metrics.LOOKUPS.labels(host.name).inc()
        if self.breakers[0].bypassed:  # the host tier disabled: every tier behind it too (they load through it)
            self._bypassed_lookup(self.breakers[0])
            return MISS
        if key in host:
            if not host.is_ready(key):
                return HIT_PENDING if key in self._writing else RETRY  # a store or a promotion is in flight
            metrics.HITS.labels(host.name).inc()
            return HIT
        if key in self._promotion_failed:
            self._promotion_failed.discard(key)
            return MISS
        for slot in self.slots:
            gate = slot.breaker.load_gate()
            if gate == BYPASS:  # a miss here (not even a presence probe); a later tier may still serve it
                self._bypassed_lookup(slot.breaker)
                continue
            state = slot.tier.probe(self._tier_key(slot.tier, key))  # counted in the tier's lookups and hits
            if state is KeyState.HIT:
                return RETRY if self._promote(key, slot, ctx, probe=gate == PROBE) else MISS
            if state is KeyState.PENDING:  # the tier is asking its store: vLLM asks again next step
                return RETRY
        return MISS

    def _bypassed_lookup(self, breaker: Breaker) -> None:
        self.breakers.bypassed_lookups[breaker.name] += 1

    def _promote(self, key: bytes, slot: TierSlot, ctx: AccessContext | None, probe: bool = False) -> bool:
        reserved = self.host.reserve(key, ctx)
        if reserved is None:
            self.counters["promotion_no_room"] += 1
            return False
        row, victims = reserved
        self._event(self._forget(victims), -1, removed=True)
        self.host.pin(key)
        tier = slot.tier
        job = tier.submit_load([self._tier_key(tier, key)], [slot.rows[row]], ctx)
        self._promotions[(slot.index, job)] = _Promotion(key, slot.index, time.monotonic(), probe=probe,
                                                         t0=self.breakers.clock())
        if probe:
            slot.breaker.probe_started("load")
        self.counters["promotions_started"] += 1
        self._update_occupancy()
        return True

    # ---- loads (host -> engine) -------------------------------------------------------------------------
    @property
    def request_aware(self) -> bool:
        """Whether the host policy orders a request's chunks (``lru``, as vLLM's): it is then told of each chunk a
        request reads or re-offers, and of the request's end (:meth:`request_finished`)."""
        return self.host.policy.request_aware

    def prepare_load(self, keys: Sequence[bytes], ctx: Sequence[AccessContext | None] | None = None) -> list[int]:
        slots = []
        aware = ctx is not None and self.request_aware
        for i, key in enumerate(keys):
            self.host.pin(key)
            self._loading[key] += 1
            slots.append(self.host.slot_of(key))
            c = ctx[i] if aware else None  # type: ignore[index]
            if c is not None and c.request_id is not None:  # a place in a request's prefix: vLLM's request access
                self.host.touch(key, c)
        return slots

    def request_finished(self, keys_head_to_tail: Sequence[bytes], request_id: object = None) -> None:
        """A request ended: its chunks become the most recent, its head most of all (vLLM lru's
        ``on_request_finished``: a finished prefix outlives the tails of requests still running)."""
        if not self.request_aware:
            return
        for key in reversed(keys_head_to_tail):
            if key in self.host:
                self.host.touch(key, None)
        forget = getattr(self.host.policy, "forget_request", None)
        if forget is not None and request_id is not None:
            forget(request_id)

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if self._loading[key] > 0:
                self._loading[key] -= 1
                if not self._loading[key]:
                    del self._loading[key]
                self.host.unpin(key)
            else:  # a load that was in flight at a cache reset: its slot was fenced
                self._release_fenced(key)

    def touch(self, keys: Iterable[bytes], ctx: AccessContext | None = None) -> None:
        for key in keys:
            if key in self.host:
                self.host.touch(key, ctx)

    # ---- stores (engine -> host -> disk) ------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], ctx: AccessContext | Sequence[AccessContext | None] | None = None
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """(keys to store, their host slots, keys evicted to make room), or ``None``: vLLM's contract.

        * Keys already held (host, or a filesystem tier) are skipped.
        * What is stored is a prefix of the rest: the admission filter sees every new key (each offer is
          recorded), and storing stops before the first key it declines. A declined first key is an *empty*
          store (nothing to do, the request goes on), not ``None``.
        * Room is made for the whole prefix at once, never by evicting a key of this offer (one already held,
          or one stored a moment ago by the same request): a store never leaves a hole in its own prefix.
          Not enough evictable room for the whole prefix is ``None`` (vLLM's allocation failure), and nothing
          changes."""
        self.poll()
        if self.breakers[0].bypassed:  # the host tier disabled: nothing is offloaded (an empty store, not None)
            self.breakers.bypassed_stores[self.breakers[0].name] += sum(1 for k in keys if k not in self.host)
            return [], [], []
        contexts = ctx if isinstance(ctx, (list, tuple)) and not isinstance(ctx, AccessContext) else None
        new: list[bytes] = []
        new_ctx: list[AccessContext | None] = []
        aware = self.request_aware
        for i, key in enumerate(keys):
            if key in self.host:
                if aware and self.host.is_ready(key):  # a re-offered chunk is a use by this request
                    c = contexts[i] if contexts is not None else ctx
                    if isinstance(c, AccessContext) and c.request_id is not None:
                        self.host.touch(key, c)
                continue
            if self._on_disk(key):
                continue
            new.append(key)
            new_ctx.append(contexts[i] if contexts is not None else ctx)  # type: ignore[arg-type]
        admitted = [self.host.admit(key, c) for key, c in zip(new, new_ctx)]
        n = admitted.index(False) if False in admitted else len(new)
        if n < len(new):
            self.counters["host_admission_refusals"] += len(new) - n
        to_store, new_ctx = new[:n], new_ctx[:n]
        if not to_store:
            return [], [], []
        reserved = self.host.reserve_run(to_store, new_ctx, protected=set(keys))
        if reserved is None:
            self.counters["host_store_refusals"] += 1
            return None
        slots, victims = reserved
        evicted = self._forget(victims)
        for key in to_store:
            self.host.pin(key)
            self._writing.add(key)
        if evicted:
            self._event(evicted, -1, removed=True)
        self._update_occupancy()
        return to_store, slots, evicted

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        done: list[bytes] = []
        failed: list[bytes] = []
        for key in keys:
            if key not in self._writing:
                self._release_fenced(key)  # a store in flight at a cache reset finished: free its slot
                continue
            self._writing.discard(key)
            self.host.unpin(key)
            if success:
                self.host.mark_ready(key)
                done.append(key)
            else:
                self.host.remove(key)
                failed.append(key)
        if failed:
            self._event(failed, -1, removed=True, metadata_only=True)
            self._update_occupancy()
        if done:
            self._event(done, -1, removed=False)
            self._write_through(done)

    def _write_through(self, keys: list[bytes]) -> None:
        for slot in self.slots:
            tier = slot.tier
            todo = [k for k in keys if tier.needs_store(self._tier_key(tier, k))]
            if not todo:
                continue
            breaker = slot.breaker
            gate = breaker.store_gate()
            if gate == BYPASS:  # an open tier gets no stores: they could not drain, and would pin host rows
                self.breakers.bypassed_stores[breaker.name] += len(todo)
                continue
            for key in todo:
                self.host.pin(key)  # the row must not be reused before the tier has read it
            rows = [slot.rows[self.host.slot_of(k)] for k in todo]
            job = tier.submit_store([self._tier_key(tier, k) for k in todo], rows)
            self._writes[(slot.index, job)] = _WriteThrough(tuple(todo), slot.index, probe=gate == PROBE)
            if gate == PROBE:
                breaker.probe_started("store")

    def _on_disk(self, key: bytes) -> bool:
        """Whether a serving tier covers ``key`` (:meth:`Tier.covers`: a filesystem tier holds it; a bypassed tier's
        copy is not served, so the host tier stores the chunk again)."""
        return any(slot.breaker.serving and slot.tier.covers(self._tier_key(slot.tier, key)) for slot in self.slots)

    def _event(self, keys: Sequence[bytes], tier: int, *, removed: bool, metadata_only: bool = False) -> None:
        """A host tier event (``tier`` -1), unless the host tier is bypassed (its chunks are not announced then:
        :meth:`_show_host`)."""
        if self.events is not None and keys and self.announced.host_shown:
            self.events.append(TierEvent(tuple(keys), tier, removed, metadata_only))

    def _tier_holds(self, slot: TierSlot, keys: Sequence[bytes], held: bool) -> None:
        """``keys`` entered (``held``) or left ``slot``'s tier: announced as a router's index needs them
        (:class:`_Announced`)."""
        if self.events is not None and slot.events and keys:
            self.events.extend(self.announced.update(slot, keys, held))

    def _offload_keys(self, slot: TierSlot, keys: Sequence[bytes]) -> list[bytes]:
        """A tier's keys as offload keys: this run's only (another model's chunks in one directory are not this
        engine's), without the run-identity suffix."""
        if slot.tier.scoped_keys:
            return list(keys)
        n = len(self._suffix)
        return [k[: len(k) - n] if n else k for k in keys if k.endswith(self._suffix)]

    def _show_host(self, shown: bool) -> None:
        """The host tier was bypassed (``shown`` False) or is back: its ready chunks leave or re-enter the index."""
        keys = [k for k in self.host.held_keys() if not isinstance(k, _Fence) and self.host.is_ready(k)]
        if shown:
            self.announced.host_shown = True
            self._event(keys, -1, removed=False)
        else:
            self._event(keys, -1, removed=True)
            self.announced.host_shown = False

    def take_events(self) -> list[TierEvent]:
        """The KV cache events since the last call, oldest first (an eviction precedes the store that reused its
        room); empty unless the books were made with ``enable_events``. A tier its breaker bypasses (too slow,
        or disabled by the control file) is not announced: its chunks leave the index at once and come back when it
        serves again."""
        if self.events is None:
            return []
        self.poll()
        for slot in self.slots:
            if slot.events:
                changes = slot.tier.take_changes()
                self._tier_holds(slot, self._offload_keys(slot, changes.stored), True)
                self._tier_holds(slot, self._offload_keys(slot, changes.removed), False)
        host = self.breakers[0].serving
        if host != self.announced.host_shown:
            self._show_host(host)
        for slot in self.slots:
            if slot.events:
                self.events.extend(self.announced.show(slot, host and slot.breaker.serving))
        events, self.events = self.events, []
        out = []
        for event in events:
            if event.metadata_only:  # a retry may own the key again by now: it was not released after all
                keys = tuple(k for k in event.keys if k not in self.host)
                if not keys:
                    continue
                event = TierEvent(keys, event.tier, event.removed, True)
            out.append(event)
        return out

    def _forget(self, victims: Sequence[tuple[bytes, int]]) -> list[bytes]:
        keys = [k for k, _ in victims]
        for key in keys:
            self._promoted_from.pop(key, None)
        self.counters["host_evictions"] += len(keys)
        if keys:
            metrics.EVICTIONS.labels(self.host.name).inc(len(keys))
        return keys

    def _update_occupancy(self) -> None:
        metrics.OCCUPANCY_BYTES.labels(self.host.name).set(self.host.used_bytes)

    def reset_host(self) -> int:
        """vLLM's ``reset_cache`` (``POST /reset_prefix_cache?reset_external=true``): every host chunk is gone.

        A chunk no transfer holds is dropped. A chunk a transfer still holds (an engine store or load, a promotion
        from disk, a write-through to disk) is *fenced*: from now on a lookup of its key is a miss (so a request
        with the same prompt recomputes and stores it again at once, never waits on a store whose completion
        vLLM will not report), while its slot stays taken until every transfer that held it has finished
        (``complete_store``/``complete_load`` or :meth:`reset_flushed`; disk jobs when they finish). The
        filesystem tiers are durable and keep their chunks. Returns the number of host chunks dropped."""
        self.poll()
        self.generation += 1
        self.reset_at = time.monotonic()
        self._promotion_failed.clear()
        self._promoted_from.clear()
        dropped = 0
        for key in self.host.held_keys():
            if isinstance(key, _Fence):
                continue
            if not self.host.is_pinned(key):
                self.host.remove(key)
                dropped += 1
            else:
                self._fence(key)
        if not len(self.host):
            self.host.reset_slots()
        forget = getattr(self.host.policy, "forget_requests", None)
        if forget is not None:  # a request running across the reset is ranked as a new one (vLLM's lru)
            forget()
        self._update_occupancy()
        return dropped

    def _fence(self, key: bytes) -> None:
        fence = _Fence(key, self.generation)
        self.host.rekey(key, fence)
        engine = self._loading.pop(key, 0) + (1 if key in self._writing else 0)
        self._writing.discard(key)
        if engine:
            self._fenced[fence] = engine
        for (tier, job), promo in list(self._promotions.items()):
            if promo.key == key:
                self._promotions[(tier, job)] = replace(promo, key=fence)
        for write in self._writes.values():
            if key in write.keys:
                write.keys = tuple(fence if k == key else k for k in write.keys)

    def _release_fenced(self, key: bytes) -> None:
        """An engine transfer of ``key`` that was in flight at a reset finished: drop its hold on the fenced slot."""
        for fence in [f for f in self._fenced if f.key == key]:
            self._drop_fence_pin(fence)
            return

    def _drop_fence_pin(self, fence: _Fence, engine: bool = True) -> None:
        if engine:
            self._fenced[fence] -= 1
            if not self._fenced[fence]:
                del self._fenced[fence]
        self.host.unpin(fence)  # type: ignore[arg-type]
        if not self.host.is_pinned(fence):  # type: ignore[arg-type]
            self.host.remove(fence)  # type: ignore[arg-type]
            self._update_occupancy()

    def reset_flushed(self) -> None:
        """vLLM 0.33's ``on_reset_flushed``: the workers reported every job in flight at the last reset, and vLLM
        never completes those jobs: release every engine hold on fenced slots."""
        for fence, n in list(self._fenced.items()):
            for _ in range(n):
                self._drop_fence_pin(fence)

    @property
    def engine_fences(self) -> int:
        """Engine transfers still holding fenced slots."""
        return sum(self._fenced.values())

    @property
    def fenced_slots(self) -> int:
        return sum(1 for k in self.host.held_keys() if isinstance(k, _Fence))

    # ---- completions --------------------------------------------------------------------------------------
    def poll(self) -> None:
        self.breakers.tick()  # at most once a second: the control file, breakers' dwell times
        if not self._promotions and not self._writes:
            return
        for slot in self.slots:
            for result in slot.tier.get_finished():
                self._finish(slot, result)
            self._count_loads(slot)
        if self._promotions:
            self._expire_promotions()

    @staticmethod
    def _count_loads(slot: TierSlot) -> None:
        """Hand the tier's loads that ended since the last call to its breaker, as one sample."""
        sample = slot.meter.take()
        if sample is not None:
            slot.breaker.record(*sample)

    def _load_ended(self, job: int, promo: _Promotion, timed_out: bool) -> None:
        slot = self.slots[promo.tier]
        if promo.timed:
            slot.meter.ended(job, promo.t0, timed_out)
        else:
            slot.meter.forget(job)
        if promo.probe:
            slot.breaker.probe_finished("load")

    def _note_failed_promotion(self, key: bytes) -> None:
        if len(self._promotion_failed) >= MAX_FAILED_PROMOTIONS:  # keys nobody asked for again: forget them
            self._promotion_failed.clear()
        self._promotion_failed.add(key)

    def _expire_promotions(self) -> None:
        """A promotion older than its tier's ``io_timeout_s`` is a miss vLLM recomputes, as the io_timeout_s
        contract says: a hung disk slows the engine, never stops a request. The tier keeps a job whose read goes
        straight into the host row open until that read returns (format 2's direct path cannot call a system call
        back), so the slot is fenced like a reset's: lookups miss, and the slot stays taken until the late read
        has landed in it and the job finishes (``_finish`` then frees it)."""
        now = time.monotonic()
        for (tier_index, job), promo in list(self._promotions.items()):
            slot = self.slots[tier_index]
            tier = slot.tier
            if isinstance(promo.key, _Fence) or now - promo.started <= tier.io_timeout_s:
                continue
            key = promo.key
            self._load_ended(job, promo, timed_out=True)  # its end, for the tier's load cost, is now
            self._count_loads(slot)
            self._promotions[(tier_index, job)] = replace(promo, probe=False, timed=False)
            self._fence(key)
            self._note_failed_promotion(key)
            self._load_failures_by_origin[tier.origin]["timeout"] += 1
            self.counters["promotions_expired"] += 1
            log.warning("kvtier: reading a block from %s took longer than %.3g s; vLLM recomputes it (the host "
                        "slot stays reserved until the read returns)", tier.name, tier.io_timeout_s)

    def _finish(self, slot: TierSlot, result: JobResult) -> None:
        promo = self._promotions.pop((slot.index, result.job_id), None)
        if promo is not None:
            self._load_ended(result.job_id, promo,
                             timed_out=not result.ok[0] and result.errors.get(0) == "timeout")
            key = promo.key
            if isinstance(key, _Fence):  # reset while reading: the bytes are not wanted any more
                self._drop_fence_pin(key, engine=False)
                return
            self.host.unpin(key)
            tier = slot.tier
            if result.ok[0]:
                self.host.mark_ready(key)
                self._promoted_from[key] = slot.index + 1
                self.counters[_COUNTERS[tier.origin][0]] += 1
                self._event([key], -1, removed=False)
            else:
                kind = result.errors.get(0, "other")
                self._load_failures_by_origin[tier.origin][kind] += 1
                self.host.remove(key)
                self._note_failed_promotion(key)
                if not tier.logs_load_faults:  # a remote tier logs its own (an evicted chunk is no incident)
                    log.warning("kvtier: reading a block from %s failed (%s); vLLM recomputes it", tier.name, kind)
                self._update_occupancy()
            return
        write = self._writes.pop((slot.index, result.job_id), None)
        if write is None:
            return
        if write.probe:
            slot.breaker.probe_finished("store")
        stored: list[bytes] = []
        _, stored_counter, refused_counter = _COUNTERS[slot.tier.origin]
        for held, ok in zip(write.keys, result.ok):
            if isinstance(held, _Fence):
                self._drop_fence_pin(held, engine=False)
                key = held.key
            else:
                key = held
                if key in self.host:
                    self.host.unpin(key)
            self.counters[stored_counter if ok else refused_counter] += 1
            if ok:
                stored.append(key)
        self._tier_holds(slot, stored, True)

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
        for slot in self.slots:
            slot.tier.close()

    # ---- observation --------------------------------------------------------------------------------------
    @property
    def host_used_bytes(self) -> int:
        return self.host.used_bytes

    @property
    def host_capacity_bytes(self) -> int:
        return self.host.capacity_bytes


class _Announced:
    """Which chunks the KV cache events said each tier behind the host tier holds, as a router's index needs them.

    llm-d's index keeps one entry per (pod, medium) and no count: every tier behind the host tier is vLLM's STORAGE
    medium, so a chunk a filesystem tier evicts while the remote tier still holds it must not be announced removed,
    and a chunk two tiers hold is announced stored once. Per medium, the books keep which tiers hold each chunk; a
    chunk is announced stored when a tier that serves (its breaker closed) first holds it, and removed when no
    serving tier does -- under the tier that announced it (vLLM's events name the tier: its ``ownership``). A tier
    its breaker bypasses stops counting as a holder (its chunks only it held leave the index) and counts again
    when it serves. Bounded by what the tiers hold."""

    def __init__(self, slots: Sequence[TierSlot]) -> None:
        self._slots = slots
        self._shown = [True] * len(slots)  # per tier: serving as the events last said
        self.host_shown = True
        self._held: dict[str, dict[bytes, set[int]]] = {}  # medium -> chunk -> tiers holding it
        self._owner: dict[tuple[str, bytes], int] = {}  # (medium, chunk) -> the tier it was announced under

    def _medium(self, slot: TierSlot) -> str:
        return slot.tier.event_place.medium

    def _visible(self, holders: set[int] | None) -> bool:
        return bool(holders) and any(self._shown[i] for i in holders)  # type: ignore[union-attr]

    def update(self, slot: TierSlot, keys: Sequence[bytes], held: bool) -> list[TierEvent]:
        medium = self._medium(slot)
        group = self._held.setdefault(medium, {})
        changed: list[tuple[bytes, bool, int]] = []  # (chunk, removed, announced under)
        for key in keys:
            holders = group.get(key)
            before = self._visible(holders)
            if held:
                group.setdefault(key, set()).add(slot.index)
            elif holders is not None:
                holders.discard(slot.index)
                if not holders:
                    del group[key]
            self._transition(medium, key, before, self._visible(group.get(key)), slot.index, changed)
        return _grouped(changed)

    def show(self, slot: TierSlot, shown: bool) -> list[TierEvent]:
        """``slot``'s tier serves (``shown``) or is bypassed, as of now: the chunks whose visibility that changes."""
        if self._shown[slot.index] == shown:
            return []
        medium = self._medium(slot)
        group = self._held.get(medium, {})
        mine = [(key, holders) for key, holders in group.items() if slot.index in holders]
        before = {key: self._visible(holders) for key, holders in mine}
        self._shown[slot.index] = shown
        changed: list[tuple[bytes, bool, int]] = []
        for key, holders in mine:
            self._transition(medium, key, before[key], self._visible(holders), slot.index, changed)
        return _grouped(changed)

    def _transition(self, medium: str, key: bytes, before: bool, after: bool, tier: int,
                    changed: list[tuple[bytes, bool, int]]) -> None:
        if after and not before:
            holders = self._held[medium][key]
            owner = tier if tier in holders and self._shown[tier] else min(i for i in holders if self._shown[i])
            self._owner[(medium, key)] = owner
            changed.append((key, False, owner))
        elif before and not after:
            changed.append((key, True, self._owner.pop((medium, key), tier)))


def _grouped(changed: Sequence[tuple[bytes, bool, int]]) -> list[TierEvent]:
    """Consecutive changes of one kind under one tier as one event each, in order."""
    runs: list[tuple[bool, int, list[bytes]]] = []
    for key, removed, tier in changed:
        if runs and runs[-1][0] == removed and runs[-1][1] == tier:
            runs[-1][2].append(key)
        else:
            runs.append((removed, tier, [key]))
    return [TierEvent(tuple(keys), tier, removed) for removed, tier, keys in runs]


def _default_names(host: MemoryTier, tiers: Sequence[Tier]) -> list[str]:
    """Each tier's own name (made distinct with its index where two share one)."""
    names: list[str] = []
    own = [host.name, *(getattr(t, "name", f"tier{i + 1}") for i, t in enumerate(tiers))]
    for i, name in enumerate(own):
        names.append(name if name not in names else f"{name}#{i}")
    return names
