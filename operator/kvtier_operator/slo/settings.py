"""The SLO guard's settings, parsed from a KVCachePolicy spec (camelCase, as stored in the API object).

The guard's logic takes this small frozen dataclass rather than the API's pydantic models, so it works on the
plain dict kopf hands a handler as well as on ``model.model_dump(by_alias=True)``. Every rejection names the
field path and the rule, like the rest of the API.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

# Same grammar as the CRD's duration pattern (Go-style, as Prometheus and kubectl users write them).
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

ENGINES = ("vllm", "trtllm")
ON_NO_DATA = ("hold", "breach")
REENABLE_MODES = ("manual", "auto")
ROLLOUT_STRATEGIES = ("immediate", "staged")
QUERY_OVERRIDE_KEYS = ("ttftP99", "itlP99", "requestRate")


class SLOSpecError(ValueError):
    """One or more SLO fields broke a rule; ``problems`` holds one ``path: message`` line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def parse_duration(value: Any) -> float:
    """Seconds in a Go-style duration (``150ms``, ``2s``, ``5m``, ``1h30m``); a bare number is seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration (e.g. 150ms, 2s, 5m, 1h)")
    if isinstance(value, timedelta):   # API models may hand over parsed durations
        value = value.total_seconds()
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{value!r} is not a non-negative number of seconds")
        return float(value)
    text = str(value).strip()
    if not re.match(DURATION_PATTERN, text):
        raise ValueError(f"{value!r} is not a duration (e.g. 150ms, 2s, 5m, 1h)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class PrometheusSettings:
    """Where the guard reads metrics (``spec.slo.prometheus``). Secrets are references; the operator reads them
    and :func:`kvtier_operator.slo.client.resolve_client_config` turns them into a connectable config."""

    url: str
    timeout_s: float = 10.0
    bearer_token: SecretKeyRef | None = None
    username: SecretKeyRef | None = None
    password: SecretKeyRef | None = None
    ca_bundle: SecretKeyRef | None = None


@dataclass(frozen=True)
class SLOSettings:
    """Everything the pure decision engine needs, in seconds and plain types."""

    # Tiers the guard manages: declared and enabled in the spec, hottest first.
    tiers: tuple[str, ...]
    prometheus: PrometheusSettings | None = None
    engine: str | None = None
    model_name: str | None = None
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    ttft_p99_max_ratio: float | None = None
    itl_p99_max_ratio: float | None = None
    window_s: float = 300.0
    interval_s: float = 30.0
    consecutive_breaches: int = 3
    on_no_data: str = "hold"
    min_request_rate: float = 0.2
    cooldown_s: float = 900.0
    reenable_mode: str = "manual"
    reenable_after_s: float = 3600.0
    probation_s: float = 1800.0
    dry_run: bool = False
    rollout_strategy: str = "immediate"
    stage_observation_s: float = 1800.0
    queries: Mapping[str, str] = field(default_factory=dict)
    # Declared with ``enabled: false``: never rendered, never touched by the guard, shown as Disabled.
    spec_disabled_tiers: tuple[str, ...] = ()
    # status.history holds at most 50 entries (API: HistoryEntry list, max_length 50).
    history_limit: int = 50

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "SLOSettings":
        """Parse a KVCachePolicy ``spec`` (the whole spec: ``slo``, ``rollout``, ``tiers``, ``engine``).

        Raises :class:`SLOSpecError` listing every problem as ``spec.<path>: <rule>``.
        """
        problems: list[str] = []
        if not isinstance(spec, Mapping):
            raise SLOSpecError([f"spec: must be an object, got {type(spec).__name__}"])
        slo = spec.get("slo")
        if slo is None:
            raise SLOSpecError(["spec.slo: required for the SLO guard"])
        if not isinstance(slo, Mapping):
            raise SLOSpecError([f"spec.slo: must be an object, got {type(slo).__name__}"])
        rollout = spec.get("rollout") or {}
        if not isinstance(rollout, Mapping):
            problems.append(f"spec.rollout: must be an object, got {type(rollout).__name__}")
            rollout = {}

        p = _Parser(problems)
        declared = p.tier_names(spec.get("tiers", []))
        off = {t.get("name") for t in spec.get("tiers") or [] if isinstance(t, Mapping) and t.get("enabled") is False}
        tiers = tuple(t for t in declared if t not in off)
        engine = spec.get("engine")
        if engine is not None and engine not in ENGINES:
            problems.append(f"spec.engine: {engine!r} is not one of {', '.join(ENGINES)}")
            engine = None

        reenable = slo.get("reenable") or {}
        if not isinstance(reenable, Mapping):
            problems.append(f"spec.slo.reenable: must be an object, got {type(reenable).__name__}")
            reenable = {}
        after = p.duration(reenable, "after", "spec.slo.reenable.after", 3600.0, positive=True)
        values: dict[str, Any] = dict(
            tiers=tiers,
            prometheus=p.prometheus(slo.get("prometheus")),
            engine=engine,
            model_name=p.string(slo, "modelName"),
            ttft_p99_s=p.duration(slo, "ttftP99", "spec.slo.ttftP99", None, positive=True),
            itl_p99_s=p.duration(slo, "itlP99", "spec.slo.itlP99", None, positive=True),
            ttft_p99_max_ratio=p.ratio(slo, "ttftP99MaxRatio"),
            itl_p99_max_ratio=p.ratio(slo, "itlP99MaxRatio"),
            window_s=p.duration(slo, "window", "spec.slo.window", 300.0, positive=True),
            interval_s=p.duration(slo, "interval", "spec.slo.interval", 30.0, positive=True),
            consecutive_breaches=p.integer(slo, "consecutiveBreaches", 3, minimum=1),
            on_no_data=p.enum(slo, "onNoData", ON_NO_DATA, "hold"),
            min_request_rate=p.number(slo, "minRequestRate", 0.2),
            cooldown_s=p.duration(slo, "cooldown", "spec.slo.cooldown", 900.0),
            reenable_mode=p.enum(reenable, "mode", REENABLE_MODES, "manual", path="spec.slo.reenable.mode"),
            reenable_after_s=after,
            probation_s=p.duration(reenable, "probation", "spec.slo.reenable.probation", 1800.0, positive=True),
            dry_run=p.boolean(slo, "dryRun", False),
            rollout_strategy=p.enum(rollout, "strategy", ROLLOUT_STRATEGIES, "immediate",
                                    path="spec.rollout.strategy"),
            stage_observation_s=p.duration(rollout, "stageObservation", "spec.rollout.stageObservation",
                                           1800.0, positive=True),
            queries=p.queries(slo.get("queries")),
            spec_disabled_tiers=tuple(t for t in declared if t in off),
        )
        if all(values[k] is None for k in ("ttft_p99_s", "itl_p99_s", "ttft_p99_max_ratio", "itl_p99_max_ratio")):
            problems.append("spec.slo: at least one of ttftP99, itlP99, ttftP99MaxRatio, itlP99MaxRatio is required")
        for key in ("ttftP99MaxRatio", "itlP99MaxRatio"):
            if slo.get(key) is not None and values["rollout_strategy"] != "staged":
                problems.append(
                    f"spec.slo.{key}: needs spec.rollout.strategy: staged (its baseline is measured by the "
                    "GPU-only first stage)"
                )
        if problems:
            raise SLOSpecError(problems)
        return cls(**values)


class _Parser:
    """Field readers that append ``path: rule`` problems instead of stopping at the first one."""

    def __init__(self, problems: list[str]):
        self.problems = problems

    def duration(self, obj: Mapping[str, Any], key: str, path: str, default: float | None,
                 positive: bool = False) -> float | None:
        raw = obj.get(key)
        if raw is None:
            return default
        try:
            seconds = parse_duration(raw)
        except ValueError as exc:
            self.problems.append(f"{path}: {exc}")
            return default
        if positive and seconds <= 0:
            self.problems.append(f"{path}: {raw!r} must be greater than zero")
            return default
        return seconds

    def ratio(self, slo: Mapping[str, Any], key: str) -> float | None:
        raw = slo.get(key)
        if raw is None:
            return None
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (1 < raw <= 100):
            self.problems.append(f"spec.slo.{key}: {raw!r} must be a number > 1 and <= 100 (a multiple of the "
                                 "baseline p99)")
            return None
        return float(raw)

    def number(self, obj: Mapping[str, Any], key: str, default: float) -> float:
        raw = obj.get(key)
        if raw is None:
            return default
        if isinstance(raw, str):
            try:
                raw = float(raw)
            except ValueError:
                pass
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < 0:
            self.problems.append(f"spec.slo.{key}: {raw!r} must be a number >= 0")
            return default
        return float(raw)

    def integer(self, obj: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
        raw = obj.get(key)
        if raw is None:
            return default
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
            self.problems.append(f"spec.slo.{key}: {raw!r} must be an integer >= {minimum}")
            return default
        return raw

    def boolean(self, obj: Mapping[str, Any], key: str, default: bool) -> bool:
        raw = obj.get(key)
        if raw is None:
            return default
        if not isinstance(raw, bool):
            self.problems.append(f"spec.slo.{key}: {raw!r} must be true or false")
            return default
        return raw

    def enum(self, obj: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str,
             path: str | None = None) -> str:
        raw = obj.get(key)
        if raw is None:
            return default
        if raw not in allowed:
            self.problems.append(f"{path or 'spec.slo.' + key}: {raw!r} is not one of {', '.join(allowed)}")
            return default
        return raw

    def tier_names(self, tiers: Any) -> tuple[str, ...]:
        if not isinstance(tiers, list):
            self.problems.append(f"spec.tiers: must be a list, got {type(tiers).__name__}")
            return ()
        names: list[str] = []
        for i, tier in enumerate(tiers):
            name = tier.get("name") if isinstance(tier, Mapping) else None
            if not isinstance(name, str) or not name:
                self.problems.append(f"spec.tiers[{i}].name: required")
            elif name in names:
                self.problems.append(f"spec.tiers[{i}].name: {name!r} is not unique")
            else:
                names.append(name)
        return tuple(names)

    def string(self, obj: Mapping[str, Any], key: str) -> str | None:
        raw = obj.get(key)
        if raw is None:
            return None
        if not isinstance(raw, str) or not raw:
            self.problems.append(f"spec.slo.{key}: {raw!r} must be a non-empty string")
            return None
        return raw

    def prometheus(self, raw: Any) -> PrometheusSettings | None:
        if raw is None:
            self.problems.append("spec.slo.prometheus.url: required")
            return None
        if not isinstance(raw, Mapping):
            self.problems.append(f"spec.slo.prometheus: must be an object, got {type(raw).__name__}")
            return None
        url = raw.get("url")
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            self.problems.append(f"spec.slo.prometheus.url: {url!r} must be an http:// or https:// URL")
            return None
        timeout = self.duration(raw, "timeout", "spec.slo.prometheus.timeout", 10.0, positive=True)
        auth = raw.get("auth") or {}
        if not isinstance(auth, Mapping):
            self.problems.append(f"spec.slo.prometheus.auth: must be an object, got {type(auth).__name__}")
            auth = {}
        refs = {k: self.key_ref(auth.get(k), f"spec.slo.prometheus.auth.{k}")
                for k in ("bearerToken", "username", "password")}
        if refs["bearerToken"] and (refs["username"] or refs["password"]):
            self.problems.append("spec.slo.prometheus.auth: set bearerToken, or username and password, not both")
        if bool(refs["username"]) != bool(refs["password"]):
            self.problems.append("spec.slo.prometheus.auth: username and password go together")
        return PrometheusSettings(
            url=url.rstrip("/"),
            timeout_s=timeout if timeout is not None else 10.0,
            bearer_token=refs["bearerToken"], username=refs["username"], password=refs["password"],
            ca_bundle=self.key_ref(raw.get("caBundle"), "spec.slo.prometheus.caBundle"),
        )

    def key_ref(self, raw: Any, path: str) -> SecretKeyRef | None:
        if raw is None:
            return None
        if not isinstance(raw, Mapping) or not raw.get("name") or not raw.get("key"):
            self.problems.append(f"{path}: must be an object with name and key")
            return None
        return SecretKeyRef(name=str(raw["name"]), key=str(raw["key"]))

    def queries(self, raw: Any) -> dict[str, str]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            self.problems.append(f"spec.slo.queries: must be an object, got {type(raw).__name__}")
            return {}
        out: dict[str, str] = {}
        for key, value in raw.items():
            if key not in QUERY_OVERRIDE_KEYS:
                self.problems.append(f"spec.slo.queries.{key}: unknown; expected one of {', '.join(QUERY_OVERRIDE_KEYS)}")
            elif not isinstance(value, str) or not value.strip():
                self.problems.append(f"spec.slo.queries.{key}: must be a non-empty PromQL string")
            else:
                out[key] = value
        return out
