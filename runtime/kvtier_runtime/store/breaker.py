"""A circuit breaker per tier: stop loading from a tier once that costs more than recomputing (docs/breaker.md).

A :class:`Breaker` judges one tier from what its loads cost: samples of (busy seconds, chunks) measured by the
books (:class:`LoadMeter`: the time the tier had loads in flight, over the chunks those loads delivered, so a long
prefix read in parallel costs what it really took; one chunk per load). It compares the mean cost over the last ``window_chunks`` chunks
with what recomputing one chunk costs (``tokens_per_chunk / recompute_tokens_per_s``, from the spec's config):

* ``closed`` (serving): once at least ``min_chunks`` chunks were measured and loads cost ``open_ratio`` times
  recomputing or more, it **opens**.
* ``open``: lookups on the tier answer miss (vLLM recomputes; the books count it as ``bypassed``) and no stores
  are queued to it. Loads already in flight finish or fail as before: the breaker never changes which bytes are
  served, only whether the tier is asked. After ``open_dwell_s`` it goes **half-open**.
* ``half_open``: one probe load at a time, at most one every ``probe_interval_s``, may go through (likewise one
  store job), the rest is bypassed. After ``probe_chunks`` probe chunks: at or under ``close_ratio`` times
  recomputing it **closes** (no sooner than ``half_open_dwell_s`` after it went half-open), else it opens again.
* ``disabled``: forced open by the control file (:mod:`.control`) until released, then half-open.

``open_ratio > close_ratio`` (hysteresis), a minimum dwell in every state and a minimum number of chunks before any
verdict keep a tier whose latency is noisy but acceptable from flapping. Every transition is logged once, with the
figures behind it. Without a recompute rate nothing is judged by cost: a tier is bypassed only while the control
file disables it, and a released tier closes after ``probe_chunks`` probe chunks that did not time out.

Pure logic with an injectable clock (no torch, no I/O): the books (:mod:`.books`) wire it to the tiers.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import OffloadSpecConfig
from .control import ControlFile, ControlState

CLOSED, OPEN, HALF_OPEN, DISABLED = "closed", "open", "half_open", "disabled"
# Why a tier is bypassed (the ``reason`` label of vllm:kv_offload_kvtier_tier_bypassed).
SLOW, FORCED = "slow", "disabled"
BYPASS_REASONS: tuple[str, ...] = (SLOW, FORCED)
# What a gate answers: go ahead, go ahead as the state's one probe (report its end), or skip the tier.
PASS, PROBE, BYPASS = "pass", "probe", "bypass"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerSettings:
    """How a :class:`Breaker` judges. ``recompute_s_per_token`` None: no verdict by cost (control file only)."""

    recompute_s_per_token: float | None = None
    tokens_per_chunk: int = 1
    open_ratio: float = 1.5
    close_ratio: float = 0.8
    window_chunks: int = 64
    min_chunks: int = 16
    probe_chunks: int = 4
    closed_dwell_s: float = 10.0
    open_dwell_s: float = 30.0
    half_open_dwell_s: float = 5.0
    probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        r = self.recompute_s_per_token
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)
                              or r <= 0):
            raise ValueError(f"recompute_s_per_token: {r!r} must be a positive number")
        for name in ("tokens_per_chunk", "window_chunks", "min_chunks", "probe_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: {value!r} must be a positive integer")
        if self.min_chunks > self.window_chunks:
            raise ValueError(f"min_chunks: {self.min_chunks} must not exceed window_chunks ({self.window_chunks})")
        if not 0 < self.close_ratio < self.open_ratio:
            raise ValueError(f"close_ratio: {self.close_ratio!r} must be in (0, open_ratio = {self.open_ratio!r}) "
                             "(hysteresis)")
        for name in ("closed_dwell_s", "open_dwell_s", "half_open_dwell_s", "probe_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: {value!r} must be a non-negative number of seconds")

    @property
    def recompute_s_per_chunk(self) -> float | None:
        r = self.recompute_s_per_token
        return None if r is None else r * self.tokens_per_chunk


class _Window:
    """The last ``size`` chunks' samples: (seconds, chunks, timeouts); the cost is their mean per chunk."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.samples: deque[tuple[float, int, int]] = deque()
        self.seconds = 0.0
        self.chunks = 0
        self.timeouts = 0

    def add(self, seconds: float, chunks: int, timeouts: int) -> None:
        self.samples.append((seconds, chunks, timeouts))
        self.seconds += seconds
        self.chunks += chunks
        self.timeouts += timeouts
        while self.chunks - self.samples[0][1] >= self.size:
            s, c, t = self.samples.popleft()
            self.seconds -= s
            self.chunks -= c
            self.timeouts -= t

    def clear(self) -> None:
        self.__init__(self.size)  # type: ignore[misc]

    @property
    def cost(self) -> float | None:
        return self.seconds / self.chunks if self.chunks else None


class Breaker:
    """The breaker of one tier (see the module's docstring). ``measured`` False: a tier whose loads are not timed
    (the host tier: vLLM's workers copy its rows); it is bypassed only while disabled, and closes when released."""

    def __init__(self, name: str, settings: BreakerSettings, *, clock: Callable[[], float] = time.monotonic,
                 measured: bool = True, logger: logging.Logger | None = None) -> None:
        self.name = name
        self.settings = settings
        self.clock = clock
        self.measured = measured
        self.log = logger or log
        self.state = CLOSED
        self.reason: str | None = None  # SLOW or FORCED while not closed
        self.since = float("-inf")  # no dwell at start-up: a tier slow from the first load opens at once
        self.transitions: Counter[str] = Counter()
        self._window = _Window(settings.window_chunks)
        self._probing = {"load": False, "store": False}
        self._next_probe = {"load": float("-inf"), "store": float("-inf")}

    # ---- what the books ask ----
    @property
    def bypassed(self) -> bool:
        """Whether the tier is (mostly) skipped: open, half-open or disabled."""
        self.tick()
        return self.state != CLOSED

    @property
    def serving(self) -> bool:
        return not self.bypassed

    def load_gate(self) -> str:
        return self._gate("load")

    def store_gate(self) -> str:
        return self._gate("store")

    def _gate(self, kind: str) -> str:
        self.tick()
        if self.state == CLOSED:
            return PASS
        if self.state != HALF_OPEN or self._probing[kind] or self.clock() < self._next_probe[kind]:
            return BYPASS
        return PROBE

    def probe_started(self, kind: str) -> None:
        """A gate's PROBE was used: no other probe of ``kind`` until :meth:`probe_finished`."""
        if self.state == HALF_OPEN:
            self._probing[kind] = True

    def probe_finished(self, kind: str) -> None:
        self._probing[kind] = False
        self._next_probe[kind] = self.clock() + self.settings.probe_interval_s

    def record(self, seconds: float, chunks: int, timeouts: int = 0) -> None:
        """Loads of ``chunks`` chunks kept the tier busy ``seconds`` (``timeouts`` of them timed out)."""
        if chunks <= 0 or not self.measured:
            return
        if self.state == OPEN:
            self.tick()
        if self.state not in (CLOSED, HALF_OPEN):
            return  # loads started before the tier opened: the verdict is taken
        self._window.add(max(0.0, seconds), chunks, timeouts)
        self._judge()

    def tick(self) -> None:
        """Time-driven transitions: open -> half-open after its dwell; half-open -> closed once healthy probes have
        waited out its dwell."""
        if self.state == OPEN and self.clock() - self.since >= self.settings.open_dwell_s:
            self._enter(HALF_OPEN, self.reason,
                        f"letting one probe load and one store job through every {self.settings.probe_interval_s:g} s")
        elif self.state == HALF_OPEN and self._window.chunks >= self.settings.probe_chunks:
            self._judge()

    def force(self, disabled: bool, why: str = "") -> None:
        """Disable the tier (bypassed until released) or release it (then half-open, or closed if not measured)."""
        if disabled and self.state != DISABLED:
            self._enter(DISABLED, FORCED, f"disabled{why}; lookups bypass it, no stores are queued to it")
        elif not disabled and self.state == DISABLED:
            if self.measured:
                self._enter(HALF_OPEN, FORCED, f"re-enabled{why}; letting one probe load and one store job through "
                                               f"every {self.settings.probe_interval_s:g} s")
            else:
                self._enter(CLOSED, None, f"re-enabled{why}")

    # ---- verdicts ----
    def _judge(self) -> None:
        s, w = self.settings, self._window
        limit = s.recompute_s_per_chunk
        now = self.clock()
        if self.state == CLOSED:
            if (limit is None or w.chunks < s.min_chunks or now - self.since < s.closed_dwell_s
                    or w.cost < s.open_ratio * limit):  # type: ignore[operator]
                return
            self._enter(OPEN, SLOW, f"loads cost {self._figures()} (open at {s.open_ratio:g}x); lookups bypass it, "
                                    f"no stores are queued to it; probing again in {s.open_dwell_s:g} s")
        elif self.state == HALF_OPEN and w.chunks >= s.probe_chunks:
            healthy = w.timeouts == 0 if limit is None else w.cost <= s.close_ratio * limit  # type: ignore[operator]
            if not healthy:
                self._enter(OPEN, SLOW,
                            f"probes cost {self._figures()} (close at {s.close_ratio:g}x); probing again in "
                            f"{s.open_dwell_s:g} s")
            elif now - self.since >= s.half_open_dwell_s:
                self._enter(CLOSED, None, f"probes cost {self._figures()} (close at {s.close_ratio:g}x); serving "
                                          "again")

    def _figures(self) -> str:
        w, s = self._window, self.settings
        cost = w.cost or 0.0
        text = (f"{cost * 1e3:.3g} ms/chunk ({cost / s.tokens_per_chunk * 1e6:.3g} us/token) over the last "
                f"{w.chunks} chunks")
        if w.timeouts:
            text += f", {w.timeouts} timed out"
        limit = s.recompute_s_per_chunk
        if limit is not None:
            text += (f", {cost / limit:.2f}x recomputing them ({limit * 1e3:.3g} ms/chunk at "
                     f"{1 / s.recompute_s_per_token:.0f} tokens/s)")  # type: ignore[operator]
        return text

    def _enter(self, state: str, reason: str | None, detail: str) -> None:
        before = self.state
        self.state, self.reason, self.since = state, reason, self.clock()
        self._window.clear()
        self._probing = {"load": False, "store": False}
        self._next_probe = {"load": float("-inf"), "store": float("-inf")}
        self.transitions[state] += 1
        self.log.warning("kvtier: tier %s: breaker %s -> %s: %s", self.name, before, state, detail)

    def bypass_gauges(self) -> dict[str, int]:
        """reason -> 1 if the tier is bypassed for it, else 0 (every reason, so a cleared one reads 0)."""
        on = self.bypassed
        return {r: int(on and self.reason == r) for r in BYPASS_REASONS}

    @property
    def cost_s_per_chunk(self) -> float | None:
        """The current window's mean load cost (None before any sample since the last transition)."""
        return self._window.cost


class LoadMeter:
    """Busy time of one tier's loads: the union of the intervals (start, end) of the loads that ended, so loads in
    parallel count once and idle time not at all. The end of a load is when the tier finished it (its
    ``on_complete`` callback, :meth:`on_complete`, from the tier's thread), else when the books collected it (at
    most one scheduler step later). :meth:`take` hands the loads ended since the last call over as one sample."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._ends: dict[int, float] = {}  # load job id -> when the tier finished it
        self._ended: list[tuple[float, float, bool]] = []  # (start, end, timed out) not yet taken
        self._mark = float("-inf")  # busy time is counted up to here

    def on_complete(self, result: Any) -> None:
        """A tier's ``on_complete`` callback (any thread): remember when a load job finished."""
        if getattr(result, "kind", "load") == "load":
            with self._lock:
                self._ends[result.job_id] = self.clock()

    def ended(self, job_id: int, started: float, timed_out: bool = False) -> None:
        """The books saw load ``job_id`` (started at ``started`` on this meter's clock) end."""
        with self._lock:
            end = self._ends.pop(job_id, None)
        self._ended.append((started, self.clock() if end is None else end, timed_out))

    def forget(self, job_id: int) -> None:
        """A load that ended uncounted (counted earlier, when it expired): drop its end time."""
        with self._lock:
            self._ends.pop(job_id, None)

    def take(self) -> tuple[float, int, int] | None:
        """(busy seconds, loads, timeouts) of the loads ended since the last call, or None if none did."""
        if not self._ended:
            return None
        busy = 0.0
        for start, end, _ in sorted(self._ended, key=lambda e: e[1]):
            busy += max(0.0, end - max(start, self._mark))
            self._mark = max(self._mark, end)
        n, timeouts = len(self._ended), sum(1 for e in self._ended if e[2])
        self._ended = []
        return busy, n, timeouts


class TierBreakers:
    """The breakers of one engine's tiers, index 0 the host tier then the books' tiers in lookup order, with their
    load meters and the control file. ``aliases[i]``: other names tier ``i`` answers to in the control file."""

    def __init__(self, names: Sequence[str], settings: BreakerSettings | None = None, *,
                 measured: Sequence[bool] | None = None, aliases: Sequence[Sequence[str]] | None = None,
                 control_file: str | None = None, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None, tick_interval_s: float = 1.0) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"names: {list(names)} must be distinct")
        self.settings = settings or BreakerSettings()
        self.clock = clock
        self.log = logger or log
        measured = list(measured) if measured is not None else [i > 0 for i in range(len(names))]
        self.breakers = [Breaker(n, self.settings, clock=clock, measured=m, logger=self.log)
                         for n, m in zip(names, measured)]
        self.meters = [LoadMeter(clock) for _ in names]
        self._by_name: dict[str, int] = {name: i for i, name in enumerate(names)}  # a name wins over an alias
        for i, more in enumerate(aliases or ()):
            for alias in more:
                self._by_name.setdefault(alias, i)
        self.control = (ControlFile(control_file, set(self._by_name), clock=clock, logger=self.log)
                        if control_file else None)
        self.tick_interval_s = tick_interval_s
        self._next_tick = float("-inf")
        self.bypassed_lookups: Counter[str] = Counter()  # tier name -> lookups that skipped it
        self.bypassed_stores: Counter[str] = Counter()  # tier name -> chunks not written to it
        if self.control is not None:
            self.tick(force=True)

    @classmethod
    def for_spec(cls, cfg: OffloadSpecConfig, tokens_per_chunk: int, *, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> TierBreakers:
        """The breakers of an offloading spec's tiers: named as ``cfg.names`` (each also answering to its address in
        the control file: ``host``, a root_dir, a url), judged against ``recompute_tokens_per_s`` when set,
        watching ``control_file`` when set."""
        rate = cfg.recompute_tokens_per_s
        if rate is not None and tokens_per_chunk < 1:
            (logger or log).warning("kvtier: recompute_tokens_per_s is set but the engine's config gives no tokens "
                                    "per chunk; the breakers count a chunk as one token")
        settings = BreakerSettings(recompute_s_per_token=None if rate is None else 1.0 / rate,
                                   tokens_per_chunk=max(1, tokens_per_chunk))
        addresses = [("host",), *((t.config.address,) for t in cfg.tiers)]
        return cls(cfg.names, settings, aliases=addresses, control_file=cfg.control_file, clock=clock,
                   logger=logger)

    def __getitem__(self, i: int) -> Breaker:
        return self.breakers[i]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.breakers]

    def tick(self, force: bool = False) -> None:
        """At most once per ``tick_interval_s`` (cheap to call on every lookup): read the control file if it
        changed, advance time-driven transitions."""
        now = self.clock()
        if not force and now < self._next_tick:
            return
        self._next_tick = now + self.tick_interval_s
        if self.control is not None:
            state = self.control.poll(force=True)
            if state is not None:
                self._apply(state)
        for b in self.breakers:
            b.tick()

    def _apply(self, state: ControlState) -> None:
        off = {self._by_name[n] for n in state.disabled}
        why = f" by {self.control.path} (generation {state.generation})"  # type: ignore[union-attr]
        self.log.info("kvtier: control file %s, generation %s: disabled tiers %s", self.control.path,  # type: ignore
                      state.generation, ", ".join(self.breakers[i].name for i in sorted(off)) or "none")
        for i, b in enumerate(self.breakers):
            b.force(i in off, why)

    def count_loads(self, i: int) -> None:
        """Hand the loads of tier ``i`` that ended since the last call to its breaker, as one sample."""
        sample = self.meters[i].take()
        if sample is not None:
            self.breakers[i].record(*sample)

    @property
    def generation(self) -> int | None:
        return self.control.state.generation if self.control is not None else None

    @property
    def control_errors(self) -> Counter[str]:
        return self.control.errors if self.control is not None else Counter()
