"""Each policy's own ordering, on small hand-worked sequences (the shared contract is in test_policies_contract)."""
from __future__ import annotations

from kvtier_runtime.policies import DoorkeeperAdmission, ThresholdAdmission, get_policy


def fill(policy, keys, size=1):
    for k in keys:
        assert policy.insert(k, size) is not None


def test_lru_evicts_least_recently_used_and_skips_pinned() -> None:
    p = get_policy("lru", 3)
    fill(p, [1, 2, 3])
    p.touch(1)
    assert p.insert(4, 1) == [2]
    p.pin(3)
    assert p.insert(5, 1) == [1]
    assert p.evict(2, protected={5}) is None
    assert p.evict(1, protected={5}) == [4]


def test_lru_bytes_evicts_as_many_entries_as_needed() -> None:
    p = get_policy("lru", 10)
    fill(p, [1, 2, 3], size=3)
    assert p.insert(4, 5) == [1, 2]
    assert p.used_bytes == 8


def test_s3fifo_demotes_one_hit_wonders_before_reused_blocks() -> None:
    # 10 entries, small queue 1 entry: a scan of new keys must not push out keys hit while on probation.
    p = get_policy("s3fifo", 10)
    fill(p, range(10))
    for k in range(5):
        p.touch(k)
    for k in range(100, 130):  # a scan of one-off blocks
        p.insert(k, 1)
    assert all(k in p for k in range(5)), sorted(p)


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    p = get_policy("s3fifo", 10)
    fill(p, range(10))
    p.insert(10, 1)  # evicts 0 from small into the ghost list
    assert 0 not in p
    p.insert(0, 1)
    assert 0 in p._main


def test_arc_ghost_hit_enters_frequency_list_and_grows_recency_target() -> None:
    p = get_policy("arc", 4)
    fill(p, [1, 2, 3, 4])
    p.touch(3)
    p.touch(4)  # T1 = [1, 2], T2 = [3, 4]
    assert p.insert(5, 1) == [1]
    assert p._p == 0
    p.insert(1, 1)  # B1 hit: T1 was too small
    assert p._p > 0 and 1 in p._t2


def test_arc_resists_a_scan() -> None:
    p = get_policy("arc", 8)
    for _ in range(2):
        for k in range(4):
            if not p.touch(k):
                p.insert(k, 1)
    for k in range(100, 140):
        p.insert(k, 1)
    assert all(k in p for k in range(4))


def test_doorkeeper_admits_on_second_offer_within_window() -> None:
    p = get_policy("lru", 100, admission=DoorkeeperAdmission(window=8))
    assert p.admit(1, 1) is False
    assert p.admit(1, 1) is True
    for k in range(10, 20):  # window passes: the doorkeeper forgets key 2's first offer
        p.admit(k, 1)
    assert p.admit(2, 1) is False


def test_threshold_admits_on_nth_offer_and_forgets_oldest() -> None:
    p = get_policy("s3fifo", 100, admission=ThresholdAdmission(n=3, max_tracked=2))
    assert [p.admit(7, 1) for _ in range(3)] == [False, False, True]
    p.admit(1, 1)
    p.admit(2, 1)
    p.admit(3, 1)  # key 1 falls out of the bounded table
    assert p.admit(1, 1) is False


def test_registry_names_match_the_config_contract() -> None:
    from kvtier_runtime import config
    from kvtier_runtime.policies import ADMISSIONS, POLICIES

    assert set(config.EVICTION_POLICIES) <= set(POLICIES)
    assert config.DEFAULT_EVICTION_POLICY in POLICIES
    assert config.RECOMMENDED_EVICTION_POLICY in POLICIES
    assert set(config.ADMISSION_POLICIES) == set(ADMISSIONS)


def test_prefix2q_evicts_first_timers_before_blocks_seen_again() -> None:
    from kvtier_runtime.policies import AccessContext

    p = get_policy("prefix2q", 4)
    fill(p, [1, 2])
    p.touch(1)
    p.touch(2)  # class 2
    fill(p, [3, 4])  # class 1, newer
    assert p.insert(5, 1) == [3]
    assert p.insert(6, 1) == [4]
    assert p.remove(5) and p.remove(6)
    # 3 left the cache but the history remembers it: back in, it ranks with the reused blocks.
    p.insert(3, 1)
    p.insert(7, 1)
    assert p.insert(8, 1, AccessContext("r", 0, 1)) == [7]


def test_prefix2q_drops_a_requests_tail_before_its_head() -> None:
    from kvtier_runtime.policies import AccessContext

    p = get_policy("prefix2q", 4)
    for pos, key in enumerate([10, 11, 12, 13]):
        p.insert(key, 1, AccessContext("a", pos, 4))
    assert p.insert(20, 1, AccessContext("b", 0, 1)) == [13]
    assert p.evict(2) == [12, 11]
