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
Trace replay takes the same steps in one fused loop (:mod:`kvtier_runtime.replay.fused`) over the policy's
named state (:meth:`AdaptivePolicy.snapshot`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from .base import AccessContext, AdmissionFilter, EvictionPolicy, Key
from .ghost import GhostList

FRESH, AGAIN, TAIL = 0, 1, 2
# On equal scores: a tail before a first-timer before a repeat (see _choose).
TIE_ORDER = (TAIL, FRESH, AGAIN)


def hedged_trust(trust: float, verdict: float, step: float, tolerance: float) -> float:
    """The trust after a hedge window closed with ``verdict`` (the decayed prefix-hit difference against the
    recency shadow): ``step`` lower while the policy trails by more than ``tolerance``, else ``step`` higher."""
    change = -step if verdict < -tolerance else step
    # Rounded so that ten steps down reach exactly 0 (plain leaf-first LRU), not 1e-16.
    return round(min(1.0, max(0.0, trust + change)), 9)


@dataclass(eq=False)
class AdaptiveState:
    """An :class:`AdaptivePolicy`'s state, named, for a loop that takes the policy's steps itself (trace replay's
    fused loop, :mod:`kvtier_runtime.replay.fused`): :meth:`AdaptivePolicy.snapshot` hands out the policy's own
    containers, which such a loop changes in place, and copies of its numbers, which it advances here and hands
    back with :meth:`AdaptivePolicy.restore`. Weights are (FRESH, AGAIN, TAIL); what eviction reads is the model
    tempered by trust (each weight to the power ``trust``, the model itself at 1)."""

    # What the policy is (fixed).
    capacity: int
    learning_rate: float
    max_weight_ratio: float
    ghost_limit: int  # ghosts remembered, in bytes
    hedge_step: float
    hedge_tolerance: float
    # Nothing pinned, no admission filter, and learning and tempering as this class does them: a loop may take the
    # policy's steps (a subclass may change how it tempers or hedges).
    plain: bool
    # The policy's containers: per class key -> tick of its last use (oldest first), key -> class, key -> size,
    # ghost -> (class evicted from, size), the history (key -> size, oldest first), the recency shadow's keys.
    lists: tuple[OrderedDict[Key, int], OrderedDict[Key, int], OrderedDict[Key, int]]
    classes: dict[Key, int]
    sizes: dict[Key, int]
    evicted: OrderedDict[Key, tuple[int, int]]
    history: OrderedDict[Key, int]
    shadow: OrderedDict[Key, int]
    # Its numbers (copies).
    used: int
    tick: int
    request: Hashable
    current: list[Key]  # the running request's keys, in access order
    evicted_bytes: int
    model: tuple[float, float, float]
    trust: float
    ghost_rate: float
    evictions: int
    history_capacity: int
    history_used: int
    shadow_capacity: int
    shadow_used: int
    shadow_window: int  # bytes of accesses per hedge window, and at least shadow_min_accesses accesses
    shadow_min_accesses: int
    shadow_decay: float
    shadow_request: Hashable
    run: bool  # the running request's prefix still hits (the policy's, then the shadow's)
    shadow_run: bool
    seen: int  # bytes and accesses of the window so far
    accesses: int
    diff: int  # prefix hits the policy made more than the shadow in this window
    score: float  # the decayed sum of the windows' diffs


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

    def __init__(self, capacity_bytes: int, admission: AdmissionFilter | None = None) -> None:
        super().__init__(capacity_bytes, admission)
        # Per class: key -> tick of its last use, oldest first.
        self._lists: tuple[OrderedDict[Key, int], OrderedDict[Key, int], OrderedDict[Key, int]] = (
            OrderedDict(), OrderedDict(), OrderedDict())
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
        self._trust = hedged_trust(self._trust, verdict, self.hedge_step, self.hedge_tolerance)
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
        for c in TIE_ORDER:
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
        for c in TIE_ORDER:
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

    # ---- the state, named (trace replay's fused loop takes the policy's steps itself: replay.fused) -------------
    def snapshot(self) -> AdaptiveState:
        """The policy's state, named: its own containers (a loop taking its steps changes them in place) and copies
        of its numbers, handed back with :meth:`restore`."""
        shadow = self._shadow
        return AdaptiveState(
            capacity=self.capacity_bytes, learning_rate=self.learning_rate, max_weight_ratio=self.max_weight_ratio,
            ghost_limit=self.ghost_factor * self.capacity_bytes, hedge_step=self.hedge_step,
            hedge_tolerance=self.hedge_tolerance,
            plain=(not self._pins and self.admission is None and type(self)._temper is AdaptivePolicy._temper
                   and type(self)._hedge is AdaptivePolicy._hedge),
            lists=self._lists, classes=self._class, sizes=self._sizes, evicted=self._evicted,
            history=self._history.entries, shadow=shadow._keys,
            used=self._used, tick=self._tick, request=self._request, current=list(self._current),
            evicted_bytes=self._evicted_bytes, model=(self._model[0], self._model[1], self._model[2]),
            trust=self._trust, ghost_rate=self._ghost_rate, evictions=self._evictions,
            history_capacity=self._history.capacity_bytes, history_used=self._history.used_bytes,
            shadow_capacity=shadow.capacity, shadow_used=shadow._used, shadow_window=shadow.window,
            shadow_min_accesses=shadow.min_accesses, shadow_decay=shadow.decay, shadow_request=shadow._request,
            run=shadow._run, shadow_run=shadow._shadow_run, seen=shadow._seen, accesses=shadow._accesses,
            diff=shadow._diff, score=shadow._score)

    def restore(self, state: AdaptiveState) -> None:
        """Take back the numbers of a :meth:`snapshot` a loop advanced (its containers are the policy's own)."""
        shadow = self._shadow
        self._model[0], self._model[1], self._model[2] = state.model
        self._trust = state.trust
        self._temper()
        self._used, self._tick, self._request = state.used, state.tick, state.request
        self._current = dict.fromkeys(state.current)
        self._ghost_rate, self._evictions, self._evicted_bytes = state.ghost_rate, state.evictions, state.evicted_bytes
        self._history.used_bytes = state.history_used
        shadow._used, shadow._request, shadow._run, shadow._shadow_run = (
            state.shadow_used, state.shadow_request, state.run, state.shadow_run)
        shadow._seen, shadow._accesses, shadow._diff, shadow._score = state.seen, state.accesses, state.diff, state.score

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
