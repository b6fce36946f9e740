"""The SLO guard outside Kubernetes, for tests and benchmarks (not the product).

- :func:`slo_settings`: a raw ``spec`` mapping (camelCase, as stored) -> ``SLOSettings``, through the API models and
  their CEL rules first (``SLOSpecError`` lists every problem as ``spec.<path>: <rule>``). The operator itself
  always has a parsed spec (``SLOSettings.from_policy_spec``).
- :class:`GuardLoop`: a real-time driver: tick every ``interval``, keep the state as JSON. The operator runs the
  same ``slo.tick`` as a step of each policy's pass and stores the state in ``status.slo``; this driver stands in
  for that in tests, the reaction-time benchmark and ad-hoc dry runs against a live Prometheus.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_operator.api import guard_state
from kvtier_operator.api import v1alpha1 as api
from kvtier_operator.api.times import format_time
from kvtier_operator.api.validation import PolicyInvalid, parse_policy
from kvtier_operator.slo.decisions import Action, SetCondition, read_state, stored_state
from kvtier_operator.slo.guard import MeasurementSource, tick
from kvtier_operator.slo.queries import Scope
from kvtier_operator.slo.settings import SLOSettings, SLOSpecError
from kvtier_operator.tiers import derive, enabled


def slo_settings(spec: Mapping[str, Any] | api.KVCachePolicySpec) -> SLOSettings:
    """From a parsed spec, or a raw one validated by the API models and their CEL rules first."""
    if isinstance(spec, api.KVCachePolicySpec):
        return SLOSettings.from_policy_spec(spec)
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "slo"}, "spec": spec}
    try:
        policy = parse_policy(doc)
    except PolicyInvalid as err:
        raise SLOSpecError([str(p) for p in err.problems]) from None
    return SLOSettings.from_policy_spec(policy.spec)


def derived_tiers(settings: SLOSettings, stored: Mapping[str, Any] | None, now: float = 0.0) -> list[dict[str, Any]]:
    """``status.tiers`` as the operator derives them from a stored ``status.slo`` (``tiers.derive``, the one rule;
    the operator reads the spec's tiers in spec order, the guard's settings list the spec-disabled ones last)."""
    state = None if stored is None else guard_state.read(stored, format_time(now))
    return derive(settings.declared, settings.staged, state)


@dataclass
class TickRecord:
    wall: float        # the evaluation's "now" (what the decision engine compared its timers with)
    monotonic: float   # when the decision was available (after the queries)
    verdict: str
    reason: str
    values: dict[str, Any]
    consecutive_breaches: int
    actions: list[Action]
    conditions: dict[str, SetCondition]


@dataclass
class GuardLoop:
    settings: SLOSettings
    source: MeasurementSource
    scope: Scope
    engine: str | None = None
    state: dict[str, Any] | None = None
    records: list[TickRecord] = field(default_factory=list)
    clock: Callable[[], float] = time.time
    _next: float | None = None

    def tick(self, reenable_requests: Iterable[str] = (), generation: int | None = None) -> TickRecord:
        now = self.clock()
        # Parsed from and dumped to its stored form as the operator does with status.slo, and round-tripped
        # through JSON as status storage would, so nothing non-serialisable survives.
        decision = tick(self.settings, read_state(self.state, now), self.source, self.scope, now,
                        engine=self.engine, reenable_requests=reenable_requests, generation=generation)
        self.state = json.loads(json.dumps(stored_state(decision.state), allow_nan=False))
        st = self.state
        record = TickRecord(
            wall=now, monotonic=time.monotonic(), verdict=st["verdict"], reason=st["reason"],
            values={k: st["last"].get(k) for k in ("ttftP99", "itlP99", "requestRate")},
            consecutive_breaches=st["consecutiveBreaches"],
            actions=[a for a in decision.actions if not isinstance(a, SetCondition)],
            conditions={a.type: a for a in decision.actions if isinstance(a, SetCondition)},
        )
        self.records.append(record)
        return record

    def wait_next(self) -> None:
        """Sleep to the next interval boundary (fixed-rate, like a kopf timer; no drift from tick duration)."""
        now = time.monotonic()
        if self._next is None:
            self._next = now
        self._next += self.settings.interval_s
        if self._next > now:
            time.sleep(self._next - now)
        else:
            self._next = now

    def run_until(self, predicate: Callable[[GuardLoop], bool], timeout: float, **kw: Any) -> float:
        """Tick until ``predicate(self)`` holds after a tick; return seconds spent. Raises on timeout."""
        start = time.monotonic()
        while True:
            self.tick(**kw)
            if predicate(self):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"guard condition not reached within {timeout:g}s; last ticks: "
                                   f"{[(r.verdict, r.reason, r.values) for r in self.records[-5:]]}")
            self.wait_next()

    def run_for(self, seconds: float, **kw: Any) -> list[TickRecord]:
        start, first = time.monotonic(), len(self.records)
        while time.monotonic() - start < seconds:
            self.tick(**kw)
            self.wait_next()
        return self.records[first:]

    @property
    def enabled(self) -> list[str]:
        return enabled(self.tiers)

    @property
    def tiers(self) -> list[dict[str, Any]]:
        return derived_tiers(self.settings, self.state, self.clock())

    def actions(self, kind: str | None = None) -> list[Action]:
        return [a for r in self.records for a in r.actions if kind is None or a.kind == kind]
