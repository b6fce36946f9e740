"""Leaf-first LRU whose block classes age at learned speeds ("adaptive"; the runtime's default).

Entries are split into three classes by what the cache knows when they arrive:

* ``FRESH`` -- a block not in the recent history (a first-timer);
* ``AGAIN`` -- a block hit while cached, or inserted again while the history still remembered it;
* ``TAIL``  -- the last block of a request's prompt, inserted on a miss (with an :class:`AccessContext`). Its
  prompt usually ends inside it, so the next turn of the conversation extends it into a *different* block.

Each class is an LRU list in leaf-first order: blocks carry the tick of the request that last used them, and
within one request the tail sits before the head -- a block is only reusable when every block before it is cached
(SGLang's radix cache evicts leaves first for the same reason). The victim is the class head with the largest
``age x weight``; with equal weights this is exactly leaf-first LRU.

The weights start from a prior (first-timers 4x, tails 64x the ageing speed of repeats) and are learned from
recently evicted keys (one ghost FIFO, as long as the cache, each ghost tagged with
its class): a ghost hit means the class was evicted too early, so its weight shrinks; each eviction grows the
weight of its class by the running ghost-hit rate of all evictions. The weights settle where every class loses
hits at the same rate per eviction -- the equal-marginal-utility point of cache partitioning -- so a trace where
first-timers matter (multi-turn chat: the next turn reuses them within seconds) drifts back to plain LRU, and one
where they do not (one-shot documents) protects the blocks seen before, as ARC and LeCaR adapt by ghost hits.

**The hedge.** The learned weights are a model of the trace, and a model can be wrong where it was not trained:
on real multi-turn chat at large capacities reuse is nearly all recency, and weights learned from ghost hits
protect the wrong blocks (measured: -0.009 against LRU at 20% on a real conversation trace). So the policy keeps
a metadata-only LRU of the same capacity (a *shadow*: keys and sizes, no data) beside itself, fed the same
accesses, and scores both on the metric that matters -- prefix hits, an access that hits while every earlier
block of its request hit. Every window (5% of the capacity's bytes of accesses) the score difference enters a
decayed sum; while the policy trails the shadow by more than a block the weights are tempered toward 1 (they
are used as ``weight ** trust``, ``trust`` in [0, 1], so ``trust = 0`` is exactly leaf-first LRU, which never
trails LRU); otherwise ``trust`` creeps back up, which doubles as the probe that finds the model useful again
after the traffic changes. The controller is integral with a tolerance, not per-window sign: a block evicted
now costs a miss about one cache's worth of accesses later, and a controller faster than that delay
oscillates (measured: worst cell -0.0041 per-window, -0.0008 decayed, docs/performance.md).

All operations are O(1) amortised (three class heads are compared per eviction; one shadow probe per access).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Sequence

from .base import AccessContext, EvictionPolicy, Key
from .ghost import GhostList

FRESH, AGAIN, TAIL = 0, 1, 2
_TIE_ORDER = (TAIL, FRESH, AGAIN)
_NO_HEAD = object()  # the fused replay loop's "no cached head"


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"
    uses_context = True
    history_factor = 4  # how long "seen before" is remembered, in cache sizes
    ghost_factor = 1  # how many evictions back a ghost hit counts, in cache sizes
    learning_rate = 0.004
    max_weight_ratio = 64.0
    # Prior before any ghost hit: first-timers are reused less than repeats on every trace measured (0.24-0.47
    # vs 0.54-0.95) and a prompt's last block almost never (<= 0.05), so they start ageing 4x and 64x faster.
    # Ghost hits move the weights from there. 16x measured better on the shared trace (+0.003 at 5%) but fell
    # 0.004 below LRU on conversations at 20-30%, where learning has few evictions to learn from.
    initial_weights = (4.0, 1.0, 64.0)
    # The hedge against recency (see the module docstring); tuned on generated shapes and the shared trace,
    # checked on a held-out real trace (tests/runtime/policies/test_policies_floor.py).
    hedge_window = 0.05  # of the capacity, in bytes of accesses, and at least hedge_min_window accesses
    hedge_min_window = 32  # so that a small cache still sums enough accesses for a loss to show
    hedge_step = 0.1  # change of trust per window
    hedge_decay = 0.8  # of the decayed score difference, per window
    hedge_tolerance = 1.0  # prefix hits the policy may trail the shadow by before it trusts its model less

    def __init__(self, capacity_bytes: int, admission=None) -> None:
        super().__init__(capacity_bytes, admission)
        # Per class: key -> tick of its last use, oldest first.
        self._lists: tuple[OrderedDict[Key, int], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._class: dict[Key, int] = {}
        self._history = GhostList(self.history_factor * capacity_bytes)
        self._evicted: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # ghost -> (class evicted from, size)
        self._evicted_bytes = 0
        self._model = list(self.initial_weights)  # learned ageing speeds
        self._weights = self._model  # what eviction uses: the model tempered by trust
        self._ghost_rate = 0.0  # running ghost hits per eviction
        self._evictions = 0
        self._tick = 0
        self._request: Hashable = None
        self._current: dict[Key, None] = {}  # keys of the current request, in access order
        self._shadow = _RecencyShadow(capacity_bytes, max(1, int(self.hedge_window * capacity_bytes)),
                                      self.hedge_min_window, self.hedge_decay)
        self._trust = 1.0

    @property
    def trust(self) -> float:
        """How far eviction follows the learned weights: 1 fully, 0 not at all (leaf-first LRU)."""
        return self._trust

    @property
    def weights(self) -> tuple[float, float, float]:
        """Learned ageing speeds of (FRESH, AGAIN, TAIL) relative to the slowest; larger is evicted sooner."""
        low = min(self._model)
        return tuple(w / low for w in self._model)  # type: ignore[return-value]

    # ---- the hedge -----------------------------------------------------------------------------------------
    def _observe(self, key: Key, size: int, ctx: AccessContext | None, hit: bool) -> None:
        verdict = self._shadow.observe(key, size, ctx, hit)
        if verdict is not None:
            self._hedge(verdict)

    def _hedge(self, verdict: float) -> None:
        """A window closed: trust the model less while it trails recency by more than the tolerance, else more."""
        step = -self.hedge_step if verdict < -self.hedge_tolerance else self.hedge_step
        # Rounded so that ten steps down reach exactly 0 (plain leaf-first LRU), not 1e-16.
        self._trust = round(min(1.0, max(0.0, self._trust + step)), 9)
        self._temper()

    def _temper(self) -> None:
        # Fully trusted, eviction reads the model itself; tempered, the weights are recomputed whenever the model
        # learns (stale tempered weights measured 0.01 worse at 10% on the held-out trace).
        t = self._trust
        self._weights = self._model if t == 1.0 else [w ** t for w in self._model]

    # ---- request tracking (leaf-first order) -------------------------------------------------------------
    def _enter(self, key: Key, ctx: AccessContext | None) -> None:
        if ctx is None or ctx.request_id is None:
            if self._current:
                self._flush()
            self._tick += 1
            return
        if ctx.request_id != self._request:
            if self._current:
                self._flush()
            self._request = ctx.request_id
            self._tick += 1
        self._current[key] = None

    def _flush(self) -> None:
        """The finished request's keys move to the young end tail-first, so its head outlives its tail."""
        lists, cls = self._lists, self._class
        for key in reversed(self._current):
            c = cls.get(key)
            if c is not None:
                lists[c].move_to_end(key)
        self._current = {}

    # ---- learning ----------------------------------------------------------------------------------------
    def _learn_from_ghost(self, key: Key) -> None:
        ghost = self._evicted.pop(key, None)
        if ghost is None:
            return
        c, size = ghost
        self._evicted_bytes -= size
        w = self._model
        w[c] *= 1.0 - self.learning_rate
        self._ghost_rate += 0.001 * (1.0 - self._ghost_rate)
        limit = self.max_weight_ratio * min(w)
        for i in range(3):
            if w[i] > limit:
                w[i] = limit
        if self._weights is not w:
            self._temper()

    def _record_eviction(self, key: Key, c: int, size: int) -> None:
        self._ghost_rate *= 0.999
        w = self._model
        w[c] *= 1.0 + self.learning_rate * self._ghost_rate
        limit = self.max_weight_ratio * min(w)
        if w[c] > limit:
            w[c] = limit
        self._evictions += 1
        if not self._evictions & 1023:  # only ratios matter; keep the numbers far from overflow and underflow
            low = min(w)
            for i in range(3):
                w[i] /= low
        if self._weights is not w:
            self._temper()
        evicted = self._evicted
        evicted[key] = (c, size)
        self._evicted_bytes += size
        while self._evicted_bytes > self.ghost_factor * self.capacity_bytes:
            self._evicted_bytes -= evicted.popitem(last=False)[1][1]

    # ---- hooks -------------------------------------------------------------------------------------------
    def _prepare_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        self._learn_from_ghost(key)

    def _order_insert(self, key: Key, size: int, ctx: AccessContext | None) -> None:
        self._observe(key, size, ctx, False)
        self._enter(key, ctx)
        if key in self._history:
            c = AGAIN
        elif ctx is not None and ctx.request_id is not None and ctx.position == ctx.length - 1 > 0:
            c = TAIL
        else:
            c = FRESH
        self._history.add(key, size)
        self._class[key] = c
        self._lists[c][key] = self._tick

    def _order_touch(self, key: Key, ctx: AccessContext | None) -> None:
        self._observe(key, self._sizes[key], ctx, True)
        self._enter(key, ctx)
        self._history.refresh(key, self._sizes[key])
        c = self._class[key]
        if c != AGAIN:
            del self._lists[c][key]
            self._class[key] = AGAIN
        again = self._lists[AGAIN]
        again[key] = self._tick
        again.move_to_end(key)

    def _order_remove(self, key: Key) -> None:
        del self._lists[self._class.pop(key)][key]
        self._current.pop(key, None)

    def peek_victim(self) -> Key | None:
        found = self._choose(self._pins.__contains__)
        return None if found is None else found[0]

    def _choose(self, blocked: Callable[[Key], bool] | None) -> tuple[Key, int] | None:
        best: tuple[Key, int] | None = None
        best_score = -1.0
        now = self._tick
        current = self._current
        weights = self._weights
        lists = self._lists
        # On equal scores (same request) a tail goes before a first-timer before a repeat: inside one request
        # that is deepest position first, since a request's repeats are its head.
        for c in _TIE_ORDER:
            lst = lists[c]
            if not lst:
                continue
            for key, tick in lst.items():
                if blocked is not None and blocked(key):
                    continue
                if key in current:
                    # Only the running request's keys are left in this class: offer its tail, not its head.
                    for tail in reversed(lst):
                        if blocked is None or not blocked(tail):
                            key, tick = tail, lst[tail]
                            break
                score = (now - tick + 1) * weights[c]
                if score > best_score:
                    best, best_score = (key, c), score
                break
        return best

    def _choose_unblocked(self) -> tuple[Key, int]:
        """``_choose`` when nothing is pinned or protected: each class's candidate is its head (or, for the running
        request, its tail)."""
        best, best_c, best_score = None, FRESH, -1.0
        now, weights, lists, current = self._tick, self._weights, self._lists, self._current
        for c in _TIE_ORDER:
            lst = lists[c]
            if lst:
                key = next(iter(lst))
                if key in current:
                    key = next(reversed(lst))
                score = (now - lst[key] + 1) * weights[c]
                if score > best_score:
                    best, best_c, best_score = key, c, score
        return best, best_c

    def insert(self, key: Key, size: int, ctx: AccessContext | None = None) -> list[Key] | None:
        # Hot path (trace replay, a tier with no transfer in flight): with nothing pinned every entry is evictable,
        # so the base class's feasibility checks and blocked-key tests are skipped. Same result, fewer calls.
        sizes = self._sizes
        if self._pins or key in sizes or type(size) is not int or size <= 0 or size > self.capacity_bytes:
            return super().insert(key, size, ctx)
        if self._evicted:
            self._learn_from_ghost(key)
        need = self._used + size - self.capacity_bytes
        evicted: list[Key] = []
        if need > 0:
            freed = 0
            while freed < need:
                victim = self._pop_victim(None)
                freed += sizes.pop(victim)
                evicted.append(victim)
            self._used -= freed
        sizes[key] = size
        self._used += size
        self._order_insert(key, size, ctx)
        return evicted

    def _pop_victim(self, blocked: Callable[[Key], bool] | None) -> Key:
        found = self._choose_unblocked() if blocked is None else self._choose(blocked)
        if found is None:
            raise AssertionError("no evictable entry although the base class counted enough evictable bytes")
        key, c = found
        del self._lists[c][key]
        del self._class[key]
        self._current.pop(key, None)
        self._record_eviction(key, c, self._sizes[key])
        return key

    def replay_unit_blocks(self, requests: Sequence[Sequence[Key]]) -> list[bool] | None:
        """Trace replay's hot loop: every access of ``requests`` (request i's blocks, in prefix order, as
        ``AccessContext(i, position, len)``) is a ``touch`` and every miss an ``insert`` of size 1, exactly as
        ``replay.engine.replay_single`` does through the public methods; the hit flag of each access.

        The same steps in the same order on the same state (so the same hits, weights and trust, checked against
        the public path in tests/runtime/policies/test_policies_adaptive.py), fused into one loop over local names:
        no context objects and no method call per access, which is most of what an access cost. The loop is
        specialised to unit sizes, which is what replay stores: a block's size is not looked up (``_sizes`` is
        rebuilt from the class map at the end, in the same order), every byte count is an entry count, the class
        weights are six local floats (the model and its tempered copy) instead of lists, a ghost's value is one
        of three shared tuples, and the running request remembers each key's class so that closing it moves
        keys without a lookup. ``None`` when the state is one the loop does not model (pinned entries, an
        admission filter, a capacity under one block, an entry or ghost larger than one byte, a subclass that
        tempers weights its own way or whose learning parameters leave the positive weights the loop assumes):
        the caller then takes the public path.
        """
        sizes, cls, evicted = self._sizes, self._class, self._evicted
        history, shadow = self._history, self._shadow
        hsizes, skeys = history._sizes, shadow._keys
        if (self._pins or self.admission is not None or self.capacity_bytes < 1 or self._used != len(sizes)
                or history.used_bytes != len(hsizes) or shadow._used != len(skeys)
                or self._evicted_bytes != len(evicted) or shadow._seen != shadow._accesses
                or type(self)._temper is not AdaptivePolicy._temper
                or not all(k in cls for k in self._current)
                # The weight bound's shortcut below needs positive weights and a ratio of at least 1.
                or not (0.0 <= self.learning_rate < 1.0 and self.max_weight_ratio >= 1.0 and min(self._model) > 0.0)):
            return None
        fresh_list, again, tail_list = lists = self._lists
        fresh_move, again_move, tail_move = (lst.move_to_end for lst in lists)
        hmove, hpop, smove, spop, epop = (hsizes.move_to_end, hsizes.popitem, skeys.move_to_end, skeys.popitem,
                                          evicted.popitem)
        hcap, h_used = history.capacity_bytes, history.used_bytes
        scap, s_used = shadow.capacity, shadow._used
        # A window closes once both its bytes and its accesses reach their minimum; with unit sizes they are equal.
        window = max(shadow.window, shadow.min_accesses)
        decay = shadow.decay
        s_run, s_shadow_run = shadow._run, shadow._shadow_run
        s_acc, s_diff, s_score = shadow._accesses, shadow._diff, shadow._score
        # Class weights: the model (m*) and what eviction reads (e*: the model itself while fully trusted, else
        # the model tempered by trust). FRESH = 0, AGAIN = 1, TAIL = 2.
        w = self._model
        m0, m1, m2 = w
        trusted = self._weights is w
        e0, e1, e2 = self._weights
        trust = self._trust
        lr, max_ratio = self.learning_rate, self.max_weight_ratio
        shrink = 1.0 - lr
        ghost_fresh, ghost_again, ghost_tail = (FRESH, 1), (AGAIN, 1), (TAIL, 1)
        ghost_limit = self.ghost_factor * self.capacity_bytes
        capacity = self.capacity_bytes
        used, tick, request = self._used, self._tick, self._request
        current = {k: cls[k] for k in self._current}  # key -> its class, kept equal to cls[key]
        ghost_rate, evictions, ev_used = self._ghost_rate, self._evictions, self._evicted_bytes
        # Each class's head (its oldest entry) and that entry's tick, cached for the victim choice; no_head: look
        # it up. Only a head that is not in the running request is cached (for one that is, the candidate is the
        # list's tail, which every insert changes). A cached head stays the head until it is evicted, hit (a hit
        # deletes it from FRESH/TAIL or moves it to AGAIN's young end) -- both reset the cache -- since inserts and
        # closing a request only move keys to the young end, and a cached head is never in the running request
        # (accessing it would be a hit). An empty class never has a cached head: its last entry left by one of
        # those two ways.
        no_head = _NO_HEAD  # not None: None may be a key
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
                            for k in tail_list:
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
                            for k in fresh_list:
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
                            for k in again:
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
                    w[0], w[1], w[2] = m0, m1, m2
                    self._hedge(s_score)
                    trust = self._trust
                    trusted = self._weights is w
                    e0, e1, e2 = self._weights
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
            shadow._request = s_request
        # Write the state back in the public path's form.
        sizes.clear()
        sizes.update(dict.fromkeys(cls, 1))
        history.used_bytes = h_used
        shadow._used, shadow._run, shadow._shadow_run = s_used, s_run, s_shadow_run
        shadow._seen = shadow._accesses = s_acc
        shadow._diff, shadow._score = s_diff, s_score
        w[0], w[1], w[2] = m0, m1, m2
        self._weights = w if trusted else [e0, e1, e2]
        self._used, self._tick, self._request, self._current = used, tick, request, dict.fromkeys(current)
        self._ghost_rate, self._evictions, self._evicted_bytes = ghost_rate, evictions, ev_used
        return hits

    def _order_clear(self) -> None:
        for lst in self._lists:
            lst.clear()
        self._class.clear()
        self._history.clear()
        self._evicted.clear()
        self._evicted_bytes = 0
        self._model = list(self.initial_weights)
        self._weights = self._model
        self._ghost_rate = 0.0
        self._evictions = 0
        self._tick = 0
        self._request = None
        self._current = {}
        self._shadow.clear()
        self._trust = 1.0


class _RecencyShadow:
    """A metadata-only LRU of the same capacity, fed the policy's accesses, scoring both on prefix hits.

    ``observe`` returns ``None`` until a window of accesses is complete, then the decayed sum of
    (policy's prefix hits - shadow's prefix hits) per window: negative when plain recency would have done better.
    An access is a prefix hit when it hits and every earlier access of its request did (without an
    :class:`AccessContext` each access is its own request, so the score is the block hit count).
    """

    __slots__ = ("capacity", "window", "min_accesses", "decay", "_keys", "_used", "_request", "_run", "_shadow_run",
                 "_seen", "_accesses", "_diff", "_score")

    def __init__(self, capacity_bytes: int, window_bytes: int, min_accesses: int, decay: float) -> None:
        self.capacity, self.window, self.min_accesses, self.decay = capacity_bytes, window_bytes, min_accesses, decay
        self._keys: OrderedDict[Key, int] = OrderedDict()
        self.clear()

    def clear(self) -> None:
        self._keys.clear()
        self._used = 0
        self._request: Hashable = None
        self._run = self._shadow_run = True
        self._seen = self._accesses = self._diff = 0
        self._score = 0.0

    def observe(self, key: Key, size: int, ctx: AccessContext | None, hit: bool) -> float | None:
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            shadow_hit = True
        else:
            shadow_hit = False
            keys[key] = size
            self._used += size
            while self._used > self.capacity:
                self._used -= keys.popitem(last=False)[1]
        if ctx is None or ctx.request_id is None:
            run, shadow_run = hit, shadow_hit
            self._request = None
        else:
            if ctx.request_id != self._request or ctx.position == 0:
                self._request = ctx.request_id
                self._run = self._shadow_run = True
            run = self._run = self._run and hit
            shadow_run = self._shadow_run = self._shadow_run and shadow_hit
        self._diff += run - shadow_run
        self._seen += size
        self._accesses += 1
        if self._seen < self.window or self._accesses < self.min_accesses:
            return None
        self._score = self._score * self.decay + self._diff
        self._seen = self._accesses = self._diff = 0
        return self._score
