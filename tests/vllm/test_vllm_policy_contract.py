"""vLLM's CachePolicy contract, checked against vLLM's own LRU and ARC and every kvtier policy in one parametrised
suite: the same checks, so a check that only ours passes is a check of ours, not of the contract.

The contract (vllm/v1/kv_offload/cpu/policies/base.py, 0.33.0): ``evict(n, protected)`` returns exactly n
(key, chunk) pairs, never a protected chunk and never one with ``ref_cnt != 0`` (-1 = store in flight, > 0 =
transfers reading it), or ``None`` with no state change; ``mark_evictable``/``mark_non_evictable`` follow ref_cnt's
0 transitions; ``remove`` cleans up a failed store; ``clear`` drops everything; chunks keep their ``chunk_id``.
"""
from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

from kvtier_runtime.config import (  # noqa: E402
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    VLLM_ADAPTER_MODULE,
    vllm_cache_policy_class,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory  # noqa: E402

# (eviction_policy, cache_policy_module_path) exactly as kv_connector_extra_config spells them.
VLLM_POLICIES = [("lru", None), ("arc", None)]
KVTIER_POLICIES = [(vllm_cache_policy_class(e, a), VLLM_ADAPTER_MODULE) for e in EVICTION_POLICIES for a in ADMISSION_POLICIES]
ALL_POLICIES = VLLM_POLICIES + KVTIER_POLICIES
IDS = [name for name, _ in ALL_POLICIES]


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def make_policy(name: str, module: str | None, capacity: int):
    return CachePolicyFactory.get_cache_policy_cls(name, module)(cache_capacity=capacity)


CTX = ReqContext(req_id="r0")


def store(policy, i: int, *, ready: bool = True) -> ChunkStatus:
    """Insert chunk i as vLLM's manager does (ref_cnt -1), then complete its store."""
    chunk = ChunkStatus(chunk_id=100 + i)
    policy.insert(key(i), chunk, CTX)
    if ready:
        chunk.ref_cnt = 0
        policy.mark_evictable(key(i))
    return chunk


def pin(policy, i: int) -> None:
    chunk = policy.get(key(i))
    if chunk.ref_cnt == 0:
        policy.mark_non_evictable(key(i))
    chunk.ref_cnt += 1


def unpin(policy, i: int) -> None:
    chunk = policy.get(key(i))
    chunk.ref_cnt -= 1
    if chunk.ref_cnt == 0:
        policy.mark_evictable(key(i))


def resident(policy, n: int) -> dict[int, ChunkStatus]:
    return {i: c for i in range(n) if (c := policy.get(key(i))) is not None}


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
def test_factory_loads_the_class_by_name(name, module):
    cls = CachePolicyFactory.get_cache_policy_cls(name, module)
    policy = cls(cache_capacity=4)
    assert policy.cache_capacity == 4
    if module is not None:
        assert cls.__name__ == name and cls.__module__ == VLLM_ADAPTER_MODULE


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
def test_evict_is_atomic_and_skips_protected_and_busy_chunks(name, module):
    policy = make_policy(name, module, 8)
    for i in range(8):
        store(policy, i, ready=i != 5)  # 5: store still in flight (ref_cnt -1)
    pin(policy, 6)  # 6: a transfer reads it (ref_cnt 1)
    protected = {key(0), key(1)}
    before = resident(policy, 8)
    # Evictable: 2, 3, 4, 7 -> five cannot be found.
    assert policy.evict(5, protected) is None
    assert resident(policy, 8) == before, "a failed evict changed the cache"
    assert all(policy.get(key(i)) is before[i] for i in before)
    out = policy.evict(4, protected)
    assert out is not None and len(out) == 4
    assert {k for k, _ in out} == {key(2), key(3), key(4), key(7)}
    for k, chunk in out:
        assert chunk.ref_cnt == 0 and chunk.chunk_id == 100 + int.from_bytes(k[:32], "big")
        assert policy.get(k) is None
    assert set(resident(policy, 8)) == {0, 1, 5, 6}
    assert policy.evict(0, set()) == []
    assert policy.evict(1, protected) is None  # 5 and 6 are busy, 0 and 1 protected


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
def test_chunks_become_evictable_only_at_ref_cnt_zero(name, module):
    policy = make_policy(name, module, 4)
    store(policy, 0, ready=False)
    assert policy.get(key(0)).ref_cnt == -1 and not policy.get(key(0)).is_ready
    assert policy.evict(1, set()) is None
    chunk = policy.get(key(0))
    chunk.ref_cnt = 0
    policy.mark_evictable(key(0))
    pin(policy, 0)
    pin(policy, 0)
    assert policy.evict(1, set()) is None
    unpin(policy, 0)
    assert policy.evict(1, set()) is None  # still one reader
    unpin(policy, 0)
    assert policy.evict(1, set()) == [(key(0), chunk)]


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
def test_remove_cleans_up_a_failed_store_and_clear_drops_everything(name, module):
    policy = make_policy(name, module, 4)
    store(policy, 0)
    store(policy, 1, ready=False)
    policy.remove(key(1))  # the manager's complete_store(success=False) path
    assert policy.get(key(1)) is None
    assert [k for k, _ in policy.evict(1, set())] == [key(0)]
    assert policy.evict(1, set()) is None
    store(policy, 2)
    store(policy, 3, ready=False)
    pin(policy, 2)
    policy.clear()
    assert resident(policy, 4) == {}
    assert policy.evict(1, set()) is None
    store(policy, 2)  # usable after clear
    assert [k for k, _ in policy.evict(1, set())] == [key(2)]


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
def test_already_stored_chunk_is_not_evicted_by_prepare_store(name, module):
    """vLLM's own regression test (test_already_stored_block_not_evicted_during_prepare_store), through the real
    CPUOffloadingManager: chunks named in the store are protected even when they are the eviction candidate."""
    manager = CPUOffloadingManager(num_chunks=4, cache_policy=name, cache_policy_module_path=module)
    ctx = ReqContext(req_id="a")
    manager.prepare_store([key(1), key(2)], ctx)
    manager.complete_store([key(1), key(2)], ctx)
    out = manager.prepare_store([key(2), key(3), key(4), key(5)], ReqContext(req_id="b"))
    assert out is not None
    assert out.keys_to_store == [key(3), key(4), key(5)]
    assert out.evicted_keys == [key(1)]
    manager.complete_store([key(2), key(3), key(4), key(5)], ReqContext(req_id="b"))
    assert manager.lookup(key(2), ctx) is LookupResult.HIT


@pytest.mark.parametrize(("name", "module"), ALL_POLICIES, ids=IDS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_manager_workload_keeps_the_contract(name, module, seed):
    """Random stores (completing or failing), loads, reuses and request ends through the real CPUOffloadingManager,
    against a shadow model of what must be resident. vLLM's manager asserts its own invariants (ref_cnt, evictable
    counts, that a victim is idle) on every call, so a policy that breaks the contract fails here."""
    rng = random.Random(seed)
    capacity = 16
    manager = CPUOffloadingManager(num_chunks=capacity, cache_policy=name, cache_policy_module_path=module)
    ready: set[int] = set()  # shadow: completed and not evicted
    inflight_store: dict[int, ReqContext] = {}
    loading: dict[int, int] = {}
    for step in range(600):
        ctx = ReqContext(req_id=f"req{step // 4}")
        op = rng.random()
        if op < 0.45:
            ids = sorted({rng.randrange(48) for _ in range(rng.randint(1, 5))})
            ids = [i for i in ids if i not in inflight_store]
            if not ids:
                continue
            keys = [key(i) for i in ids]
            out = manager.prepare_store(keys, ctx)
            if out is None:
                continue  # not enough idle chunks: allowed, nothing may have changed
            for k in out.evicted_keys:
                i = int.from_bytes(k[:32], "big")
                assert i in ready and i not in loading, f"evicted chunk {i} was busy or not ready"
                assert k not in keys, "evicted a chunk named in the store"
                ready.discard(i)
            for k in out.keys_to_store:
                inflight_store[int.from_bytes(k[:32], "big")] = ctx
        elif op < 0.65 and inflight_store:
            i = rng.choice(sorted(inflight_store))
            c = inflight_store.pop(i)
            ok = rng.random() < 0.85
            manager.complete_store([key(i)], c, success=ok)
            if ok:
                ready.add(i)
        elif op < 0.8 and ready:
            i = rng.choice(sorted(ready))
            assert manager.lookup(key(i), ctx) is LookupResult.HIT
            manager.prepare_load([key(i)], ctx)
            loading[i] = loading.get(i, 0) + 1
        elif op < 0.92 and loading:
            i = rng.choice(sorted(loading))
            manager.complete_load([key(i)], ctx)
            loading[i] -= 1
            if not loading[i]:
                del loading[i]
        else:
            manager.on_request_finished(ctx)
        for i in range(48):
            got = manager.lookup(key(i), ctx)
            want = (
                LookupResult.HIT if i in ready else LookupResult.HIT_PENDING if i in inflight_store else LookupResult.MISS
            )
            assert got is want, f"step {step}: chunk {i} is {got}, expected {want}"
        assert len(ready) + len(inflight_store) <= capacity
