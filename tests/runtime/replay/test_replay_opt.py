"""Belady OPT/MIN against an exhaustive search, and the prefix-hit definition on hand-worked cases."""
from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier_runtime.replay.metrics import prefix_hit_count
from kvtier_runtime.replay.opt import NEVER, next_uses, opt_hits


def brute_force_max_hits(keys: list[int], capacity: int) -> int:
    """Try every eviction choice (demand insertion: every miss is inserted, one victim when full)."""

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {v}) | {k}) for v in cache)

    return best(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.integers(0, 5), max_size=14), capacity=st.integers(1, 4))
def test_opt_matches_brute_force(keys: list[int], capacity: int) -> None:
    assert sum(opt_hits(keys, capacity)) == brute_force_max_hits(keys, capacity)


def test_opt_matches_brute_force_on_longer_random_strings() -> None:
    rng = random.Random(7)
    for _ in range(40):
        keys = [rng.randrange(8) for _ in range(rng.randrange(10, 22))]
        capacity = rng.randrange(1, 5)
        assert sum(opt_hits(keys, capacity)) == brute_force_max_hits(keys, capacity), (keys, capacity)


@given(keys=st.lists(st.integers(0, 6), max_size=40))
def test_next_uses_against_a_linear_scan(keys: list[int]) -> None:
    expected = []
    for i, k in enumerate(keys):
        expected.append(next((j for j in range(i + 1, len(keys)) if keys[j] == k), NEVER))
    assert next_uses(keys) == expected


def test_opt_heap_compaction_keeps_results_on_a_long_string() -> None:
    rng = random.Random(1)
    keys = [rng.randrange(50) for _ in range(5000)]
    hits = opt_hits(keys, 3)  # capacity 3: the heap is compacted many times
    assert sum(hits) >= sum(1 for a, b in zip(keys, keys[1:]) if a == b)


@pytest.mark.parametrize(("hits", "lengths", "expected"), [
    ([True, True, False, True], [4], 2),
    ([False, True, True], [3], 0),
    ([True, False, True, True, True], [2, 3], 4),
    ([], [], 0),
])
def test_prefix_hits_count_only_the_leading_run(hits, lengths, expected) -> None:
    assert prefix_hit_count(hits, lengths) == expected
