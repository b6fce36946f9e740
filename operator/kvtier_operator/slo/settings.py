"""The SLO guard's settings: the API models' ``spec.slo``, ``spec.rollout`` and ``spec.tiers`` in the units the
decision engine computes with (seconds, names).

Nothing here parses: the API models (``api/v1alpha1.py``) are the one parser of a spec and hold the one default
of every field; durations arrive already in seconds (the models' ``*_s`` views). The operator builds settings
from a parsed spec only (:meth:`SLOSettings.from_policy_spec`); tests and benchmarks that hold a raw mapping go
through the models first (``tests/plugins/slo_harness.slo_settings``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ..api import v1alpha1 as api

# spec.slo.queries keys (ttftP99, itlP99, requestRate), from the model that defines them.
QUERY_OVERRIDE_KEYS = tuple(f.alias or n for n, f in api.QueryOverrides.model_fields.items())
# Secret references are the API's own model (name, key); re-exported for the Prometheus client.
SecretKeyRef = api.SecretKeyRef


class SLOSpecError(ValueError):
    """The spec broke one or more rules; ``problems`` holds one ``path: message`` line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class PrometheusSettings:
    """Where the guard reads metrics (``spec.slo.prometheus``). Secrets are references; the operator reads them
    and :func:`kvtier_operator.slo.client.resolve_client_config` turns them into a connectable config."""

    url: str
    timeout_s: float
    bearer_token: Optional[SecretKeyRef] = None
    username: Optional[SecretKeyRef] = None
    password: Optional[SecretKeyRef] = None
    ca_bundle: Optional[SecretKeyRef] = None

    @classmethod
    def from_model(cls, prom: api.PrometheusSpec) -> PrometheusSettings:
        auth = prom.auth or api.PrometheusAuth()
        return cls(url=prom.url.rstrip("/"), timeout_s=prom.timeout_s, bearer_token=auth.bearer_token,
                   username=auth.username, password=auth.password, ca_bundle=prom.ca_bundle)


@dataclass(frozen=True)
class SLOSettings:
    """Everything the pure decision engine needs, in seconds and plain types. No defaults: every value comes
    from the API model, which holds the only default of each field."""

    # Tiers the guard manages: declared and enabled in the spec, hottest first.
    tiers: tuple[str, ...]
    prometheus: PrometheusSettings
    engine: Optional[str]
    model_name: Optional[str]
    ttft_p99_s: Optional[float]
    itl_p99_s: Optional[float]
    ttft_p99_max_ratio: Optional[float]
    itl_p99_max_ratio: Optional[float]
    window_s: float
    interval_s: float
    consecutive_breaches: int
    on_no_data: str
    min_request_rate: float
    cooldown_s: float
    reenable_mode: str
    reenable_after_s: float
    probation_s: float
    dry_run: bool
    rollout_strategy: str
    stage_observation_s: float
    # camelCase keys as in spec.slo.queries (ttftP99, itlP99, requestRate), set ones only.
    queries: Mapping[str, str]
    # Declared with ``enabled: false``: never rendered, never touched by the guard, shown as Disabled.
    spec_disabled_tiers: tuple[str, ...]
    # The idle check's range (spec.slo.idleWindow): informational, never part of a verdict.
    idle_window_s: float
    # The engines export kvtier's per-tier hit and lookup counters (backend kvtier): tiers' hit ratios exist.
    tier_counters: bool
    history_limit: int = api.HISTORY_LIMIT

    @property
    def declared(self) -> list[tuple[str, bool]]:
        """Every declared tier with whether the spec enables it (``tiers.derive``'s input); the ones declared with
        ``enabled: false`` come last, which changes nothing of the Enabled tiers' order."""
        return [(t, True) for t in self.tiers] + [(t, False) for t in self.spec_disabled_tiers]

    @property
    def staged(self) -> bool:
        return self.rollout_strategy == "staged"

    @classmethod
    def from_policy_spec(cls, spec: api.KVCachePolicySpec) -> SLOSettings:
        """The guard's view of a parsed spec; raises :class:`SLOSpecError` when the spec has no ``slo``."""
        slo = spec.slo
        if slo is None:
            raise SLOSpecError(["spec.slo: required for the SLO guard"])
        queries = slo.queries.model_dump(by_alias=True, exclude_none=True) if slo.queries else {}
        return cls(
            tiers=tuple(t.name for t in spec.tiers if t.enabled),
            prometheus=PrometheusSettings.from_model(slo.prometheus),
            engine=spec.engine,
            model_name=slo.model_name,
            ttft_p99_s=slo.ttft_p99_s,
            itl_p99_s=slo.itl_p99_s,
            ttft_p99_max_ratio=slo.ttft_p99_max_ratio,
            itl_p99_max_ratio=slo.itl_p99_max_ratio,
            window_s=slo.window_s,
            interval_s=slo.interval_s,
            consecutive_breaches=slo.consecutive_breaches,
            on_no_data=slo.on_no_data,
            min_request_rate=slo.min_request_rate,
            cooldown_s=slo.cooldown_s,
            reenable_mode=slo.reenable.mode,
            reenable_after_s=slo.reenable.after_s,
            probation_s=slo.reenable.probation_s,
            dry_run=slo.dry_run,
            rollout_strategy=spec.rollout.strategy,
            stage_observation_s=spec.rollout.stage_observation_s,
            queries=queries,
            spec_disabled_tiers=tuple(t.name for t in spec.tiers if not t.enabled),
            idle_window_s=slo.idle_window_s,
            tier_counters=spec.backend == "kvtier",
        )
