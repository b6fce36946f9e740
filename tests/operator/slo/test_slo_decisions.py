"""The SLO guard's pure decision engine, driven evaluation by evaluation with hand-made measurements.

These pin the rules of issue 10 one by one; tests/operator/slo/test_slo_prometheus.py runs the same engine against a real
Prometheus scraping a synthetic engine.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from kvtier_operator.slo import (
    DisableTier,
    EnableTier,
    Measurements,
    Reading,
    RecordEvent,
    SetCondition,
    SLOSettings,
    evaluate,
    read_state,
    stored_state,
)
from kvtier_operator.tiers import enabled, newest_enabled
from plugins.slo_harness import derived_tiers, slo_settings

OK = Measurements.of(0.5, 0.05, 5.0)        # TTFT 500 ms, ITL 50 ms, 5 req/s
SLOW = Measurements.of(3.0, 0.05, 5.0)      # TTFT over the 2 s budget
CHOPPY = Measurements.of(0.5, 0.4, 5.0)     # ITL over the 150 ms budget
IDLE = Measurements.of(None, None, 0.0)
EMPTY = Measurements.of(None, None, None)
DOWN = Measurements.unreachable("cannot reach http://prometheus:9090: connection refused")


def spec(**slo: Any) -> dict[str, Any]:
    rollout = slo.pop("rollout", None)
    base = {"prometheus": {"url": "http://prometheus:9090"}, "ttftP99": "2s", "itlP99": "150ms", "window": "10s",
            "interval": "1s", "consecutiveBreaches": 3, "cooldown": "20s"}
    base.update(slo)
    out: dict[str, Any] = {"selector": {"matchLabels": {"app": "llm"}}, "tiers": [{"name": "host", "medium": "cpu", "size": "1Gi"}, {"name": "nvme", "medium": "filesystem", "size": "10Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}], "slo": base}
    if rollout:
        out["rollout"] = rollout
    return out


class Driver:
    """Feeds measurements one interval apart, keeping the state in its stored form: parsed before each evaluation
    and dumped after it as the operator does with status.slo, and round-tripped through JSON as storage does."""

    def __init__(self, settings: SLOSettings, start: float = 1_000_000.0):
        self.settings, self.now, self.state = settings, start, None
        self.actions: list[Any] = []

    def step(self, m: Measurements, dt: float | None = None, **kw: Any) -> list[Any]:
        decision = evaluate(self.settings, read_state(self.state, self.now), m, self.now, **kw)
        self.state = json.loads(json.dumps(stored_state(decision.state), allow_nan=False))
        self.now += self.settings.interval_s if dt is None else dt
        changes = [a for a in decision.actions if not isinstance(a, SetCondition)]
        self.actions.extend(changes)
        self.conditions = {a.type: a for a in decision.actions if isinstance(a, SetCondition)}
        return changes

    def run(self, m: Measurements, n: int, **kw: Any) -> list[Any]:
        out: list[Any] = []
        for _ in range(n):
            out += self.step(m, **kw)
        return out

    @property
    def enabled(self) -> list[str]:
        return enabled(derived_tiers(self.settings, self.state, self.now))

    def disables(self) -> list[DisableTier]:
        return [a for a in self.actions if isinstance(a, DisableTier)]


def driver(**slo: Any) -> Driver:
    return Driver(slo_settings(spec(**slo)))


def test_three_consecutive_breaches_disable_the_newest_tier_only():
    d = driver()
    assert d.run(SLOW, 2) == []
    assert d.enabled == ["host", "nvme"]
    acts = d.step(SLOW)
    assert [(a.tier, a.metric, a.value, a.threshold, a.dry_run) for a in acts] == [("nvme", "ttftP99", 3.0, 2.0, False)]
    assert d.enabled == ["host"]
    entry = d.state["history"][-1]
    assert entry["action"] == "Disabled" and entry["tier"] == "nvme" and entry["metric"] == "ttftP99"
    assert entry["value"] == 3.0 and entry["threshold"] == 2.0 and entry["time"].endswith("Z")
    assert d.conditions["TierRolledBack"].status == "True"


def test_itl_breach_counts_like_ttft():
    d = driver()
    acts = d.run(CHOPPY, 3)
    assert [(a.tier, a.metric) for a in acts] == [("nvme", "itlP99")]


def test_an_ok_evaluation_resets_the_streak():
    d = driver()
    for _ in range(5):
        d.run(SLOW, 2)
        d.step(OK)
    assert d.disables() == [] and d.enabled == ["host", "nvme"]


def test_next_tier_only_after_cooldown_and_a_fresh_streak():
    d = driver()
    d.run(SLOW, 3)
    assert len(d.disables()) == 1
    # 20 s cooldown (> 10 s window): 19 more breaching evaluations disable nothing.
    assert d.run(SLOW, 19) == []
    assert d.state["reason"] == "Settling"
    # After the cooldown a new streak of three is needed.
    assert d.run(SLOW, 2) == []
    acts = d.step(SLOW)
    assert [a.tier for a in acts] == ["host"]
    assert d.enabled == []
    # Nothing left to disable: one warning, no more disables, and the condition stays.
    acts = d.run(SLOW, 30)
    assert not any(isinstance(a, DisableTier) for a in acts)
    assert [a.reason for a in acts if isinstance(a, RecordEvent)] == ["SLOBreachedGPUOnly"]


def test_settle_covers_the_window_when_cooldown_is_shorter():
    d = driver(cooldown="0s", window="5s")
    d.run(SLOW, 3)
    assert d.run(SLOW, 4 + 2) == []          # 1-4 s after the rollback the 5 s window is stale; then 2 of 3
    assert [a.tier for a in d.step(SLOW)] == ["host"]


@pytest.mark.parametrize("m,reason", [
    (DOWN, "QueryError"),
    (Measurements(Reading.of(math.nan), Reading.of(0.05), Reading.of(5.0)), "QueryError"),
    (Measurements(Reading.failed("parse error"), Reading.of(0.05), Reading.of(5.0)), "QueryError"),
    (Measurements(Reading.of(0.5), Reading.of(0.05), Reading.of(math.nan)), "NaN"),
])
def test_errors_are_not_breaches_and_set_slo_unknown(m, reason):
    d = driver()
    d.run(SLOW, 2)
    assert d.run(m, 50) == []
    assert d.state["consecutiveBreaches"] == 2           # held, not reset, not advanced
    assert d.state["consecutiveErrors"] == 50 and d.state["counts"]["errors"] == 50
    assert d.conditions["SLOUnknown"].status == "True" and d.conditions["SLOUnknown"].reason == reason
    # The counter held: one more breach completes the streak.
    assert [a.tier for a in d.step(SLOW)] == ["nvme"]
    assert d.conditions["SLOUnknown"].status == "False"


def test_a_valid_breach_counts_even_when_the_other_query_failed():
    d = driver()
    m = Measurements(Reading.of(3.0), Reading.failed("timeout"), Reading.of(5.0))
    assert [a.tier for a in d.run(m, 3)] == ["nvme"]


@pytest.mark.parametrize("m", [IDLE, EMPTY, Measurements.of(None, None, 5.0), Measurements.of(3.0, 0.05, 0.1)])
def test_no_data_and_low_traffic_hold_the_counter(m):
    d = driver(minRequestRate=0.2)
    d.run(SLOW, 2)
    assert d.run(m, 40) == []
    assert d.state["consecutiveBreaches"] == 2
    assert d.state["verdict"] in ("noData", "lowTraffic")
    assert d.conditions["SLOUnknown"].status == "False"


def test_on_no_data_breach_counts_silence_as_a_breach():
    d = driver(onNoData="breach")
    acts = d.run(IDLE, 3)
    assert [(a.tier, a.metric) for a in acts] == [("nvme", "requestRate")]
    acts = driver(onNoData="breach").run(EMPTY, 3)
    assert [(a.tier, a.metric) for a in acts] == [("nvme", "noData")]


def test_positive_infinity_is_a_breach_not_an_error():
    d = driver()
    acts = d.run(Measurements.of(math.inf, 0.05, 5.0), 3)
    assert [a.tier for a in acts] == ["nvme"]
    json.dumps(d.state, allow_nan=False)   # status must stay valid JSON for the API server


def test_dry_run_records_but_changes_nothing():
    d = driver(dryRun=True)
    acts = d.run(SLOW, 3)
    assert [(a.tier, a.dry_run) for a in acts] == [("nvme", True)]
    assert d.enabled == ["host", "nvme"]
    assert [t["state"] for t in derived_tiers(d.settings, d.state)] == ["Enabled", "Enabled"]
    assert d.state["history"][-1]["action"] == "WouldDisable"
    d.run(SLOW, 20)
    acts = d.run(SLOW, 3)
    assert [(a.tier, a.dry_run) for a in acts] == [("host", True)]   # what it would do next, faithfully
    assert d.enabled == ["host", "nvme"]
    # Turning dry run off forgets the simulated rollbacks.
    d.settings = slo_settings(spec(dryRun=False))
    d.step(OK)
    assert d.enabled == ["host", "nvme"] and d.state["disabled"] == {}


def test_manual_reenable_by_annotation_and_acknowledgement():
    d = driver()
    d.run(SLOW, 3)
    acts = d.step(OK, reenable_requests=["nvme", "bogus", "host"])
    kinds = [(a.kind, a.tier, getattr(a, "outcome", None)) for a in acts]
    assert ("EnableTier", "nvme", None) in kinds
    assert ("AcknowledgeReenable", "nvme", "Reenabled") in kinds
    assert ("AcknowledgeReenable", "bogus", "UnknownTier") in kinds
    assert ("AcknowledgeReenable", "host", "NotDisabled") in kinds
    assert d.enabled == ["host", "nvme"]


def test_manual_mode_never_reenables_by_itself():
    d = driver()
    d.run(SLOW, 3)
    d.run(OK, 3600)
    assert d.enabled == ["host"]


def test_spec_change_counts_as_a_person_acting():
    d = driver()
    d.step(SLOW, generation=1)
    d.run(SLOW, 2, generation=1)
    assert d.enabled == ["host"]
    d.step(OK, generation=1)
    assert d.enabled == ["host"]
    acts = d.step(OK, generation=2)
    assert [(a.kind, a.tier, a.reason) for a in acts] == [("EnableTier", "nvme", "SpecChanged")]
    assert d.enabled == ["host", "nvme"]


def test_auto_reenable_after_wait_then_probation_passes():
    d = driver(reenable={"mode": "auto", "after": "30s", "probation": "10s"})
    d.run(SLOW, 3)
    assert d.run(OK, 29) == []
    acts = d.step(OK)
    assert [(a.kind, a.tier, a.reason) for a in acts] == [("EnableTier", "nvme", "AutoReenable")]
    assert derived_tiers(d.settings, d.state)[1]["reason"] == "Probation"
    acts = d.run(OK, 10)
    assert [a.reason for a in acts if isinstance(a, RecordEvent)] == ["ProbationPassed"]
    assert d.state["probation"] == {}


def test_auto_reenable_waits_for_a_clean_evaluation():
    d = driver(reenable={"mode": "auto", "after": "30s", "probation": "10s"}, consecutiveBreaches=3)
    d.run(SLOW, 3)
    d.settings = slo_settings(spec(reenable={"mode": "auto", "after": "30s", "probation": "10s"},
                                            consecutiveBreaches=100))  # the API maximum: no second rollback
    d.run(OK, 20)
    d.run(SLOW, 15)               # still breaching when the wait is over: no re-enable
    assert d.enabled == ["host"]
    acts = d.step(OK)
    assert [a.tier for a in acts if isinstance(a, EnableTier)] == ["nvme"]


def test_a_breach_in_probation_disables_at_once_and_blocks_auto_reenable():
    d = driver(reenable={"mode": "auto", "after": "30s", "probation": "60s"}, cooldown="5s", window="5s")
    d.run(SLOW, 3)
    d.run(OK, 30)
    assert d.enabled == ["host", "nvme"]
    acts = d.step(SLOW)           # one breach, not three
    assert [(a.tier, a.reason) for a in acts if isinstance(a, DisableTier)] == [("nvme", "ProbationBreach")]
    assert "AutoReenableBlocked" in [a.reason for a in acts if isinstance(a, RecordEvent)]
    assert d.state["autoReenableBlocked"] is True
    d.run(OK, 600)
    assert d.enabled == ["host"]  # stays off until a person acts
    d.step(OK, reenable_requests=["nvme"])
    assert d.enabled == ["host", "nvme"] and d.state["autoReenableBlocked"] is False


def test_auto_reenable_restores_hottest_first():
    d = driver(reenable={"mode": "auto", "after": "60s", "probation": "5s"}, cooldown="5s", window="5s")
    d.run(SLOW, 3)
    d.run(SLOW, 8)
    assert d.enabled == []
    enables = [a.tier for a in d.run(OK, 120) if isinstance(a, EnableTier)]
    assert enables == ["host", "nvme"]


def staged(**slo: Any) -> Driver:
    return driver(rollout={"strategy": "staged", "stageObservation": "10s"}, **slo)


def test_staged_rollout_starts_gpu_only_records_a_baseline_and_adds_one_tier_per_stage():
    d = staged()
    assert d.step(OK) == [] and d.enabled == []
    assert [t["state"] for t in derived_tiers(d.settings, d.state)] == ["Pending", "Pending"]
    acts = d.run(OK, 10)
    assert [a.reason for a in acts if isinstance(a, RecordEvent)] == ["BaselineRecorded"]
    assert [(a.tier, a.reason) for a in acts if isinstance(a, EnableTier)] == [("host", "StagedRollout")]
    assert d.state["baseline"]["ttftP99"] == 0.5 and d.state["baseline"]["itlP99"] == 0.05
    assert d.enabled == ["host"]
    assert [a.tier for a in d.run(OK, 10) if isinstance(a, EnableTier)] == ["nvme"]
    assert d.enabled == ["host", "nvme"]
    assert d.run(OK, 50) == []


def test_a_breach_restarts_the_stage_clock():
    d = staged(consecutiveBreaches=5)
    d.run(OK, 11)
    assert d.enabled == ["host"]
    d.run(OK, 8)
    d.step(SLOW)                   # one breach: not a rollback, but the stage did not hold a full period
    assert d.run(OK, 9) == [] and d.enabled == ["host"]
    assert [a.tier for a in d.run(OK, 2) if isinstance(a, EnableTier)] == ["nvme"]


def test_staged_rollout_without_traffic_does_not_advance():
    d = staged()
    d.run(IDLE, 100)
    assert d.enabled == [] and d.state["baseline"] is None


def test_relative_thresholds_use_the_baseline():
    d = driver(ttftP99=None, itlP99=None, ttftP99MaxRatio=1.5,
               rollout={"strategy": "staged", "stageObservation": "10s"})
    d.run(OK, 11)                   # baseline TTFT 500 ms -> threshold 750 ms
    assert d.enabled == ["host"]
    d.step(OK)
    assert d.state["last"]["thresholds"] == {"ttftP99": 0.75}
    acts = d.run(Measurements.of(0.8, 0.05, 5.0), 3)
    assert [(a.tier, a.threshold) for a in acts if isinstance(a, DisableTier)] == [("host", 0.75)]
    # The rollout does not go on while a tier is rolled back.
    d.run(OK, 100)
    assert d.enabled == []


def test_restart_mid_breach_keeps_counting():
    d = driver()
    d.run(SLOW, 2)
    saved = json.dumps(d.state)
    fresh = Driver(slo_settings(spec()), start=d.now)   # a new operator process
    fresh.state = json.loads(saved)
    assert [a.tier for a in fresh.step(SLOW)] == ["nvme"]


def test_history_is_bounded():
    d = driver(cooldown="0s", window="1s", reenable={"mode": "auto", "after": "1s", "probation": "1s"})
    d.settings = dataclasses.replace(d.settings, history_limit=3)
    for _ in range(10):
        d.run(SLOW, 3)
        d.run(OK, 3)
    assert len(d.state["history"]) == 3


def test_removed_tier_leaves_the_state():
    d = driver()
    d.run(SLOW, 3)
    d.settings = slo_settings({**spec(), "tiers": spec()["tiers"][:1]})
    d.step(OK)
    assert d.state["disabled"] == {} and d.enabled == ["host"]


def test_state_from_a_newer_operator_is_refused():
    with pytest.raises(ValueError, match="status.slo.version"):
        read_state({"version": 99}, 0.0)


def test_evaluate_does_not_mutate_its_input():
    settings = slo_settings(spec())
    state = evaluate(settings, None, SLOW, 0.0).state
    before = json.dumps(stored_state(state), sort_keys=True)
    after = evaluate(settings, state, SLOW, 1.0).state
    assert json.dumps(stored_state(state), sort_keys=True) == before
    assert after.counts.evaluations == 2 and state.counts.evaluations == 1  # the control: the evaluation ran


def test_staged_policy_renders_gpu_only_before_its_first_evaluation():
    settings = slo_settings(spec(rollout={"strategy": "staged"}))
    assert enabled(derived_tiers(settings, None)) == []
    assert [t["state"] for t in derived_tiers(settings, None)] == ["Pending", "Pending"]
    assert enabled(derived_tiers(slo_settings(spec()), None)) == ["host", "nvme"]


def test_switching_a_running_policy_to_staged_keeps_its_tiers():
    d = driver()
    d.run(OK, 3)
    d.settings = slo_settings(spec(rollout={"strategy": "staged", "stageObservation": "10s"}))
    d.step(OK)
    assert d.enabled == ["host", "nvme"]


def test_a_corrupted_status_is_repaired_not_a_crash():
    d = driver()
    d.run(SLOW, 3)
    assert d.enabled == ["host"]
    d.state.update({"consecutiveBreaches": "two", "counts": {"evaluations": -1}, "lastRollback": "yesterday",
                    "probation": {"nvme": "soon"}, "baseline": "fast", "history": ["junk", {"action": "x"}],
                    "rollout": {"strategy": "immediate", "rolled": "all"}})
    d.state["disabled"]["nvme"]["since"] = 12
    d.step(OK)
    assert d.enabled == ["host"], "a rolled-back tier must stay rolled back through a repair"
    assert d.state["consecutiveBreaches"] == 0 and d.state["counts"]["evaluations"] == 1
    assert d.state["probation"] == {} and d.state["baseline"] is None
    assert d.state["history"] == [{"action": "x"}]
    d.state["disabled"] = {"nvme": "broken"}
    d.step(OK)
    assert d.enabled == ["host"] and d.state["disabled"]["nvme"]["reason"] == "Restored"


def test_stored_times_round_up_so_no_period_ends_early():
    from kvtier_operator.api.times import format_time, parse_time

    assert format_time(1000.0) == "1970-01-01T00:16:40.000Z"
    assert format_time(1000.001) == "1970-01-01T00:16:40.001Z"        # exact milliseconds are kept
    assert format_time(1795945565.9789543) == "2026-11-29T09:46:05.979Z"  # up, not down to .978
    for epoch in (1795945565.9789543, 1000.0004, 1234.5678901, 59.9999):
        assert 0 <= parse_time(format_time(epoch)) - epoch < 0.001


def test_a_stage_never_ends_before_its_full_observation_period():
    # Stages start at times the store cannot hold exactly (sub-millisecond): the next stage may begin only once
    # the real elapsed time, not the stored one, reaches stageObservation.
    d = Driver(slo_settings(spec(rollout={"strategy": "staged", "stageObservation": "4s"},
                                          interval="100ms", ttftP99MaxRatio=5)), start=1795945561.9789543)
    enables = []
    for _ in range(300):
        now = d.now
        enables += [now for a in d.step(OK, dt=0.0999999) if isinstance(a, EnableTier)]
    assert len(enables) == 2
    assert enables[1] - enables[0] >= 4


def test_newest_enabled_is_the_coldest_enabled_tier_and_a_dry_run_moves_past_its_own_disables():
    states = [{"name": "host", "state": "Enabled", "reason": "Enabled"},
              {"name": "nvme", "state": "Enabled", "reason": "DryRunWouldDisable"},
              {"name": "s3", "state": "Pending", "reason": "StagedRollout"}]
    assert newest_enabled(states) == "nvme"
    assert newest_enabled(states, simulated=True) == "host"
    assert newest_enabled([{"name": "host", "state": "Disabled", "reason": "SLOBreach"}]) is None


def test_a_rollback_removes_the_newest_tier_the_operator_renders():
    """The guard has no rule of its own: mid staged rollout, what it removes is the newest tier of the derivation
    the operator renders from (host), never the one still pending (nvme)."""
    d = driver(rollout={"strategy": "staged", "stageObservation": "10s"})
    d.run(OK, 11)
    tiers = derived_tiers(d.settings, d.state)
    assert [(t["name"], t["state"]) for t in tiers] == [("host", "Enabled"), ("nvme", "Pending")]
    assert newest_enabled(tiers) == "host"
    d.run(SLOW, 3)
    assert [a.tier for a in d.disables()] == ["host"]
    assert newest_enabled(derived_tiers(d.settings, d.state)) is None
