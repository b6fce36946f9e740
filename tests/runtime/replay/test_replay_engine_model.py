"""The recorded-engine model of ``kvtier replay`` (kvtier_runtime.replay.vllm_model): vLLM's prefix cache in front
of kvtier's tiers, with the lookup and store rules of vLLM's connector and kvtier's manager (docs/replay.md,
"Fidelity"; tests/engine/test_engine_replay_fidelity.py checks it against a real engine)."""
from __future__ import annotations

from kvtier_runtime.replay.engine import PolicySpec, replay_recorded
from kvtier_runtime.replay.trace import Trace
from kvtier_runtime.replay.vllm_model import DEVICE, VllmPrefixCache, engine_context, replay_engine_tiers


def test_a_finished_requests_tail_is_evicted_before_its_head() -> None:
    cache = VllmPrefixCache(5)
    cache.serve([1, 2, 3], 0)  # 4 blocks: 3 cached chunks and the partial block
    assert cache.hit_run([1, 2, 3]) == 3
    cache.serve([7, 8], 0)  # 3 blocks: the free one, then the oldest cached -- the tail of the first request
    assert 3 not in cache and 1 in cache and 2 in cache
    assert cache.hit_run([1, 2, 3]) == 2


def test_a_device_hit_is_pinned_while_its_request_runs() -> None:
    cache = VllmPrefixCache(4)
    cache.serve([1, 2, 3], 0)  # every block used: 3, 2, 1 queued for eviction in that order
    cache.serve([1, 9, 10], 1)  # 1 is in use: the three new blocks come from 3 and 2 only
    assert 1 in cache and 2 not in cache and 3 not in cache
    assert cache.hit_run([1, 9, 10]) == 3 and len(cache) == 3


def test_a_recomputed_chunk_whose_old_copy_is_still_queued_is_held_twice() -> None:
    cache = VllmPrefixCache(10)
    cache.serve([1, 2], 0)
    cache.serve([5, 2], 0)  # 2 is not in the leading run: vLLM computes it into a new block and keeps both
    assert len(cache) == 4 and cache.hit_run([1, 2]) == 2


class Spy:
    """A tier policy that records the calls kvtier's manager would make."""

    def __init__(self, spec: str, capacity: int) -> None:
        self.policy = PolicySpec.parse(spec).build(capacity)
        self.touches: list[object] = []

    def wrap(self):
        policy, touches = self.policy, self.touches
        original = policy.touch

        def touch(key, ctx=None):
            touches.append(key)
            return original(key, ctx)

        policy.touch = touch  # type: ignore[method-assign]
        return policy


def test_a_host_hit_is_a_use_only_for_a_request_aware_host_policy() -> None:
    requests = [[1, 2], [1, 2], [1, 2]]
    for spec, touched in (("adaptive", False), ("lru", True)):
        spy = Spy(spec, 8)
        served, _ = replay_engine_tiers(requests, None, [spy.wrap(), PolicySpec("lru").build(16)], 16)
        assert served == [-1, -1, 0, 0, 0, 0]
        assert bool(spy.touches) is touched, spec


def test_lookups_stop_at_the_first_miss() -> None:
    host = PolicySpec("lru").build(8)
    served, stored = replay_engine_tiers([[1, 2, 3], [1, 9, 3]], None, [host], 16)
    # 3 is held but follows a miss: vLLM never asks for it, the engine recomputes it.
    assert served == [-1, -1, -1, 0, -1, -1] and stored == [4]


def test_disk_hits_are_promoted_and_the_store_after_them_skips_what_was_loaded() -> None:
    host, disk = PolicySpec("lru").build(3), PolicySpec("lru").build(10)
    requests = [[1, 2, 3], [4, 5, 6], [1, 2, 7]]
    # (write-throughs landing at once: each store may evict the previous request's chunks)
    served, stored = replay_engine_tiers(requests, None, [host, disk], 16, write_through_requests=0)
    assert served[6:] == [1, 1, -1]  # 1 and 2 from disk (the host tier holds 4, 5, 6), 7 computed
    assert stored == [3 + 3 + 2 + 1, 7]  # host: the stores and the two promotions; disk: each chunk once
    assert 7 in host and 7 in disk and 1 in host


def test_a_chunk_held_only_on_disk_is_not_copied_back_by_a_store() -> None:
    host, disk = PolicySpec("lru").build(2), PolicySpec("lru").build(10)
    served, _ = replay_engine_tiers([[1, 2], [3, 4], [8, 1]], None, [host, disk], 16, write_through_requests=0)
    assert served[4:] == [-1, -1]  # 8 misses first: nothing is looked up after it
    assert 1 not in host and 8 in host and 1 in disk  # the whole prompt was offered; 1 stayed on disk only


def test_a_stored_chunk_stays_pinned_while_the_next_request_runs_its_write_through_in_flight() -> None:
    # The host tier holds 3; request 0's chunks are still being written to disk while request 1 runs.
    host, disk = PolicySpec("lru").build(3), PolicySpec("lru").build(10)
    _, stored = replay_engine_tiers([[1, 2, 3], [4, 5], [6, 7]], None, [host, disk], 16)
    # request 1 cannot make room (1, 2, 3 pinned): nothing stored, as vLLM's allocation failure; request 2 can
    assert stored == [3 + 0 + 2, 3 + 0 + 2]
    assert 4 not in host and 6 in host and 7 in host and 4 not in disk
    # pinned through one more request only: by request 2, request 0's write-through has landed
    host, disk = PolicySpec("lru").build(3), PolicySpec("lru").build(10)
    _, stored = replay_engine_tiers([[1, 2, 3], [4, 5], [6, 7]], None, [host, disk], 16, write_through_requests=0)
    assert stored == [3 + 2 + 2, 7]


def test_without_a_tier_to_write_through_to_nothing_stays_pinned() -> None:
    host = PolicySpec("lru").build(3)
    _, stored = replay_engine_tiers([[1, 2, 3], [4, 5]], None, [host], 16)
    assert stored == [5] and 4 in host and 5 in host and not host.pinned_bytes


def test_a_store_that_cannot_fit_stores_nothing() -> None:
    host = PolicySpec("lru").build(2)
    _, stored = replay_engine_tiers([[1, 2, 3]], None, [host], 16)
    assert stored == [0] and len(host) == 0  # vLLM's allocation failure: no part of the request is stored


def test_the_managers_context_is_the_chunks_end_token_position() -> None:
    ctx = engine_context(7, 2, 16)
    assert (ctx.request_id, ctx.position, ctx.length) == (7, 48, 1)


def test_replay_recorded_credits_the_device_tier_first() -> None:
    trace = Trace([[1, 2], [1, 2], [1, 3]], [0.0, 1.0, 2.0], [32, 32, 32], [0, 0, 0])
    res = replay_recorded(trace, [4], [PolicySpec("lru")], device_blocks=8, names=["host"], tokens_per_block=16)
    assert [t.name for t in res.tiers] == ["device", "host"]
    assert [t.prefix_hits for t in res.tiers] == [3, 0]  # the device tier serves every repeat
    res = replay_recorded(trace, [4], [PolicySpec("lru")], device_blocks=None, names=["host"], tokens_per_block=16)
    assert [t.prefix_hits for t in res.tiers] == [3] and res.total_prefix_hits == 3
    assert DEVICE < -1  # never a tier index nor the miss marker


def test_a_request_that_loaded_nothing_offers_its_device_hits_again() -> None:
    device, host = VllmPrefixCache(10), PolicySpec("lru").build(2)
    served, _ = replay_engine_tiers([[1, 2], [3, 4], [1, 2]], device, [host], 16)
    assert served[4:] == [DEVICE, DEVICE]
    assert 1 in host and 2 in host  # stored again from the device copy (vLLM's chunk-level store from chunk 0)
    device, host = VllmPrefixCache(10), PolicySpec("lru").build(3)
    served, _ = replay_engine_tiers([[1, 2], [5, 6, 7], [1, 2, 8], [1, 9]], device, [host], 16)
    # [1, 9]: 1 from the device, 9 computed; nothing loaded, so 1 is offered again but the host holds it already
    assert served[-2:] == [DEVICE, -1] and 9 in host


def test_a_request_larger_than_the_device_cache_leaves_at_most_its_capacity_cached() -> None:
    cache = VllmPrefixCache(3)
    cache.serve(list(range(10)), 0)
    assert len(cache) == 3 and cache.hit_run(list(range(10))) == 3  # the head stays, as vLLM frees tail first
