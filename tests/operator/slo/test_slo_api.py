"""The guard against the API models (kvtier_operator.api): a spec the models accept parses into SLOSettings
with the models' defaults, and what the guard writes to status fits the status models (TierStatus forbids unknown
keys) and its history entries hold only the fields of a HistoryEntry."""
from __future__ import annotations

import json

from foundation.policies import policy
from kvtier_operator.api.guard_state import HistoryEntry
from kvtier_operator.api.v1alpha1 import KVCachePolicy, TierStatus
from kvtier_operator.slo import Measurements, SLOSettings, evaluate, read_state, stored_state
from plugins.slo_harness import derived_tiers, slo_settings

# The foundation tests' base policy (one copy of it), with every SLO setting the guard reads.
POLICY = policy(
    slo={"prometheus": {"url": "https://prometheus.monitoring:9090",
                        "auth": {"bearerToken": {"name": "prom", "key": "token"}},
                        "caBundle": {"name": "prom-ca", "key": "ca.crt"}},
         "ttftP99": "2s", "itlP99": "150ms", "ttftP99MaxRatio": 1.5, "modelName": "llama-70b",
         "reenable": {"mode": "auto"}},
    rollout={"strategy": "staged"},
)


def settings_from_model() -> SLOSettings:
    model = KVCachePolicy.model_validate(POLICY)
    return slo_settings(model.spec.model_dump(by_alias=True, exclude_none=True))


def test_model_dump_parses_with_the_models_defaults():
    s = settings_from_model()
    assert s.tiers == ("host", "nvme") and s.engine == "vllm" and s.model_name == "llama-70b"
    assert (s.window_s, s.interval_s, s.consecutive_breaches, s.cooldown_s) == (300, 30, 3, 900)
    assert (s.min_request_rate, s.on_no_data, s.dry_run) == (0.2, "hold", False)
    assert (s.reenable_mode, s.reenable_after_s, s.probation_s) == ("auto", 3600, 1800)
    assert (s.rollout_strategy, s.stage_observation_s, s.ttft_p99_max_ratio) == ("staged", 1800, 1.5)
    p = s.prometheus
    assert (p.url, p.timeout_s, p.bearer_token.name, p.ca_bundle.key) == (
        "https://prometheus.monitoring:9090", 10, "prom", "ca.crt")
    # The raw dict kopf hands a handler (no defaults filled in) parses to the same settings.
    assert slo_settings(POLICY["spec"]) == s


def test_status_written_by_the_guard_fits_the_status_models():
    s = settings_from_model()
    ok, slow = Measurements.of(0.5, 0.05, 5.0), Measurements.of(3.0, 0.05, 5.0)
    state, now = None, 0.0
    # GPU-only baseline, both stages, a rollback, an auto re-enable and its probation.
    for m, n in ((ok, 200), (slow, 3), (ok, 200)):
        for _ in range(n):
            decision = evaluate(s, read_state(state, now), m, now)
            state = json.loads(json.dumps(stored_state(decision.state), allow_nan=False))
            now += s.interval_s
    actions = [h["action"] for h in state["history"]]
    assert actions == ["StageEnabled", "StageEnabled", "Disabled", "Reenabled", "ProbationPassed"], actions
    fields = {f.alias for f in HistoryEntry.model_fields.values()}
    for entry in state["history"]:
        assert set(entry) <= fields and {"time", "tier", "action", "reason"} <= set(entry), entry
        assert HistoryEntry.model_validate(entry).model_dump(by_alias=True, mode="json") == entry
    for tier in derived_tiers(s, state, now):
        TierStatus.model_validate(tier)


def test_guard_status_validates_against_the_status_model_and_keeps_transition_times():
    """What a pass writes for the SLO guard (controller.guard_fields of slo_tick.step_of), fed by the decision
    engine, and the tier states the pass derives from it (tiers.tier_states, the one derivation of status.tiers)."""
    from kvtier_operator.api.v1alpha1 import KVCachePolicySpec, KVCachePolicyStatus
    from kvtier_operator.controller import guard_fields
    from kvtier_operator.slo_tick import step_of
    from kvtier_operator.tiers import tier_states

    spec = json.loads(json.dumps(POLICY["spec"]))
    spec["tiers"].append({"name": "spare", "medium": "filesystem", "size": "1Ti", "path": "/mnt/spare",
                          "volume": {"emptyDir": {}}, "enabled": False})
    spec["rollout"] = {"strategy": "immediate"}
    del spec["slo"]["ttftP99MaxRatio"]
    s = slo_settings(spec)
    assert s.tiers == ("host", "nvme") and s.spec_disabled_tiers == ("spare",)
    ready = {"type": "Ready", "status": "True", "reason": "Applied", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    status: dict = {"conditions": [ready]}
    transitions = {}
    for i, m in enumerate([Measurements.of(0.5, 0.05, 5.0)] * 2 + [Measurements.of(3.0, 0.05, 5.0)] * 3):
        t = 1000.0 + i * 30
        decision = evaluate(s, read_state(status.get("slo"), t), m, t, generation=4)
        now = f"2026-01-01T00:0{i}:00Z"
        step = step_of(decision, s.interval_s)
        status = {**status, **guard_fields(step, status.get("conditions") or [], 4, now)}
        status["tiers"] = tier_states(KVCachePolicySpec.model_validate(spec), status, now)
        transitions[i] = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    KVCachePolicyStatus.model_validate(json.loads(json.dumps(status)))
    assert status["sloState"] == "Breaching"
    assert [(t["name"], t["state"], t["reason"]) for t in status["tiers"]] == [
        ("host", "Enabled", "Enabled"), ("nvme", "Disabled", "SLOBreach"), ("spare", "Disabled", "DisabledInSpec")]
    assert transitions[4]["Ready"] == ready["lastTransitionTime"]           # foreign condition untouched
    assert transitions[1]["SLOUnknown"] == transitions[0]["SLOUnknown"]     # no flip, no new time
    assert transitions[2]["SLOBreached"] != transitions[1]["SLOBreached"]   # False -> True
    assert transitions[4]["TierRolledBack"] != transitions[3]["TierRolledBack"]
    assert [c["type"] for c in status["conditions"]][0] == "Ready"         # stored order kept
