"""One tick of the SLO guard: build the queries, measure, decide. The policy's pass (``controller``, in the
policy's lane thread) calls :func:`tick` when ``spec.slo.interval`` is due and turns the returned actions into its
status, Events and re-render (``slo_tick``); tests and the benchmark drive it the same way."""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from ..api.guard_state import SLOGuardState
from .decisions import Decision, evaluate
from .measurements import Measurements
from .queries import QuerySet, Scope, build_queries
from .settings import SLOSettings


class MeasurementSource(Protocol):
    def measure(self, queries: QuerySet) -> Measurements: ...


def queries_for(settings: SLOSettings, scope: Scope, engine: str | None = None) -> QuerySet:
    """The policy's three queries; ``engine`` (detected from the container) wins over ``spec.engine``."""
    chosen = engine or settings.engine or "vllm"
    return build_queries(chosen, scope, settings.window_s, settings.queries)


def tick(
    settings: SLOSettings,
    state: SLOGuardState | None,
    source: MeasurementSource,
    scope: Scope,
    now: float | datetime,
    *,
    engine: str | None = None,
    reenable_requests: Iterable[str] = (),
    generation: int | None = None,
) -> Decision:
    """Measure then :func:`evaluate` (``state``: the stored state, parsed; None when nothing is stored). A source
    that raises is an error reading (SLOUnknown), never a crash."""
    queries = queries_for(settings, scope, engine)
    try:
        measurements = source.measure(queries)
    except Exception as exc:
        measurements = Measurements.unreachable(f"{type(exc).__name__}: {exc}")
    return evaluate(settings, state, measurements, now, reenable_requests=reenable_requests, generation=generation)
