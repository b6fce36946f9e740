"""The adaptive policy's own ordering on hand-worked sequences (the shared contract is in test_policies_contract)."""
from __future__ import annotations

import dataclasses

from kvtier_runtime.policies import AccessContext, AdaptivePolicy, LRUPolicy
from kvtier_runtime.replay.fused import replay_adaptive


def access(p: AdaptivePolicy, rid: int, keys: list[int]) -> list[int]:
    """One request through the policy as replay drives it; the keys evicted."""
    evicted = []
    for pos, k in enumerate(keys):
        ctx = AccessContext(rid, pos, len(keys))
        if not p.touch(k, ctx):
            evicted += p.insert(k, 1, ctx)
    return evicted


class Flat(AdaptivePolicy):
    """Equal, fixed weights: must be exactly leaf-first LRU."""

    initial_weights = (1.0, 1.0, 1.0)
    learning_rate = 0.0


def test_equal_weights_evict_the_oldest_request_tail_first() -> None:
    p = Flat(6)
    access(p, 0, [1, 2, 3])
    access(p, 1, [10, 11, 12])
    # Request 0 is the oldest; its tail (3) goes before its head (1): a head without its tail is still a prefix.
    assert access(p, 2, [20, 21]) == [3, 2]
    assert 1 in p and 3 not in p


def test_a_hit_request_becomes_young_again() -> None:
    p = Flat(6)
    access(p, 0, [1, 2, 3])
    access(p, 1, [10, 11, 12])
    access(p, 2, [1, 2])  # request 0's prefix is reused
    # 3 was not reused by request 2, so it is the stalest block; then request 1 goes, tail first.
    assert access(p, 3, [30, 31]) == [3, 12]


def test_a_prompts_last_block_and_first_timers_go_before_repeats_by_default() -> None:
    p = AdaptivePolicy(8)
    access(p, 0, [1, 2, 3])
    access(p, 1, [1, 2, 3, 4])  # 1-3 are repeats now; 4 is request 1's last block
    access(p, 2, [50, 51, 52])  # first-timers, 52 a last block
    # Young first-timers/tails still age 16-64x faster than the older repeats.
    evicted = access(p, 3, [60, 61, 62])
    assert {1, 2, 3}.isdisjoint(evicted) and 4 in evicted


def test_ghost_hits_slow_down_the_class_they_came_from() -> None:
    p = AdaptivePolicy(4)
    before = p.weights[0]
    for rid in range(40):  # a chat whose next turn always reuses the first-timers just evicted
        access(p, rid, [rid, rid + 1000, rid + 2000])
        access(p, rid + 10_000, [rid + 1000])
    assert p.weights[0] < before


def test_without_request_context_it_is_a_weighted_lru() -> None:
    p = Flat(3)
    for k in (1, 2, 3):
        p.insert(k, 1)
    p.touch(1)
    assert p.insert(4, 1) == [2]


# ---- the hedge against recency (issue 25) ---------------------------------------------------------------------
class Unhedged(AdaptivePolicy):
    hedge_step = 0.0


class Traced(AdaptivePolicy):
    """Remembers the lowest trust it reached."""

    lowest = 1.0

    def _temper(self) -> None:
        super()._temper()
        self.lowest = min(self.lowest, self.trust)


def recency_wins(n: int):
    """Each step: a block read twice and never again (a "repeat" the model protects), a new block, and the new
    block of two steps ago read again. Recency keeps exactly what is reused; the model keeps the dead repeats."""
    for i in range(n):
        yield from (10_000 + i, 10_000 + i, i)
        if i >= 2:
            yield i - 2


def hits(p, keys) -> int:
    n = 0
    for k in keys:
        if p.touch(k):
            n += 1
        else:
            p.insert(k, 1)
    return n


def test_when_recency_wins_trust_falls_and_the_hedge_recovers_most_of_the_loss() -> None:
    lru, unhedged, hedged = LRUPolicy(7), Unhedged(7), Traced(7)
    h_lru, h_model, h_hedged = (hits(p, recency_wins(4000)) for p in (lru, unhedged, hedged))
    assert h_model < h_lru - 200, "the stream must make the unhedged model lose to recency"
    assert hedged.lowest == 0.0, "the hedge went all the way to plain leaf-first LRU at least once"
    assert h_hedged - h_model > (h_lru - h_model) / 3


def test_when_the_model_wins_the_hedge_keeps_it() -> None:
    # At 5 entries the model keeps the live blocks and LRU thrashes (it hits 4,001 of 16,000).
    lru, unhedged, hedged = LRUPolicy(5), Unhedged(5), Traced(5)
    h_lru, h_model, h_hedged = (hits(p, recency_wins(4000)) for p in (lru, unhedged, hedged))
    assert h_model > 1.5 * h_lru
    assert h_hedged == h_model and hedged.lowest == 1.0


def test_trust_zero_is_exactly_leaf_first_lru() -> None:
    p, flat = AdaptivePolicy(6), Flat(6)
    p._trust = 0.0
    p._temper()
    for q in (p, flat):
        access(q, 0, [1, 2, 3])
        access(q, 1, [10, 11, 12])
    assert access(p, 2, [20, 21]) == access(flat, 2, [20, 21]) == [3, 2]


def test_clear_forgets_the_hedge() -> None:
    p = Traced(7)
    hits(p, recency_wins(2000))
    p._trust = 0.3
    p.clear()
    assert p.trust == 1.0 and len(p) == 0


def test_a_running_requests_head_outlives_its_tail() -> None:
    # vLLM's request-aware lru contract: while a request runs, its newest chunks are evicted before its prefix,
    # since a prefix without its tail still serves a hit and a tail without its prefix never does. The same with
    # vLLM's ReqContext as kvtier's CachePolicy plug-in passes it (end-token positions, no request length).
    for ctx_of in (lambda pos: AccessContext("r", pos, 6), lambda pos: AccessContext("r", (pos + 1) * 16)):
        p = AdaptivePolicy(4)
        evicted = []
        for pos, k in enumerate([1, 2, 3, 4, 5, 6]):
            if not p.touch(k, ctx_of(pos)):
                evicted += p.insert(k, 1, ctx_of(pos))
        assert evicted == [4, 5] and {1, 2, 3} <= set(p)


def _public_path(p: AdaptivePolicy, requests) -> list[bool]:
    """Replay through touch/insert with a context per access: the steps the fused loop must reproduce."""
    hits = []
    for rid, req in enumerate(requests):
        for pos, k in enumerate(req):
            ctx = AccessContext(rid, pos, len(req))
            hit = p.touch(k, ctx)
            if not hit:
                p.insert(k, 1, ctx)
            hits.append(hit)
    return hits


def _state(p: AdaptivePolicy) -> tuple:
    """Everything the policy holds (its named state, AdaptivePolicy.snapshot), each container in its order."""
    st = p.snapshot()
    out: list = [p.weights]
    for f in dataclasses.fields(st):
        value = getattr(st, f.name)
        if f.name == "lists":
            value = [list(lst.items()) for lst in value]
        elif isinstance(value, dict):
            value = list(value.items())
        out.append(value)
    return tuple(out)


def _traces():
    import pathlib

    from kvtier_runtime.replay.synth import SHAPES, generate
    from kvtier_runtime.replay.trace import load_trace

    data = pathlib.Path(__file__).resolve().parents[2] / "data"
    yield "shared", load_trace(data / "mooncake-synthetic.jsonl").requests[:1500]
    for shape in SHAPES:
        yield shape, [r["hash_ids"] for r in generate(shape, 600, seed=3)]


def test_the_fused_replay_loop_takes_the_same_steps_as_touch_and_insert() -> None:
    # Same hit flags and the same state afterwards (weights, trust, hedge score, every order), bit for bit, across
    # trace shapes and capacities from a few blocks (constant eviction, ghosts, the hedge's trust moving) up.
    trusts, renormalised = set(), False
    for name, requests in _traces():
        distinct = len({k for r in requests for k in r})
        trace_hits = 0
        for cap in sorted({3, max(4, distinct // 50), max(5, distinct // 10), max(6, distinct // 3)}):
            fused, public = AdaptivePolicy(cap), AdaptivePolicy(cap)
            half = len(requests) // 2
            # Each path runs one half, so the second half starts from a state the other path built.
            got = replay_adaptive(fused, requests[:half]) + _public_path(fused, requests[half:])
            want = _public_path(public, requests[:half]) + replay_adaptive(public, requests[half:])
            assert got == want, (name, cap)
            assert _state(fused) == _state(public), (name, cap)
            trace_hits += sum(got)
            trusts.add(fused.trust)
            renormalised |= fused.snapshot().evictions >= 1024
        assert trace_hits > 0, name  # a trace that never hits would compare nothing interesting
    # The rare branches were taken somewhere: the hedge lowered trust, and the weights were renormalised.
    assert min(trusts) < 1.0 and renormalised


def test_the_fused_replay_loop_declines_what_it_does_not_model() -> None:
    from kvtier_runtime.policies.admission import DoorkeeperAdmission

    p = AdaptivePolicy(8)
    p.insert(1, 1)
    p.pin(1)
    assert replay_adaptive(p, [[1, 2]]) is None and p.used_bytes == 1  # pinned: nothing done
    assert replay_adaptive(AdaptivePolicy(8, admission=DoorkeeperAdmission()), [[1]]) is None


def test_the_fused_replay_loop_declines_sizes_and_subclasses_it_does_not_model() -> None:
    # The loop counts entries for bytes: one block larger than a byte and it must leave the state alone.
    p = AdaptivePolicy(8)
    p.insert(1, 2)
    before = _state(p)
    assert replay_adaptive(p, [[1, 2, 3]]) is None and _state(p) == before
    # A subclass that tempers its weights another way would be bypassed by the loop's inlined tempering.
    assert replay_adaptive(Traced(8), [[1]]) is None

    class Unbounded(AdaptivePolicy):
        max_weight_ratio = 0.5  # under 1: the loop's shortcut for the bound would not hold

    assert replay_adaptive(Unbounded(8), [[1]]) is None
    # The default policy, fresh or after public steps of unit blocks, takes the loop.
    q = AdaptivePolicy(8)
    assert replay_adaptive(q, [[1, 2]]) == [False, False]
    assert _public_path(q, [[1, 3]]) == [True, False] and replay_adaptive(q, [[3, 4]]) == [True, False]


def test_the_fused_replay_loop_matches_touch_and_insert_on_random_small_traces() -> None:
    # Tiny caches over a few keys: keys repeated inside a request, empty requests, a running request that fills a
    # whole class, constant eviction -- the corners of the loop's cached class heads and inlined bookkeeping.
    import random

    for seed in range(150):
        rng = random.Random(seed)
        universe = rng.randint(3, 60)
        requests = [[rng.randrange(universe) for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 8]))]
                    for _ in range(rng.randint(1, 120))]
        cap = rng.randint(1, 12)
        whole_fused, whole_public = AdaptivePolicy(cap), AdaptivePolicy(cap)
        assert replay_adaptive(whole_fused, requests) == _public_path(whole_public, requests), seed
        assert _state(whole_fused) == _state(whole_public), seed
        fused, public = AdaptivePolicy(cap), AdaptivePolicy(cap)
        cut = rng.randint(0, len(requests))
        got = replay_adaptive(fused, requests[:cut]) + _public_path(fused, requests[cut:])
        want = _public_path(public, requests[:cut]) + replay_adaptive(public, requests[cut:])
        assert got == want and _state(fused) == _state(public), seed
