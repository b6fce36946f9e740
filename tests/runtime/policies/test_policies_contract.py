"""One behavioural contract, checked against a reference model for EVERY policy x admission combination.

The reference model is a dict key -> size plus pin counts; a hypothesis state machine drives the policy and the
model with the same random operations and checks after each one that the policy's observable state (keys, sizes,
bytes, pins) matches, that capacity is never exceeded, pinned or protected entries are never evicted, evictions
are not gratuitous, and a failed insert/evict leaves the policy's whole internal state (order, ghosts, admission
records) exactly as it was.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvtier_runtime.policies import ADMISSIONS, POLICIES, AccessContext, PinnedEntryError, get_policy

KEYS = st.integers(min_value=0, max_value=11)
# Mostly small entries so caches fill up and evict; sometimes one larger than the whole capacity.
SIZES = st.one_of(st.integers(min_value=1, max_value=6), st.integers(min_value=1, max_value=45))
CTX = st.one_of(st.none(), st.builds(AccessContext, st.integers(0, 3), st.integers(0, 7), st.integers(1, 8)))


def snapshot(obj, depth: int = 0):
    """A comparable deep image of an object's state (dict order included: order is what policies are about)."""
    if depth > 6:
        return repr(obj)
    if isinstance(obj, (OrderedDict, dict)):
        return [("dict", k, snapshot(v, depth + 1)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [snapshot(v, depth + 1) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, bytearray):
        return bytes(obj)
    if hasattr(obj, "__dict__") and not callable(obj):
        return (type(obj).__name__, snapshot(vars(obj), depth + 1))
    if hasattr(obj, "__slots__"):
        return (type(obj).__name__, [getattr(obj, s, None) for s in obj.__slots__])
    return obj


class PolicyMachine(RuleBasedStateMachine):
    policy_name = "lru"
    admission_name = "none"

    @initialize(capacity=st.integers(min_value=1, max_value=24))
    def setup(self, capacity: int) -> None:
        self.cap = capacity
        self.policy = get_policy(self.policy_name, capacity, admission=self.admission_name)
        self.model: dict[int, int] = {}
        self.pins: dict[int, int] = {}

    def _evictable(self, protected=frozenset()) -> int:
        return sum(s for k, s in self.model.items() if k not in self.pins and k not in protected)

    def _check_evicted(self, evicted, protected=frozenset()) -> None:
        assert len(set(evicted)) == len(evicted), f"a key was evicted twice: {evicted}"
        for k in evicted:
            assert k in self.model, f"evicted {k} that was not cached"
            assert k not in self.pins, f"evicted pinned {k}"
            assert k not in protected, f"evicted protected {k}"
            assert k not in self.policy, f"evicted {k} is still reported present"
            del self.model[k]

    @rule(key=KEYS, size=SIZES, ctx=CTX)
    def insert(self, key: int, size: int, ctx) -> None:
        if key in self.model:
            if self.model[key] == size:
                assert self.policy.insert(key, size, ctx) == []
            else:
                before = snapshot(self.policy)
                with pytest.raises(ValueError):
                    self.policy.insert(key, size, ctx)
                assert snapshot(self.policy) == before
            return
        used = sum(self.model.values())
        need = used + size - self.cap
        feasible = size <= self.cap and need <= self._evictable()
        before = snapshot(self.policy)
        evicted = self.policy.insert(key, size, ctx)
        if not feasible:
            assert evicted is None, f"insert of {size} bytes should fail, evicted {evicted}"
            assert snapshot(self.policy) == before, "a failed insert changed the policy's state"
            return
        assert evicted is not None, "insert failed although enough evictable bytes existed"
        freed = sum(self.model[k] for k in evicted)
        if need <= 0:
            assert evicted == [], "evicted although there was room"
        else:
            assert freed >= need
            assert freed - self.model[evicted[-1]] < need, "evicted more entries than needed"
        self._check_evicted(evicted)
        self.model[key] = size

    @rule(key=KEYS, size=SIZES, ctx=CTX)
    def admit(self, key: int, size: int, ctx) -> None:
        if key in self.model:
            return
        before = sorted(self.policy)
        assert isinstance(self.policy.admit(key, size, ctx), bool)
        assert sorted(self.policy) == before, "admit changed the cached set"

    @rule(key=KEYS, ctx=CTX)
    def touch(self, key: int, ctx) -> None:
        assert self.policy.touch(key, ctx) is (key in self.model)

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        if key in self.pins:
            with pytest.raises(PinnedEntryError):
                self.policy.remove(key)
            return
        assert self.policy.remove(key) is (key in self.model)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def pin(self, key: int) -> None:
        if key not in self.model:
            with pytest.raises(KeyError):
                self.policy.pin(key)
            return
        self.policy.pin(key)
        self.pins[key] = self.pins.get(key, 0) + 1

    @rule(key=KEYS)
    def unpin(self, key: int) -> None:
        if key not in self.pins:
            with pytest.raises(ValueError):
                self.policy.unpin(key)
            return
        self.policy.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(n=st.integers(min_value=0, max_value=30), protected=st.frozensets(KEYS, max_size=4))
    def evict(self, n: int, protected: frozenset) -> None:
        feasible = n <= self._evictable(protected)
        before = snapshot(self.policy)
        evicted = self.policy.evict(n, protected)
        if not feasible:
            assert evicted is None
            assert snapshot(self.policy) == before, "a failed evict changed the policy's state"
            return
        assert evicted is not None
        freed = sum(self.model[k] for k in evicted)
        assert freed >= n
        if evicted:
            assert freed - self.model[evicted[-1]] < n, "evicted more entries than asked for"
        self._check_evicted(evicted, protected)

    @precondition(lambda self: len(self.model) > 3)
    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.model.clear()
        self.pins.clear()
        assert self.policy.pinned_bytes == 0

    @invariant()
    def matches_model(self) -> None:
        p = self.policy
        assert sorted(p) == sorted(self.model)
        assert len(p) == len(self.model)
        assert p.used_bytes == sum(self.model.values())
        assert p.used_bytes <= p.capacity_bytes
        assert p.free_bytes == p.capacity_bytes - p.used_bytes
        assert p.pinned_bytes == sum(self.model[k] for k in self.pins)
        for k, s in self.model.items():
            assert k in p and p.size_of(k) == s
            assert p.is_pinned(k) is (k in self.pins)
        victim = p.peek_victim()
        assert victim is None or (victim in self.model and victim not in self.pins)


COMBOS = list(itertools.product(sorted(POLICIES), sorted(ADMISSIONS)))


@pytest.mark.parametrize(("policy", "admission"), COMBOS, ids=[f"{p}-{a}" for p, a in COMBOS])
def test_policy_contract(policy: str, admission: str) -> None:
    machine = type(f"Machine_{policy}_{admission}", (PolicyMachine,), {"policy_name": policy, "admission_name": admission})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=60, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bad_arguments_are_named(policy: str) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        get_policy(policy, 0)
    p = get_policy(policy, 10)
    with pytest.raises(ValueError, match="size"):
        p.insert(1, 0)
    with pytest.raises(ValueError, match="n_bytes"):
        p.evict(-1)
    with pytest.raises(ValueError, match="eviction policy"):
        get_policy("fifo-ish", 10)
    with pytest.raises(ValueError, match="admission"):
        get_policy(policy, 10, admission="always")
