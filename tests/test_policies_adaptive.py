"""The adaptive policy's own ordering on hand-worked sequences (the shared contract is in test_policies_contract)."""
from __future__ import annotations

from kvtier_runtime.policies import AccessContext, AdaptivePolicy


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
