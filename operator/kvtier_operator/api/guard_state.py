"""``status.slo``: the SLO guard's stored state, as a typed model.

The guard keeps everything it needs across restarts here. Status can be edited by hand (or half-written by an
older operator), so reading it never fails: a field that does not validate takes its default, with two
exceptions that keep the system safe. A rolled-back tier stays rolled back (an unreadable entry becomes
``reason: Restored``, an unreadable ``since`` the time of reading), and an unreadable ``lastRollback`` becomes the
time of reading (the cooldown starts over rather than being skipped). The CRD keeps this object schemaless
(``x-kubernetes-preserve-unknown-fields``), so the API server stores whatever a newer version writes; unknown
keys are kept. The guard reads with :func:`load` (which passes the time of reading and refuses a newer version),
readers that never write it back with :func:`read`, and the stored form is :func:`dump`. A policy's pass parses it
once (:func:`read`, the guard checking the version apart: :func:`check_version`), hands the typed state to the
reconcile and the guard, and dumps the guard's new state once: the dict exists only at those two ends.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Optional

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .times import is_time

STATE_VERSION = 1


def _or(default: Callable[[ValidationInfo], Any]) -> WrapValidator:
    """A field that takes ``default(info)`` instead of failing validation."""
    def wrap(value: Any, handler: Any, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return default(info)
    return WrapValidator(wrap)


def _now(info: ValidationInfo) -> str:
    return str((info.context or {})["now"])


def _time(value: Any) -> Any:
    if value is not None and not is_time(value):
        raise ValueError("not an RFC 3339 time")
    return value


def _numbers(value: Any) -> list[float]:
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _none(info: ValidationInfo) -> None:
    return None


Count = Annotated[int, Field(ge=0, strict=True), _or(lambda info: 0)]
Time = Annotated[Optional[str], BeforeValidator(_time)]
# Optional values that read as unset when they do not validate.
OptTime = Annotated[Time, _or(_none)]
OptFloat = Annotated[Optional[float], _or(_none)]
OptStr = Annotated[Optional[str], _or(_none)]
Flag = Annotated[bool, Field(strict=True), _or(lambda info: False)]


class _State(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")


class Last(_State):
    ttft_p99: OptFloat = None
    itl_p99: OptFloat = None
    request_rate: OptFloat = None
    thresholds: Annotated[dict[str, float], _or(lambda info: {})] = Field(default_factory=dict)


class Counts(_State):
    evaluations: Count = 0
    breaches: Count = 0
    errors: Count = 0
    no_data: Count = 0
    low_traffic: Count = 0
    rollbacks: Count = 0


class DisabledTier(_State):
    since: Annotated[str, BeforeValidator(_time), _or(_now)] = None  # type: ignore[assignment]
    reason: OptStr = None
    metric: OptStr = None
    value: OptFloat = None
    threshold: OptFloat = None
    dry_run: Flag = False
    probation_failed: Flag = False

    @model_validator(mode="after")
    def _since(self, info: ValidationInfo) -> DisabledTier:
        if self.since is None:
            self.since = _now(info)
        return self


def _disabled(value: Any, info: ValidationInfo) -> Any:
    if not isinstance(value, dict):
        return {}
    # A rolled-back tier stays rolled back, whatever is left of its entry.
    return {t: e if isinstance(e, dict) else {"reason": "Restored"} for t, e in value.items()}


class ProbationTier(_State):
    since: Annotated[str, BeforeValidator(_time)]
    until: OptTime = None
    dry_run: Flag = False


def _probation(value: Any, handler: Any) -> Any:
    if not isinstance(value, dict):
        return {}
    out = {}
    for tier, entry in value.items():
        try:
            out[tier] = ProbationTier.model_validate(entry)
        except ValidationError:
            continue  # an unreadable probation is no probation
    return out


class Baseline(_State):
    ttft_p99: Optional[float] = None
    itl_p99: Optional[float] = None
    samples: Annotated[int, _or(lambda info: 0)] = 0
    recorded_at: OptTime = None
    tiers: Annotated[list[str], _or(lambda info: [])] = Field(default_factory=list)


class Samples(_State):
    ttft_p99: Annotated[list[float], BeforeValidator(_numbers)] = Field(default_factory=list)
    itl_p99: Annotated[list[float], BeforeValidator(_numbers)] = Field(default_factory=list)


class Rollout(_State):
    strategy: str
    rolled: Annotated[list[str], _or(lambda info: [])] = Field(default_factory=list)
    stage_start: Annotated[Time, _or(_now)] = None
    stage_ok: Annotated[int, Field(strict=True), _or(lambda info: 0)] = 0
    samples: Annotated[Samples, _or(lambda info: Samples())] = Field(default_factory=Samples)

    @model_validator(mode="after")
    def _stage_start(self, info: ValidationInfo) -> Rollout:
        if self.strategy == "staged" and self.stage_start is None:
            self.stage_start = _now(info)  # a stage must hold a full observation period, never none
        return self

    @model_serializer(mode="wrap")
    def _shape(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An immediate rollout has no stages: stored as ``strategy`` and ``rolled`` only, as it always was."""
        out: dict[str, Any] = handler(self)
        if self.strategy != "staged":
            return {k: out[k] for k in ("strategy", "rolled")}
        return out


class HistoryEntry(_State):
    """One tier change the guard made or simulated (``status.slo.history``, newest last): when, which tier, what
    (``Disabled``, ``WouldDisable``, ``Reenabled``, ``WouldReenable``, ``ProbationFailed``, ``ProbationPassed``,
    ``StageEnabled``), why, and the metric, value and threshold that decided it. Stored with the fields it has (an
    unset one is left out); a field that does not validate reads as unset, and keys a newer version wrote are
    kept."""

    time: OptTime = None
    tier: OptStr = None
    action: OptStr = None
    reason: OptStr = None
    metric: OptStr = None
    value: OptFloat = None
    threshold: OptFloat = None

    @model_serializer(mode="wrap")
    def _shape(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None}


def _history(value: Any) -> list[Any]:
    return [h for h in value if isinstance(h, (dict, HistoryEntry))] if isinstance(value, list) else []


class SLOGuardState(_State):
    version: int = STATE_VERSION
    observed_generation: Annotated[Optional[int], _or(_none)] = None
    last_evaluation: OptTime = None
    verdict: OptStr = None
    reason: OptStr = None
    last: Annotated[Last, _or(lambda info: Last())] = Field(default_factory=Last)
    consecutive_breaches: Count = 0
    consecutive_errors: Count = 0
    last_error: OptStr = None
    counts: Annotated[Counts, _or(lambda info: Counts())] = Field(default_factory=Counts)
    last_rollback: Annotated[Time, _or(_now)] = None
    # tier -> why and since when the guard disabled it
    disabled: Annotated[dict[str, DisabledTier], BeforeValidator(_disabled)] = Field(default_factory=dict)
    probation: Annotated[dict[str, ProbationTier], WrapValidator(_probation)] = Field(default_factory=dict)
    auto_reenable_blocked: Flag = False
    gpu_only_breach_reported: Flag = False
    baseline: Annotated[Optional[Baseline], _or(lambda info: None)] = None
    rollout: Annotated[Optional[Rollout], _or(lambda info: None)] = None
    # Newest last, at most spec.slo's history limit (the guard trims it).
    history: Annotated[list[HistoryEntry], BeforeValidator(_history)] = Field(default_factory=list)


def check_version(state: Optional[Mapping[str, Any]]) -> None:
    """Raise ValueError for a stored state written by a newer operator, which this one must not overwrite with what
    it understands (a look at its ``version``, not a parse)."""
    version = (state or {}).get("version", STATE_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > STATE_VERSION:
        raise ValueError(f"status.slo.version: {version} is newer than this operator understands")


def load(state: Optional[Mapping[str, Any]], now: str) -> SLOGuardState:
    """The stored state, readable whatever was stored (see the module's docstring); raises only for a state
    written by a newer operator (:func:`check_version`)."""
    check_version(state)
    return read(state, now)


def read(state: Optional[Mapping[str, Any]], now: str) -> SLOGuardState:
    """The stored state for a reader that never writes it back (which tiers are rendered): a newer version is
    read for what this operator understands of it, never refused. ``now``: the time of reading (RFC 3339)."""
    raw = dict(state) if isinstance(state, Mapping) else {}
    raw["version"] = STATE_VERSION
    return SLOGuardState.model_validate(raw, context={"now": now})


def dump(state: SLOGuardState) -> dict[str, Any]:
    """The stored form (``status.slo``): camelCase, every field present, JSON-able."""
    out: dict[str, Any] = state.model_dump(by_alias=True, mode="json")
    return out
