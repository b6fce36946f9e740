"""Trace replay through the runtime's own policy classes (kvtier_runtime.policies), one or several tiers.

Model (the hit-ratio definitions of replay.metrics, extended to tiers the way vLLM's tiering works):

* requests in file order; each is the access sequence of its ``hash_ids``; capacity is counted in blocks (each
  block has size 1 in the policy); cold start.
* an access is looked up tier by tier (tier 1 first); the first tier holding the block serves it (a hit of that
  tier, touched there) and the block is promoted into every tier above it (a *promotion* out of the serving tier).
* a miss in every tier is a demand store: each tier's admission filter is offered the block and, if it admits,
  the block is inserted (write-through to every tier, as vLLM stores to all secondary tiers).
* block hit ratio = hits / block accesses; prefix hit ratio = sum over requests of the leading run of hits /
  block accesses, where each block of the leading run is credited to the tier that served it. Only the leading
  run is *loaded* (an engine cannot use KV after a gap); those are the tier's loaded blocks.

Replicas (``replicas > 1``): requests go to replicas in turn (a router without prefix affinity, the case where a
shared tier matters most); every tier is private to its replica (each replica has its own tier of the given
capacity), except the last one when ``shared_last`` is set: one store of that capacity that every replica looks up
and writes through to, as kvtier's remote tier on a Valkey/Redis store.

A recording of kvtier's own traffic replayed as the recorded engine (vLLM's prefix cache first, the engine's
lookup and store rules) is :func:`replay_recorded` (:mod:`.vllm_model`); this model is the one for other sizes.

OPT for tier i is the marginal gain of a single Belady cache of tiers 1..i's combined capacity over one of tiers
1..i-1's, so tier figures add up to the total, and the total is OPT at the combined capacity -- an upper bound
for any hierarchy of that size.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..policies import ADMISSIONS, POLICIES, AccessContext, AdaptivePolicy, EvictionPolicy, get_policy
from .fused import replay_adaptive
from .metrics import flatten, prefix_hit_count
from .opt import opt_hits
from .trace import Trace


class ReplayError(ValueError):
    """A replay option broke a rule; the message names the option."""


@dataclass(frozen=True)
class PolicySpec:
    """An eviction policy with an optional admission filter, spelled ``NAME`` or ``NAME+ADMISSION``."""

    eviction: str
    admission: str = "none"

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        eviction, _, admission = text.partition("+")
        eviction, admission = eviction.strip(), (admission.strip() or "none")
        if eviction not in POLICIES:
            raise ReplayError(f"--policy: {eviction!r} is not one of {', '.join(POLICIES)} (see --list-policies)")
        if admission not in ADMISSIONS:
            raise ReplayError(f"--policy: admission {admission!r} is not one of {', '.join(ADMISSIONS)}")
        return cls(eviction, admission)

    def __str__(self) -> str:
        return self.eviction if self.admission == "none" else f"{self.eviction}+{self.admission}"

    def build(self, capacity_blocks: int) -> EvictionPolicy:
        return get_policy(self.eviction, capacity_blocks, admission=self.admission)


@dataclass
class TierStats:
    name: str
    capacity_blocks: int
    policy: str
    hits: int = 0
    prefix_hits: int = 0  # = blocks loaded from this tier
    promotions: int = 0  # blocks served here and copied into the tiers above
    stored_blocks: int = 0
    opt_hits: int = 0
    opt_prefix_hits: int = 0  # marginal: OPT(tiers 1..i) - OPT(tiers 1..i-1)
    opt_prefix_hits_through: int = 0  # OPT at the combined capacity of tiers 1..i
    # vLLM's own prefix cache (the recorded-engine model): no offloading traffic, no offloading cost or saving.
    device: bool = False


@dataclass
class ReplayResult:
    n_requests: int
    n_accesses: int
    n_distinct: int
    tiers: list[TierStats]
    seconds: float
    opt_seconds: float = 0.0
    hits: list[bool] = field(default_factory=list, repr=False)

    @property
    def accesses_per_second(self) -> float:
        return self.n_accesses / self.seconds if self.seconds > 0 else float("inf")

    def ratio(self, count: int) -> float:
        return count / self.n_accesses if self.n_accesses else 0.0

    @property
    def total_hits(self) -> int:
        return sum(t.hits for t in self.tiers)

    @property
    def total_prefix_hits(self) -> int:
        return sum(t.prefix_hits for t in self.tiers)

    @property
    def total_opt_prefix_hits(self) -> int:
        return sum(t.opt_prefix_hits for t in self.tiers)


def capacity_blocks(text: str, n_distinct: int, option: str = "--capacity") -> int:
    """``N`` blocks or ``N%`` of the trace's distinct blocks (rounded to the nearest block, at least 1); errors
    name ``option``."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            pct = float(raw[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            return max(1, int(round(n_distinct * pct / 100)))
        value = int(raw)
        if value <= 0:
            raise ValueError
        return value
    except ValueError:
        raise ReplayError(f"{option}: {text!r} must be a positive number of blocks or a percentage in (0, 100]%") from None


def replay_single(requests: Sequence[Sequence[int]], policy: EvictionPolicy) -> tuple[list[bool], int]:
    """The hot path: one tier, every block size 1; the hit flag of every access and the number of stores."""
    hits: list[bool] = []
    stored = 0
    append = hits.append
    touch, admit, insert = policy.touch, policy.admit, policy.insert
    if policy.admission is None and not policy.uses_context:
        for req in requests:
            for key in req:
                if touch(key):
                    append(True)
                else:
                    append(False)
                    insert(key, 1)  # size 1 always fits: nothing is pinned during replay
        return hits, len(hits) - sum(hits)
    use_ctx = policy.uses_context
    if isinstance(policy, AdaptivePolicy):  # the default policy: the same steps in one loop (replay.fused)
        # The loop allocates only acyclic objects (ghost tuples of ints, dict entries): the cyclic collector's
        # passes over the policy's growing dicts find nothing to free and measured a third of its time.
        collecting = gc.isenabled()
        gc.disable()
        try:
            fast = replay_adaptive(policy, requests)
        finally:
            if collecting:
                gc.enable()
        if fast is not None:
            return fast, len(fast) - sum(fast)
    if policy.admission is None:  # a context-aware policy without a filter: every miss is stored
        for rid, req in enumerate(requests):
            n = len(req)
            for pos, key in enumerate(req):
                ctx: AccessContext | None = AccessContext(rid, pos, n)
                if touch(key, ctx):
                    append(True)
                else:
                    append(False)
                    insert(key, 1, ctx)
        return hits, len(hits) - sum(hits)
    for rid, req in enumerate(requests):
        n = len(req)
        for pos, key in enumerate(req):
            ctx = AccessContext(rid, pos, n) if use_ctx else None
            if touch(key, ctx):
                append(True)
            else:
                append(False)
                if admit(key, 1, ctx):
                    insert(key, 1, ctx)
                    stored += 1
    return hits, stored


def _replay_tiers(requests: Sequence[Sequence[int]], stacks: list[list[EvictionPolicy]],
                  stats: list[TierStats]) -> list[int]:
    """Several tiers; ``stacks`` holds one list of tier policies per replica (request i goes to replica
    i mod len(stacks); a shared tier is the same object in every stack). Returns per access the index of the
    serving tier, or -1 for a miss."""
    served: list[int] = []
    use_ctx = any(p.uses_context for stack in stacks for p in stack)
    n_tiers = len(stacks[0])
    n_replicas = len(stacks)
    for rid, req in enumerate(requests):
        policies = stacks[rid % n_replicas]
        n = len(req)
        for pos, key in enumerate(req):
            ctx = AccessContext(rid, pos, n) if use_ctx else None
            tier = -1
            for i in range(n_tiers):
                if policies[i].touch(key, ctx):
                    tier = i
                    break
            if tier >= 0:
                stats[tier].hits += 1
                if tier > 0:
                    stats[tier].promotions += 1
                    for j in range(tier):
                        if key not in policies[j] and policies[j].insert(key, 1, ctx) is not None:
                            stats[j].stored_blocks += 1
            else:
                for j in range(n_tiers):
                    p = policies[j]
                    if p.admit(key, 1, ctx) and p.insert(key, 1, ctx) is not None:
                        stats[j].stored_blocks += 1
            served.append(tier)
    return served


MAX_REPLICAS = 4096


def replay(trace: Trace, capacities: Sequence[int], policies: Sequence[PolicySpec],
           with_opt: bool = True, *, replicas: int = 1, shared_last: bool = False) -> ReplayResult:
    """Replay ``trace`` through tiers of the given capacities (blocks) and policies (one per tier), on
    ``replicas`` replicas whose last tier is one shared store when ``shared_last`` (see the module's doc)."""
    if len(capacities) != len(policies):
        raise ReplayError("--policy: give one policy, or one per --capacity")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise ReplayError(f"--replicas: {replicas!r} must be an integer in [1, {MAX_REPLICAS}]")
    requests = trace.requests
    keys, lengths = flatten(requests)
    n_distinct = len(set(keys))
    stats = [TierStats(f"tier{i + 1}", c, str(p)) for i, (c, p) in enumerate(zip(capacities, policies))]
    if shared_last:
        stats[-1].name += " (shared)"
    shared = policies[-1].build(capacities[-1]) if shared_last else None
    stacks = [[spec.build(cap) for spec, cap in zip(policies, capacities)] for _ in range(replicas)]
    if shared is not None:
        for stack in stacks:
            stack[-1] = shared
    start = time.perf_counter()
    if len(capacities) == 1 and replicas == 1:
        hits, stats[0].stored_blocks = replay_single(requests, stacks[0][0])
        served = [0 if h else -1 for h in hits]
        stats[0].hits = sum(hits)
    else:
        served = _replay_tiers(requests, stacks, stats)
        hits = [s >= 0 for s in served]
    seconds = time.perf_counter() - start
    _credit_prefix(served, lengths, stats)
    opt_seconds = _opt(stats, keys, lengths, replicas, shared_last) if with_opt else 0.0
    return ReplayResult(len(requests), len(keys), n_distinct, stats, seconds, opt_seconds, hits)


def _opt(stats: list[TierStats], keys: list[int], lengths: list[int], replicas: int = 1,
         shared_last: bool = False) -> float:
    """Fill each tier's OPT figures (see the module's doc); returns the seconds it took."""
    t0 = time.perf_counter()
    cumulative = 0
    prev_hits = prev_prefix = 0
    for i, st in enumerate(stats):
        # The bound of a hierarchy holding this many blocks in all: private tiers count once per replica.
        private = not (shared_last and i == len(stats) - 1)
        cumulative += st.capacity_blocks * (replicas if private else 1)
        oh = opt_hits(keys, cumulative)
        h, ph = sum(oh), prefix_hit_count(oh, lengths)
        st.opt_hits, st.opt_prefix_hits = h - prev_hits, ph - prev_prefix
        st.opt_prefix_hits_through = ph
        prev_hits, prev_prefix = h, ph
    return time.perf_counter() - t0


def replay_recorded(trace: Trace, capacities: Sequence[int], policies: Sequence[PolicySpec],
                    device_blocks: int | None = None, with_opt: bool = True,
                    names: Sequence[str] | None = None, tokens_per_block: int = 1) -> ReplayResult:
    """Replay a recording as the recorded vLLM engine served it (:mod:`.vllm_model`): vLLM's prefix cache of
    ``device_blocks`` chunks first (left out when ``None``: unknown), then the offload tiers of the given
    capacities and policies. Tier figures are prefix figures: the engine loads only a leading run, so a chunk
    after a request's first miss is never looked up and never counts as a hit."""
    from .vllm_model import DEVICE, VllmPrefixCache, replay_engine_tiers

    if len(capacities) != len(policies):
        raise ReplayError("--policy: give one policy, or one per --capacity")
    if device_blocks is not None and (isinstance(device_blocks, bool) or not isinstance(device_blocks, int)
                                      or device_blocks < 1):
        raise ReplayError(f"device_blocks: {device_blocks!r} must be a positive number of chunks")
    requests = trace.requests
    keys, lengths = flatten(requests)
    names = list(names) if names is not None else [f"tier{i + 1}" for i in range(len(capacities))]
    stats = [TierStats(name, c, str(p)) for name, c, p in zip(names, capacities, policies)]
    device = VllmPrefixCache(device_blocks) if device_blocks is not None else None
    start = time.perf_counter()
    built = [spec.build(cap) for spec, cap in zip(policies, capacities)]
    served, stored = replay_engine_tiers(requests, device, built, tokens_per_block)
    seconds = time.perf_counter() - start
    for st, n in zip(stats, stored):
        st.stored_blocks = n
    if device is not None and device_blocks is not None:
        stats.insert(0, TierStats("device", device_blocks, "vllm prefix cache", device=True))
        served = [0 if s == DEVICE else (s + 1 if s >= 0 else s) for s in served]
    for s in served:
        if s >= 0:
            stats[s].hits += 1
            stats[s].prefix_hits += 1
            if s > (1 if device is not None else 0):
                stats[s].promotions += 1
    opt_seconds = _opt(stats, keys, lengths) if with_opt else 0.0
    return ReplayResult(len(requests), len(keys), len(set(keys)), stats, seconds, opt_seconds,
                        [s >= 0 for s in served])


def _credit_prefix(served: Sequence[int], lengths: Sequence[int], stats: list[TierStats]) -> None:
    start = 0
    for n in lengths:
        for j in range(start, start + n):
            tier = served[j]
            if tier < 0:
                break
            stats[tier].prefix_hits += 1
        start += n
