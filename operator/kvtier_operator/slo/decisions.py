"""The SLO guard's decisions: a pure function from (settings, stored state, measurements, now) to a new state
and a list of actions.

Nothing here talks to Kubernetes or Prometheus. The state is the typed model of ``status.slo``
(:class:`~kvtier_operator.api.guard_state.SLOGuardState`): the operator parses the stored dict once before an
evaluation (:func:`read_state`) and stores :func:`stored_state` of the result after it, so an operator restart
resumes exactly where it stopped; the actions say what the operator must do (re-render without a tier, emit an
Event, set a condition, drop an annotation).

Rules:
- breach = a p99 over its threshold (absolute, or a multiple of the staged rollout's GPU-only baseline);
  ``consecutiveBreaches`` in a row disable the newest enabled tier;
- errors (query error, unreachable, NaN) are counted apart, set ``SLOUnknown``, never disable anything;
- no data / traffic under ``minRequestRate``: no verdict, the breach counter holds (unless ``onNoData: breach``);
- after a rollback nothing more is disabled before ``cooldown``; breaches are not counted before
  ``max(cooldown, window)`` because the window still measures the configuration that was just rolled back;
- ``dryRun``: the same machine runs, but its disables live only in the state (marked ``dryRun``) and its
  actions are marked ``dry_run`` so the operator records them and changes nothing;
- re-enable: manual (annotation / spec change) or ``auto`` after ``after`` with probation; a breach during
  probation disables the tier again at once and blocks automatic re-enabling until a person acts;
- staged rollout: GPU-only first (the baseline), then one tier per stage, each after the previous stage held
  the SLO for a full ``stageObservation``.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple, Union

from ..api import guard_state
from ..api.guard_state import Baseline, DisabledTier, HistoryEntry, Last, ProbationTier, Rollout, Samples, SLOGuardState
from ..api.times import format_time, parse_time
from ..tiers import derive, newest_enabled
from .measurements import Measurements, Reading
from .settings import SLOSettings

MAX_BASELINE_SAMPLES = 240

Verdict = Literal["ok", "breach", "noData", "lowTraffic", "error"]


# ----------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class DisableTier:
    """Mark the tier Disabled in status, re-render and re-apply (pods roll), Warning Event, count the rollback.
    With ``dry_run`` only the Event and the history entry: nothing changes."""

    tier: str
    reason: str
    message: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None
    dry_run: bool = False
    kind: str = field(default="DisableTier", init=False)


@dataclass(frozen=True)
class EnableTier:
    """Mark the tier Enabled, re-render and re-apply, Normal Event (``dry_run``: Event only)."""

    tier: str
    reason: str
    message: str
    dry_run: bool = False
    kind: str = field(default="EnableTier", init=False)


@dataclass(frozen=True)
class RecordEvent:
    """An Event on the policy with no change to the rendered configuration."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    kind: str = field(default="RecordEvent", init=False)


@dataclass(frozen=True)
class AcknowledgeReenable:
    """The ``kvtier.io/reenable`` request for ``tier`` was handled (``outcome``): remove the annotation."""

    tier: str
    outcome: Literal["Reenabled", "NotDisabled", "UnknownTier"]
    kind: str = field(default="AcknowledgeReenable", init=False)


@dataclass(frozen=True)
class SetCondition:
    """A status condition; the operator sets ``lastTransitionTime`` when ``status`` changes."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    kind: str = field(default="SetCondition", init=False)


Action = Union[DisableTier, EnableTier, RecordEvent, AcknowledgeReenable, SetCondition]


def action_to_dict(action: Action) -> dict[str, Any]:
    return asdict(action)


class Decision(NamedTuple):
    state: SLOGuardState
    actions: list[Action]


# --------------------------------------------------------------------------------------------------- time
def _epoch(now: float | datetime) -> float:
    if isinstance(now, datetime):
        if now.tzinfo is None:
            raise ValueError("now: a naive datetime is ambiguous; pass an aware one or epoch seconds")
        return now.timestamp()
    return float(now)


# -------------------------------------------------------------------------------------------------- state
def read_state(stored: Mapping[str, Any] | None, now: float | datetime) -> SLOGuardState:
    """``status.slo`` as stored, parsed once for an evaluation at ``now`` (unreadable fields take their defaults,
    see ``api.guard_state``); raises ValueError for a state a newer operator wrote."""
    return guard_state.load(stored, format_time(_epoch(now)))


def stored_state(state: SLOGuardState) -> dict[str, Any]:
    """The state as ``status.slo`` stores it (the JSON shape every operator version wrote)."""
    return guard_state.dump(state)


def _load(settings: SLOSettings, state: SLOGuardState | None, now: float) -> SLOGuardState:
    """A copy of the state to evolve (the caller's is never modified), with bookkeeping for tiers that left the
    spec and for a dry run switched off."""
    st = state.model_copy(deep=True) if state is not None else SLOGuardState()  # nothing stored: a new state
    tiers = set(settings.tiers)
    st.disabled = {t: v for t, v in st.disabled.items() if t in tiers}
    st.probation = {t: v for t, v in st.probation.items() if t in tiers}
    if not settings.dry_run:
        # Dry-run disables never happened; once dry run is off they must not linger as real ones.
        st.disabled = {t: v for t, v in st.disabled.items() if not v.dry_run}
        st.probation = {t: v for t, v in st.probation.items() if not v.dry_run}
    ro = st.rollout
    if settings.rollout_strategy == "staged":
        if ro is None or ro.strategy != "staged":
            # A policy switched from immediate to staged keeps what it was running; none yet: GPU-only first.
            ro = Rollout(strategy="staged", rolled=sorted(ro.rolled if ro is not None else []),
                         stage_start=format_time(now), stage_ok=0, samples=Samples())
        ro.rolled = [t for t in settings.tiers if t in ro.rolled]
    else:
        ro = Rollout(strategy="immediate", rolled=list(settings.tiers))
    st.rollout = ro
    return st


# ---------------------------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class Assessment:
    verdict: Verdict
    reason: str
    values: dict[str, float | None]
    thresholds: dict[str, float]
    breaches: tuple[tuple[str, float, float], ...] = ()   # (metric, value, threshold), worst first
    error: str | None = None


def thresholds(settings: SLOSettings, baseline: Baseline | None) -> dict[str, float]:
    """The active threshold per metric: the absolute one, the baseline multiple, or the stricter of both."""
    out: dict[str, float] = {}
    for metric, absolute, ratio in (
        ("ttftP99", settings.ttft_p99_s, settings.ttft_p99_max_ratio),
        ("itlP99", settings.itl_p99_s, settings.itl_p99_max_ratio),
    ):
        candidates = [absolute] if absolute is not None else []
        base = None if baseline is None else (baseline.ttft_p99 if metric == "ttftP99" else baseline.itl_p99)
        if ratio is not None and base is not None and base > 0:
            candidates.append(ratio * base)
        if candidates:
            out[metric] = min(candidates)
    return out


def measured_metrics(settings: SLOSettings) -> tuple[str, ...]:
    return tuple(m for m, a, r in (("ttftP99", settings.ttft_p99_s, settings.ttft_p99_max_ratio),
                                   ("itlP99", settings.itl_p99_s, settings.itl_p99_max_ratio))
                 if a is not None or r is not None)


def assess(settings: SLOSettings, measurements: Measurements, baseline: Baseline | None) -> Assessment:
    """Classify one evaluation. A valid breach wins over errors elsewhere; an error wins over missing data."""
    limits = thresholds(settings, baseline)
    readings: dict[str, Reading] = {"ttftP99": measurements.ttft_p99, "itlP99": measurements.itl_p99}
    values: dict[str, float | None] = {
        "ttftP99": _finite_or_none(readings["ttftP99"]),
        "itlP99": _finite_or_none(readings["itlP99"]),
        "requestRate": _finite_or_none(measurements.request_rate),
    }
    rate = measurements.request_rate
    if rate.is_error:
        return Assessment("error", "QueryError", values, limits, error=f"requestRate: {rate.error}")
    if rate.is_nan:
        return Assessment("error", "NaN", values, limits, error="requestRate: NaN")
    rate_value = rate.value
    if rate_value is None:  # answered, with no series
        return Assessment("noData", "NoRequestSeries", values, limits)
    if rate_value < 0:  # a rate is never negative: the query is wrong, and no verdict can come from it
        return Assessment("error", "InvalidValue", values, limits, error=f"requestRate: negative ({rate_value:g})")
    if rate_value <= 0 or rate_value < settings.min_request_rate:
        return Assessment("lowTraffic", "LowTraffic", values, limits)

    breaches: list[tuple[str, float, float]] = []
    errors: list[str] = []
    missing: list[str] = []
    for metric in measured_metrics(settings):
        reading = readings[metric]
        value = reading.value
        if reading.is_error:
            errors.append(f"{metric}: {reading.error}")
        elif value is None:  # answered, with no series
            missing.append(metric)
        elif reading.is_nan:
            # Traffic is flowing yet the quantile is undefined: the query or the scrape is wrong, not the SLO.
            errors.append(f"{metric}: NaN while requestRate is {rate_value:.3g}/s")
        elif value < 0:
            # A negative or -Inf latency is a broken query, never "within the SLO".
            errors.append(f"{metric}: negative ({value:g}); check the query")
        elif metric in limits and value > limits[metric]:   # +Inf (above every bucket) breaches too
            breaches.append((metric, value, limits[metric]))
    if breaches:
        breaches.sort(key=lambda b: b[1] / b[2], reverse=True)
        return Assessment("breach", "Breach", values, limits, tuple(breaches))
    if errors:
        return Assessment("error", "QueryError", values, limits, error="; ".join(errors))
    if missing:
        return Assessment("noData", "NoLatencySeries", values, limits)
    return Assessment("ok", "WithinSLO", values, limits)


INF_MARKER = 1e308


def _json_number(value: float | None) -> float | None:
    """Status is JSON for the API server: NaN becomes None, +Inf (a p99 above every bucket) becomes 1e308."""
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else INF_MARKER


def _finite_or_none(reading: Reading) -> float | None:
    return _json_number(reading.value)


# ---------------------------------------------------------------------------------------------- evaluate
def evaluate(
    settings: SLOSettings,
    state: SLOGuardState | None,
    measurements: Measurements,
    now: float | datetime,
    *,
    reenable_requests: Iterable[str] = (),
    generation: int | None = None,
) -> Decision:
    """One SLO evaluation. Pure: ``state`` (None: nothing stored yet) is not modified; the returned state replaces
    it (:func:`stored_state` in ``status.slo``).

    ``reenable_requests``: tier names a person asked to re-enable (the ``kvtier.io/reenable`` annotation,
    comma-separated; ``*`` means every disabled tier). ``generation``: the policy's ``metadata.generation``;
    a change since the last evaluation counts as a person acting (all rolled-back tiers come back).
    """
    t = _epoch(now)
    st = _load(settings, state, t)
    actions: list[Action] = []
    g = _Guard(settings, st, t, actions)

    if generation is not None:
        seen = st.observed_generation
        if seen is not None and generation != seen and st.disabled:
            g.manual_reenable(sorted(st.disabled, key=settings.tiers.index), "SpecChanged",
                              f"spec changed (generation {seen} -> {generation})", acknowledge=False)
        st.observed_generation = generation
    requests = _expand_requests(reenable_requests, st)
    if requests:
        g.handle_requests(requests)

    a = assess(settings, measurements, st.baseline)
    g.record(a)
    g.probation(a)
    g.rollback(a)
    g.auto_reenable(a)
    g.rollout(a)
    actions.extend(conditions(settings, st))
    st.history = st.history[-settings.history_limit:]
    return Decision(st, actions)


def _expand_requests(requests: Iterable[str], st: SLOGuardState) -> list[str]:
    out: list[str] = []
    for raw in requests:
        for name in str(raw).split(","):
            name = name.strip()
            if name in ("*", "all"):
                out.extend(t for t in st.disabled if t not in out)
            elif name and name not in out:
                out.append(name)
    return out


class _Guard:
    """The steps of one evaluation over a mutable copy of the state."""

    def __init__(self, settings: SLOSettings, st: SLOGuardState, now: float, actions: list[Action]):
        self.s, self.st, self.now, self.actions = settings, st, now, actions

    # -- bookkeeping
    def history(self, action: str, tier: str, reason: str = "", metric: str | None = None,
                value: float | None = None, threshold: float | None = None, dry_run: bool = False) -> None:
        """One ``status.slo.history`` entry (:class:`~kvtier_operator.api.guard_state.HistoryEntry`)."""
        if dry_run:
            action = {"Disabled": "WouldDisable", "ProbationFailed": "WouldDisable",
                      "Reenabled": "WouldReenable"}.get(action, action)
        self.st.history.append(HistoryEntry(time=format_time(self.now), tier=tier, action=action, reason=reason,
                                            metric=metric, value=value, threshold=threshold))

    def since(self, key_time: str | None) -> float:
        parsed = parse_time(key_time)
        return math.inf if parsed is None else self.now - parsed

    def newest_enabled(self) -> str | None:
        """The tier a rollback removes: the operator's one rule (``tiers.newest_enabled`` of ``tiers.derive``),
        where a dry run's simulated disables count as done."""
        return newest_enabled(derive(self.s.declared, self.s.staged, self.st), simulated=self.s.dry_run)

    # -- steps
    def handle_requests(self, requests: list[str]) -> None:
        for tier in requests:
            if tier not in self.s.tiers:
                self.actions.append(AcknowledgeReenable(tier, "UnknownTier"))
            elif tier not in self.st.disabled:
                self.actions.append(AcknowledgeReenable(tier, "NotDisabled"))
            else:
                self.manual_reenable([tier], "ManualReenable", "re-enabled by the kvtier.io/reenable annotation")

    def manual_reenable(self, tiers: list[str], reason: str, message: str, acknowledge: bool = True) -> None:
        for tier in tiers:
            entry = self.st.disabled.pop(tier)
            self.history("Reenabled", tier, reason=reason, dry_run=entry.dry_run)
            self.actions.append(EnableTier(tier, reason, f"{tier}: {message}", dry_run=entry.dry_run))
            if acknowledge:
                self.actions.append(AcknowledgeReenable(tier, "Reenabled"))
        # A person acted: automatic re-enabling may resume, and the streak starts over for the new config.
        self.st.auto_reenable_blocked = False
        self.st.consecutive_breaches = 0

    def record(self, a: Assessment) -> None:
        st = self.st
        st.last_evaluation = format_time(self.now)
        st.verdict = a.verdict
        st.reason = a.reason
        st.last = Last(ttft_p99=a.values["ttftP99"], itl_p99=a.values["itlP99"],
                       request_rate=a.values["requestRate"], thresholds=dict(a.thresholds))
        counts = st.counts
        counts.evaluations += 1
        if a.verdict == "breach":
            counts.breaches += 1
        elif a.verdict == "error":
            counts.errors += 1
        elif a.verdict == "noData":
            counts.no_data += 1
        elif a.verdict == "lowTraffic":
            counts.low_traffic += 1
        if a.verdict == "error":
            st.consecutive_errors += 1
            st.last_error = a.error
        else:
            st.consecutive_errors = 0

        breach = self.effective_breach(a)
        if breach is not None:
            if self.settling():
                st.reason = "Settling"
            else:
                st.consecutive_breaches += 1
        elif a.verdict == "ok":
            st.consecutive_breaches = 0
            st.gpu_only_breach_reported = False
        # error / noData / lowTraffic (with onNoData: hold): the counter holds.

    def effective_breach(self, a: Assessment) -> tuple[str, float | None, float | None] | None:
        """(metric, value, threshold) when this evaluation counts as a breach."""
        if a.verdict == "breach":
            return a.breaches[0]
        if a.verdict in ("noData", "lowTraffic") and self.s.on_no_data == "breach":
            return ("noData" if a.verdict == "noData" else "requestRate", a.values.get("requestRate"),
                    self.s.min_request_rate if a.verdict == "lowTraffic" else None)
        return None

    def settling(self) -> bool:
        """True while the window still measures the configuration that the last rollback removed."""
        return self.since(self.st.last_rollback) < max(self.s.cooldown_s, self.s.window_s)

    def disable(self, tier: str, reason: str, breach: tuple[str, float | None, float | None], message: str) -> None:
        metric, raw_value, threshold = breach
        value = _json_number(raw_value)
        st = self.st
        st.disabled[tier] = DisabledTier(
            since=format_time(self.now), reason=reason, metric=metric, value=value, threshold=threshold,
            dry_run=self.s.dry_run, probation_failed=reason == "ProbationBreach")
        st.probation.pop(tier, None)
        st.last_rollback = format_time(self.now)
        st.consecutive_breaches = 0
        st.counts.rollbacks += 1
        self.history("ProbationFailed" if reason == "ProbationBreach" else "Disabled", tier, reason=reason,
                     metric=metric, value=value, threshold=threshold, dry_run=self.s.dry_run)
        prefix = "dry run, would disable" if self.s.dry_run else "disabled"
        self.actions.append(DisableTier(tier, reason, f"{prefix} tier {tier}: {message}", metric, raw_value, threshold,
                                        dry_run=self.s.dry_run))

    def probation(self, a: Assessment) -> None:
        st = self.st
        breach = self.effective_breach(a)
        for tier in [t for t in self.s.tiers if t in st.probation]:
            if breach is not None:
                metric, value, threshold = breach
                st.auto_reenable_blocked = True
                self.disable(tier, "ProbationBreach", breach,
                             f"{metric} {_fmt(value, metric)} > {_fmt(threshold, metric)} during probation; automatic "
                             "re-enabling stops until a person re-enables it")
                self.actions.append(RecordEvent("Warning", "AutoReenableBlocked",
                                                f"tier {tier} breached the SLO during probation; re-enable it with "
                                                f"the annotation kvtier.io/reenable={tier} or change the spec"))
            elif self.since(st.probation[tier].since) >= self.s.probation_s:
                st.probation.pop(tier)
                self.history("ProbationPassed", tier, reason="HeldSLO")
                self.actions.append(RecordEvent("Normal", "ProbationPassed",
                                                f"tier {tier} held the SLO for its probation period"))

    def rollback(self, a: Assessment) -> None:
        st = self.st
        if st.consecutive_breaches < self.s.consecutive_breaches:
            return
        breach = self.effective_breach(a)
        if breach is None:   # the streak was reached earlier and this evaluation held; nothing new to act on
            return
        if self.since(st.last_rollback) < self.s.cooldown_s:
            st.reason = "Cooldown"
            return
        tier = self.newest_enabled()
        metric, value, threshold = breach
        if tier is None:
            st.reason = "NothingToDisable"
            if not st.gpu_only_breach_reported:
                st.gpu_only_breach_reported = True   # one Event per episode, not one per interval
                self.actions.append(RecordEvent("Warning", "SLOBreachedGPUOnly",
                                                f"{metric} {_fmt(value, metric)} > {_fmt(threshold, metric)} with no offload tier "
                                                "enabled: the SLO is not met by the GPU-only configuration"))
            return
        self.disable(tier, "SLOBreach", breach,
                     f"{_breach_text(metric, value, threshold)} for {self.s.consecutive_breaches} consecutive "
                     f"evaluations")

    def auto_reenable(self, a: Assessment) -> None:
        st = self.st
        if self.s.reenable_mode != "auto" or st.auto_reenable_blocked or st.probation:
            return
        if a.verdict != "ok" or st.consecutive_breaches > 0:
            return
        disabled = [t for t in self.s.tiers if t in st.disabled]
        if not disabled:
            return
        # Hottest first: rollbacks removed the coldest first, and a colder tier without the hotter one in front
        # of it is not a configuration the engines accept (vLLM's secondary tiers sit behind the CPU tier).
        tier = disabled[0]
        entry = st.disabled[tier]
        if entry.probation_failed or self.since(entry.since) < self.s.reenable_after_s:
            return
        if self.s.dry_run and not entry.dry_run:
            return   # dry run changes nothing real: it only undoes its own simulated rollbacks
        st.disabled.pop(tier)
        st.probation[tier] = ProbationTier(since=format_time(self.now),
                                           until=format_time(self.now + self.s.probation_s), dry_run=entry.dry_run)
        self.history("Reenabled", tier, reason="AutoReenable", dry_run=entry.dry_run)
        self.actions.append(EnableTier(tier, "AutoReenable",
                                       f"tier {tier} re-enabled after {_dur(self.s.reenable_after_s)}; on probation "
                                       f"for {_dur(self.s.probation_s)}", dry_run=entry.dry_run))

    def rollout(self, a: Assessment) -> None:
        ro = self.st.rollout
        if ro is None or ro.strategy != "staged":
            return
        pending = [t for t in self.s.tiers if t not in ro.rolled]
        stage = len(ro.rolled)
        if self.effective_breach(a) is not None:
            ro.stage_start = format_time(self.now)   # the stage must hold a FULL observation period
            ro.stage_ok = 0
            return
        if a.verdict != "ok":
            return
        ro.stage_ok += 1
        samples = ro.samples
        if self.st.baseline is None:
            for metric, kept in (("ttftP99", samples.ttft_p99), ("itlP99", samples.itl_p99)):
                value = a.values.get(metric)
                if value is not None:
                    kept.append(value)
                    del kept[:-MAX_BASELINE_SAMPLES]
        if not pending and self.st.baseline is not None:
            return
        # Half the evaluations of the period must have produced a verdict, or "held" means "was not measured".
        needed = max(1, int(self.s.stage_observation_s / self.s.interval_s / 2))
        if self.since(ro.stage_start) < self.s.stage_observation_s or ro.stage_ok < needed:
            return
        if self.st.disabled or self.st.probation:
            return   # a rolled-back or probationary tier must be settled before the next stage adds risk
        if self.st.baseline is None:
            b = self.st.baseline = Baseline(
                ttft_p99=statistics.median(samples.ttft_p99) if samples.ttft_p99 else None,
                itl_p99=statistics.median(samples.itl_p99) if samples.itl_p99 else None,
                samples=max(len(samples.ttft_p99), len(samples.itl_p99)),
                recorded_at=format_time(self.now),
                tiers=list(ro.rolled),
            )
            ro.samples = Samples()
            self.actions.append(RecordEvent("Normal", "BaselineRecorded",
                                            f"baseline p99 TTFT {_fmt(b.ttft_p99)}, ITL {_fmt(b.itl_p99)} "
                                            f"over {b.samples} evaluations"))
        if not pending:
            return
        tier = pending[0]
        ro.rolled.append(tier)
        ro.stage_start = format_time(self.now)
        ro.stage_ok = 0
        self.history("StageEnabled", tier, reason=f"stage {stage + 1} of {len(self.s.tiers)}")
        self.actions.append(EnableTier(tier, "StagedRollout",
                                       f"stage {stage} held the SLO for {_dur(self.s.stage_observation_s)}; "
                                       f"enabling tier {tier} (stage {stage + 1} of {len(self.s.tiers)})"))


def conditions(settings: SLOSettings, st: SLOGuardState) -> list[SetCondition]:
    """The SLO conditions after this evaluation (full set, every time; the operator diffs them)."""
    out: list[SetCondition] = []
    if st.verdict == "error":
        out.append(SetCondition("SLOUnknown", "True", st.reason or "QueryError",
                                f"{st.consecutive_errors} evaluation(s) in a row failed: {st.last_error}"))
    else:
        out.append(SetCondition("SLOUnknown", "False", st.reason or "Evaluated", "the last evaluation had data"
                                if st.verdict in ("ok", "breach") else f"no verdict: {st.reason}"))
    if st.verdict == "breach":
        last = st.last
        values = {"ttftP99": last.ttft_p99, "itlP99": last.itl_p99}
        over = [f"{m} {_fmt(values.get(m))} > {_fmt(th)}" for m, th in last.thresholds.items()
                if (v := values.get(m)) is not None and v > th]
        out.append(SetCondition("SLOBreached", "True", st.reason or "Breach",
                                f"{', '.join(over)} ({st.consecutive_breaches}/{settings.consecutive_breaches})"))
    elif st.verdict == "ok":
        out.append(SetCondition("SLOBreached", "False", "WithinSLO", "p99s within their thresholds"))
    real = [t for t, v in st.disabled.items() if not v.dry_run]
    if real:
        out.append(SetCondition("TierRolledBack", "True", "SLOBreach",
                                "disabled by the SLO guard: " + ", ".join(sorted(real, key=settings.tiers.index))))
    else:
        out.append(SetCondition("TierRolledBack", "False", "NoRollback", "no tier is disabled by the SLO guard"))
    return out


def _fmt(value: float | None, metric: str = "") -> str:
    if value is None:
        return "n/a"
    if value >= 1e308:
        return "+Inf"
    if metric == "requestRate":
        return f"{value:.3g}/s"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.3g}s"


def _breach_text(metric: str, value: float | None, threshold: float | None) -> str:
    if metric == "noData":
        return "no data (onNoData: breach)"
    if metric == "requestRate":
        return f"requestRate {_fmt(value, metric)} < {_fmt(threshold, metric)} (onNoData: breach)"
    return f"{metric} {_fmt(value)} > {_fmt(threshold)}"


def _dur(seconds: float) -> str:
    return f"{seconds:g}s" if seconds < 120 else f"{seconds / 60:g}m"
