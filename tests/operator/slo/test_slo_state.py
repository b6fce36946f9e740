"""``status.slo``: the guard computes on its typed model and the operator stores the model's dump. The stored
JSON shape is the one earlier operators wrote, so an operator restart (or an upgrade) resumes from what is stored:
a stored state parses and dumps back to the identical dict, and evaluating from the re-read state decides
exactly as evaluating from the one kept in memory."""
from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kvtier_operator.api.guard_state import SLOGuardState
from kvtier_operator.slo import Measurements, evaluate, read_state, stored_state
from plugins.slo_harness import slo_settings

NOW = 1_000_000.0
SAMPLES = {"ttftP99": [0.5, 0.625], "itlP99": [0.05, 0.0625]}

# As earlier operators stored them (every field present, camelCase, an immediate rollout without stages).
STAGED: dict[str, Any] = {
    "version": 1, "observedGeneration": 7, "lastEvaluation": "1970-01-12T13:46:40.000Z", "verdict": "ok",
    "reason": "WithinSLO",
    "last": {"ttftP99": 0.5, "itlP99": 0.05, "requestRate": 5.0, "thresholds": {"ttftP99": 2.0, "itlP99": 0.15}},
    "consecutiveBreaches": 0, "consecutiveErrors": 0, "lastError": None,
    "counts": {"evaluations": 203, "breaches": 3, "errors": 0, "noData": 0, "lowTraffic": 0, "rollbacks": 1},
    "lastRollback": "1970-01-12T13:00:00.000Z",
    "disabled": {"nvme": {"since": "1970-01-12T13:00:00.000Z", "reason": "SLOBreach", "metric": "ttftP99",
                          "value": 3.0, "threshold": 2.0, "dryRun": False, "probationFailed": False}},
    "probation": {"host": {"since": "1970-01-12T13:40:00.000Z", "until": "1970-01-12T14:10:00.000Z",
                           "dryRun": False}},
    "autoReenableBlocked": False, "gpuOnlyBreachReported": False, "baseline": None,
    "rollout": {"strategy": "staged", "rolled": ["host", "nvme"], "stageStart": "1970-01-12T13:00:00.000Z",
                "stageOk": 12, "samples": SAMPLES},
    "history": [{"time": "1970-01-12T13:00:00.000Z", "tier": "nvme", "action": "Disabled", "reason": "SLOBreach",
                 "metric": "ttftP99", "value": 3.0, "threshold": 2.0}],
}
IMMEDIATE: dict[str, Any] = {
    "version": 1, "observedGeneration": 4, "lastEvaluation": "1970-01-01T00:18:40.000Z", "verdict": "breach",
    "reason": "Breach",
    "last": {"ttftP99": 3.0, "itlP99": 0.05, "requestRate": 5.0, "thresholds": {"ttftP99": 2.0, "itlP99": 0.15}},
    "consecutiveBreaches": 0, "consecutiveErrors": 0, "lastError": None,
    "counts": {"evaluations": 5, "breaches": 3, "errors": 0, "noData": 0, "lowTraffic": 0, "rollbacks": 1},
    "lastRollback": "1970-01-01T00:18:40.000Z",
    "disabled": {"nvme": {"since": "1970-01-01T00:18:40.000Z", "reason": "SLOBreach", "metric": "ttftP99",
                          "value": 3.0, "threshold": 2.0, "dryRun": False, "probationFailed": False}},
    "probation": {}, "autoReenableBlocked": False, "gpuOnlyBreachReported": False,
    "baseline": {"ttftP99": 0.5, "itlP99": 0.05, "samples": 61, "recordedAt": "1970-01-01T00:10:00.000Z",
                 "tiers": []},
    "rollout": {"strategy": "immediate", "rolled": ["host", "nvme"]},
    "history": [{"time": "1970-01-01T00:18:40.000Z", "tier": "nvme", "action": "Disabled", "reason": "SLOBreach",
                 "metric": "ttftP99", "value": 3.0, "threshold": 2.0}],
}
# A key a newer minor version added: the CRD preserves it, and so does a read and write by this operator.
NEWER_KEY = {**IMMEDIATE, "futureField": {"kept": True}}


def spec(**rollout: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llm"}},
        "tiers": [{"name": "host", "medium": "cpu", "size": "1Gi"},
                  {"name": "nvme", "medium": "filesystem", "size": "10Gi", "path": "/mnt/nvme",
                   "volume": {"emptyDir": {}}}],
        "slo": {"prometheus": {"url": "http://prometheus:9090"}, "ttftP99": "2s", "itlP99": "150ms",
                "window": "10s", "interval": "1s", "consecutiveBreaches": 3, "cooldown": "20s",
                "reenable": {"mode": "auto", "after": "30s", "probation": "20s"}}}
    if rollout:
        out["rollout"] = rollout
    return out


@pytest.mark.parametrize("stored", [STAGED, IMMEDIATE, NEWER_KEY], ids=["staged", "immediate", "newer-key"])
def test_a_stored_state_parses_and_dumps_back_to_the_identical_dict(stored: dict[str, Any]) -> None:
    original = copy.deepcopy(stored)
    state = read_state(stored, NOW)
    assert isinstance(state, SLOGuardState)
    assert stored == original  # reading never changes what is stored
    dumped = stored_state(state)
    assert dumped == original
    assert json.dumps(dumped, sort_keys=True) == json.dumps(original, sort_keys=True)  # 3.0 stays 3.0, not 3


def test_the_typed_state_is_what_was_stored() -> None:
    state = read_state(STAGED, NOW)
    assert state.disabled["nvme"].reason == "SLOBreach" and state.disabled["nvme"].since == "1970-01-12T13:00:00.000Z"
    assert state.probation["host"].until == "1970-01-12T14:10:00.000Z"
    assert state.rollout is not None and state.rollout.samples.ttft_p99 == [0.5, 0.625]
    assert state.counts.evaluations == 203 and state.observed_generation == 7


@pytest.mark.parametrize("rollout", [{}, {"strategy": "staged", "stageObservation": "10s"}], ids=["immediate", "staged"])
def test_an_operator_restart_resumes_exactly_where_it_stopped(rollout: dict[str, Any]) -> None:
    """One guard keeps its state in memory; the other is restarted before every evaluation (re-reads what was
    stored). Through a baseline, stages, a rollback, an automatic re-enable and its probation they store the
    same state and decide the same actions."""
    settings = slo_settings(spec(**rollout))
    ok, slow = Measurements.of(0.5, 0.05, 5.0), Measurements.of(3.0, 0.05, 5.0)
    kept: SLOGuardState | None = None
    stored: dict[str, Any] | None = None
    now = NOW
    history = []
    for m, n in ((ok, 25), (slow, 3), (ok, 60)):
        for _ in range(n):
            in_memory = evaluate(settings, kept, m, now)
            restarted = evaluate(settings, read_state(json.loads(json.dumps(stored)), now), m, now)
            assert restarted.actions == in_memory.actions
            kept, stored = in_memory.state, stored_state(restarted.state)
            assert stored == stored_state(kept)
            history = stored["history"]
            now += settings.interval_s
    # The control: the run went through what it is meant to exercise.
    actions = [h["action"] for h in history]
    assert {"Disabled", "Reenabled", "ProbationPassed"} <= set(actions), actions


def test_an_immediate_rollout_is_stored_without_stages() -> None:
    settings = slo_settings(spec())
    state = evaluate(settings, None, Measurements.of(0.5, 0.05, 5.0), NOW).state
    assert stored_state(state)["rollout"] == {"strategy": "immediate", "rolled": ["host", "nvme"]}


def test_the_derived_tier_states_read_any_stored_state_and_never_refuse_one() -> None:
    """The reconcile reads status.slo to render (``tiers.tier_states``) but never writes it back, so it reads a
    newer operator's state for what it understands, where the guard refuses to evaluate (and overwrite) it; and a
    tier the guard rolled back stays rolled back whatever is left of its entry."""
    from kvtier_operator.api.v1alpha1 import KVCachePolicySpec
    from kvtier_operator.tiers import tier_states

    parsed = KVCachePolicySpec.model_validate(spec())
    newer = {**IMMEDIATE, "version": 2}
    with pytest.raises(ValueError, match="status.slo.version: 2 is newer"):
        read_state(newer, NOW)
    now = "2026-01-01T00:00:00Z"
    assert [(t["name"], t["state"], t["reason"]) for t in tier_states(parsed, {"slo": newer}, now)] == [
        ("host", "Enabled", "Enabled"), ("nvme", "Disabled", "SLOBreach")]
    damaged = {"disabled": {"nvme": "not an entry"}}
    assert [(t["name"], t["state"], t["reason"], t["since"]) for t in tier_states(parsed, {"slo": damaged}, now)] == [
        ("host", "Enabled", "Enabled", now), ("nvme", "Disabled", "Restored", now)]
