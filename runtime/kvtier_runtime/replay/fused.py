"""Trace replay's hot loop for the runtime's default policy (:class:`~kvtier_runtime.policies.adaptive.AdaptivePolicy`):
every access of a trace is a ``touch`` and every miss an ``insert`` of size 1, exactly as
:func:`kvtier_runtime.replay.engine.replay_single` does through the policy's public methods, fused into one loop.

The same steps in the same order on the same state -- so the same hits, weights and trust, checked against the
public path in tests/runtime/policies/test_policies_adaptive.py and pinned by tests/data/replay-golden.json -- over
local names: no context objects and no method call per access, which is most of what an access cost. The loop reads
the policy's named state (:meth:`AdaptivePolicy.snapshot`), changes its containers in place and hands its numbers
back (:meth:`AdaptivePolicy.restore`). It is specialised to unit sizes, which is what replay stores: a block's size
is not looked up (the size map is rebuilt from the class map at the end, in the same order), every byte count is an
entry count, the class weights are six local floats (the model and its tempered copy) instead of lists, a ghost's
value is one of three shared tuples, and the running request remembers each key's class so that closing it moves
keys without a lookup. It is one function on purpose: a call per eviction or per access measured slower.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..policies.adaptive import AGAIN, FRESH, TAIL, AdaptivePolicy, AdaptiveState, hedged_trust
from ..policies.base import Key

__all__ = ["replay_adaptive"]

NO_HEAD = object()  # "no cached head" (not None: None may be a key)


def _modelled(st: AdaptiveState) -> bool:
    """Whether the loop models this state: a policy it may take the steps of (nothing pinned, no admission filter,
    AdaptivePolicy's own learning and tempering), a capacity of at least one block, every entry, history entry,
    shadow entry and ghost of one byte, the hedge's window counted in unit accesses, the running request's keys all
    cached, and learning parameters that keep the positive weights the loop's shortcut for their bound assumes."""
    return (st.plain and st.capacity >= 1 and st.used == len(st.sizes) and st.history_used == len(st.history)
            and st.shadow_used == len(st.shadow) and st.evicted_bytes == len(st.evicted) and st.seen == st.accesses
            and all(k in st.classes for k in st.current)
            and 0.0 <= st.learning_rate < 1.0 and st.max_weight_ratio >= 1.0 and min(st.model) > 0.0)


def replay_adaptive(policy: AdaptivePolicy, requests: Sequence[Sequence[Key]]) -> list[bool] | None:
    """Replay ``requests`` (request i's blocks, in prefix order, as ``AccessContext(i, position, len)``) on
    ``policy``: the hit flag of each access. ``None`` when the policy's state is one the loop does not model
    (:func:`_modelled`): the caller then takes the public path, and the policy is left as it was."""
    st = policy.snapshot()
    if not _modelled(st):
        return None
    sizes, cls, evicted, hsizes, skeys = st.sizes, st.classes, st.evicted, st.history, st.shadow
    fresh_list, again, tail_list = lists = st.lists
    fresh_move, again_move, tail_move = (lst.move_to_end for lst in lists)
    hmove, hpop, smove, spop, epop = (hsizes.move_to_end, hsizes.popitem, skeys.move_to_end, skeys.popitem,
                                      evicted.popitem)
    hcap, h_used = st.history_capacity, st.history_used
    scap, s_used = st.shadow_capacity, st.shadow_used
    # A window closes once both its bytes and its accesses reach their minimum; with unit sizes they are equal.
    window = max(st.shadow_window, st.shadow_min_accesses)
    decay = st.shadow_decay
    s_run, s_shadow_run, s_request = st.run, st.shadow_run, st.shadow_request
    s_acc, s_diff, s_score = st.accesses, st.diff, st.score
    # Class weights: the model (m*) and what eviction reads (e*: the model itself while fully trusted, else
    # the model tempered by trust). FRESH = 0, AGAIN = 1, TAIL = 2.
    m0, m1, m2 = st.model
    trust = st.trust
    trusted = trust == 1.0
    e0, e1, e2 = (m0, m1, m2) if trusted else (m0 ** trust, m1 ** trust, m2 ** trust)
    lr, max_ratio = st.learning_rate, st.max_weight_ratio
    hedge_step, hedge_tolerance = st.hedge_step, st.hedge_tolerance
    shrink = 1.0 - lr
    ghost_fresh, ghost_again, ghost_tail = (FRESH, 1), (AGAIN, 1), (TAIL, 1)
    ghost_limit = st.ghost_limit
    capacity = st.capacity
    used, tick, request = st.used, st.tick, st.request
    current = {k: cls[k] for k in st.current}  # key -> its class, kept equal to cls[key]
    ghost_rate, evictions, ev_used = st.ghost_rate, st.evictions, st.evicted_bytes
    # Each class's head (its oldest entry) and that entry's tick, cached for the victim choice; no_head: look
    # it up. Only a head that is not in the running request is cached (for one that is, the candidate is the
    # list's tail, which every insert changes). A cached head stays the head until it is evicted, hit (a hit
    # deletes it from FRESH/TAIL or moves it to AGAIN's young end) -- both reset the cache -- since inserts and
    # closing a request only move keys to the young end, and a cached head is never in the running request
    # (accessing it would be a hit). An empty class never has a cached head: its last entry left by one of
    # those two ways.
    no_head = NO_HEAD  # not None: None may be a key
    fresh_head: Key = no_head
    again_head: Key = no_head
    tail_head: Key = no_head
    fresh_head_tick = again_head_tick = tail_head_tick = 0
    hits: list[bool] = []
    append = hits.append
    for rid, req in enumerate(requests):
        if not req:
            continue
        last = len(req) - 1
        # The hedge's run of prefix hits restarts with each request (its position 0).
        s_request = rid
        s_run = s_shadow_run = True
        entering = rid != request
        for pos, key in enumerate(req):
            if key in cls:
                hit = True
                c = cls[key]
            else:
                hit = False
                # insert: learn from a ghost, then evict, both before the access enters its request.
                if key in evicted:
                    gc = evicted.pop(key)[0]
                    ev_used -= 1
                    if gc == FRESH:
                        m0 *= shrink
                    elif gc == AGAIN:
                        m1 *= shrink
                    else:
                        m2 *= shrink
                    ghost_rate += 0.001 * (1.0 - ghost_rate)
                    low = m0
                    if m1 < low:
                        low = m1
                    if m2 < low:
                        low = m2
                    limit = max_ratio * low
                    if m0 > limit:
                        m0 = limit
                    if m1 > limit:
                        m1 = limit
                    if m2 > limit:
                        m2 = limit
                    if trusted:
                        e0, e1, e2 = m0, m1, m2
                    else:
                        e0, e1, e2 = m0 ** trust, m1 ** trust, m2 ** trust
                if used >= capacity:
                    # _choose_unblocked, unrolled in _TIE_ORDER (a tie keeps the earlier class), reading each class's
                    # head from its cache when it has one (see the cache's rules where it is set up).
                    if tail_head is not no_head:
                        best, best_c, best_score = tail_head, TAIL, (tick - tail_head_tick + 1) * e2
                    elif tail_list:
                        for k in tail_list:  # noqa: B007 -- k is the first key: cheaper than next(iter())
                            break
                        if k in current:
                            k = next(reversed(tail_list))
                            t = tail_list[k]
                        else:
                            tail_head, tail_head_tick = k, tail_list[k]
                            t = tail_head_tick
                        best, best_c, best_score = k, TAIL, (tick - t + 1) * e2
                    else:
                        best_c, best_score = -1, -1.0
                    if fresh_head is not no_head:
                        k, t = fresh_head, fresh_head_tick
                    elif fresh_list:
                        for k in fresh_list:  # noqa: B007 -- k is the first key: cheaper than next(iter())
                            break
                        if k in current:
                            k = next(reversed(fresh_list))
                            t = fresh_list[k]
                        else:
                            fresh_head, fresh_head_tick = k, fresh_list[k]
                            t = fresh_head_tick
                    else:
                        k = no_head
                    if k is not no_head:
                        score = (tick - t + 1) * e0
                        if score > best_score:
                            best, best_c, best_score = k, FRESH, score
                    if again_head is not no_head:
                        k, t = again_head, again_head_tick
                    elif again:
                        for k in again:  # noqa: B007 -- k is the first key: cheaper than next(iter())
                            break
                        if k in current:
                            k = next(reversed(again))
                            t = again[k]
                        else:
                            again_head, again_head_tick = k, again[k]
                            t = again_head_tick
                    else:
                        k = no_head
                    if k is not no_head:
                        score = (tick - t + 1) * e1
                        if score > best_score:
                            best, best_c = k, AGAIN
                    del cls[best]
                    if best in current:
                        del current[best]
                    ghost_rate *= 0.999
                    # _record_eviction: the victim's class ages faster, at most max_ratio times the slowest.
                    # The bound compares with the other two classes only: a class that is the slowest after
                    # growing is under max_ratio times itself, so min() over all three bounds it the same.
                    # Tempering only the weight that changed gives the same floats as tempering all three.
                    if best_c == TAIL:
                        del tail_list[best]
                        tail_head = no_head
                        evicted[best] = ghost_tail
                        m2 *= 1.0 + lr * ghost_rate
                        low = m0 if m0 < m1 else m1
                        if m2 > max_ratio * low:
                            m2 = max_ratio * low
                        e2 = m2 if trusted else m2 ** trust
                    elif best_c == FRESH:
                        del fresh_list[best]
                        fresh_head = no_head
                        evicted[best] = ghost_fresh
                        m0 *= 1.0 + lr * ghost_rate
                        low = m1 if m1 < m2 else m2
                        if m0 > max_ratio * low:
                            m0 = max_ratio * low
                        e0 = m0 if trusted else m0 ** trust
                    else:
                        del again[best]
                        again_head = no_head
                        evicted[best] = ghost_again
                        m1 *= 1.0 + lr * ghost_rate
                        low = m0 if m0 < m2 else m2
                        if m1 > max_ratio * low:
                            m1 = max_ratio * low
                        e1 = m1 if trusted else m1 ** trust
                    evictions += 1
                    if not evictions & 1023:  # only ratios matter: keep the numbers far from over/underflow
                        low = m0 if m0 < m1 else m1
                        if m2 < low:
                            low = m2
                        m0 /= low
                        m1 /= low
                        m2 /= low
                        if trusted:
                            e0, e1, e2 = m0, m1, m2
                        else:
                            e0, e1, e2 = m0 ** trust, m1 ** trust, m2 ** trust
                    ev_used += 1
                    while ev_used > ghost_limit:
                        epop(False)
                        ev_used -= 1
                else:
                    used += 1
            # The hedge's shadow LRU sees the access; the policy's and the shadow's prefix-hit runs are scored.
            if key in skeys:
                smove(key)
                if not hit:
                    s_run = False
                    if s_shadow_run:
                        s_diff -= 1
                elif s_run != s_shadow_run:
                    s_diff += s_run - s_shadow_run
            else:
                skeys[key] = 1
                s_used += 1
                while s_used > scap:
                    spop(False)
                    s_used -= 1
                s_shadow_run = False
                if not hit:
                    s_run = False
                elif s_run:
                    s_diff += 1
            s_acc += 1
            if s_acc >= window:
                s_score = s_score * decay + s_diff
                s_acc = s_diff = 0
                # AdaptivePolicy._hedge: the trust moves, and eviction reads the model tempered by it.
                trust = hedged_trust(trust, s_score, hedge_step, hedge_tolerance)
                trusted = trust == 1.0
                if trusted:
                    e0, e1, e2 = m0, m1, m2
                else:
                    e0, e1, e2 = m0 ** trust, m1 ** trust, m2 ** trust
            # The access enters its request (leaf-first order): the request before moves to the young end,
            # tail first.
            if entering:
                entering = False
                if current:
                    for k, kc in reversed(current.items()):
                        if kc == FRESH:
                            fresh_move(k)
                        elif kc == AGAIN:
                            again_move(k)
                        else:
                            tail_move(k)
                    current = {}
                request = rid
                tick += 1
            if hit:
                if key in hsizes:
                    hmove(key)
                else:
                    hsizes[key] = 1
                    h_used += 1
                    while h_used > hcap:
                        hpop(False)
                        h_used -= 1
                if c == AGAIN:
                    if key == again_head:
                        again_head = no_head
                    again[key] = tick
                    again_move(key)
                else:
                    if c == FRESH:
                        if key == fresh_head:
                            fresh_head = no_head
                        del fresh_list[key]
                    else:
                        if key == tail_head:
                            tail_head = no_head
                        del tail_list[key]
                    cls[key] = AGAIN
                    again[key] = tick
                current[key] = AGAIN
                append(True)
            else:
                if key in hsizes:
                    hmove(key)
                    cls[key] = current[key] = AGAIN
                    again[key] = tick
                else:
                    hsizes[key] = 1
                    h_used += 1
                    while h_used > hcap:
                        hpop(False)
                        h_used -= 1
                    if pos == last > 0:
                        cls[key] = current[key] = TAIL
                        tail_list[key] = tick
                    else:
                        cls[key] = current[key] = FRESH
                        fresh_list[key] = tick
                append(False)
    # Hand the state back in the public path's form.
    sizes.clear()
    sizes.update(dict.fromkeys(cls, 1))
    st.history_used = h_used
    st.shadow_used, st.shadow_request, st.run, st.shadow_run = s_used, s_request, s_run, s_shadow_run
    st.seen = st.accesses = s_acc
    st.diff, st.score = s_diff, s_score
    st.model, st.trust = (m0, m1, m2), trust
    st.used, st.tick, st.request, st.current = used, tick, request, list(current)
    st.ghost_rate, st.evictions, st.evicted_bytes = ghost_rate, evictions, ev_used
    policy.restore(st)
    return hits
