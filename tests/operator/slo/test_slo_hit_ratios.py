"""Hit ratios measured by the SLO guard (slo.hit_ratios, slo_tick.hit_ratios, controller.guard_fields): the
queries follow the policy's pods like the SLO queries, Prometheus answers become figures and the TierIdle
condition, and nothing about them can fail the guard or change its decisions."""
from __future__ import annotations

import json
import math
import re

import pytest
from foundation.policies import policy
from kvtier_operator import slo
from kvtier_operator.api.v1alpha1 import KVCachePolicySpec, KVCachePolicyStatus
from kvtier_operator.controller import guard_fields, tier_idle_event
from kvtier_operator.slo import hit_ratios as hr
from kvtier_operator.slo.measurements import Measurements, Reading
from kvtier_operator.slo_tick import decide, scope_for, step_of
from kvtier_operator.status import status_patch
from kvtier_operator.tiers import tier_states
from plugins.slo_harness import slo_settings

SCOPE = slo.Scope(namespace="ns", pod_regex="llm-.+")
TIERS = [{"name": "cpu", "medium": "cpu", "size": "16Gi"},
         {"name": "nvme", "medium": "filesystem", "size": "100Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}]
SLO = {"prometheus": {"url": "http://prometheus:9090"}, "ttftP99": "2s", "window": "5m", "idleWindow": "1h"}
OLD = "2026-01-01T00:00:00Z"   # enabled long before the idle window
NOW = "2026-01-02T00:00:00Z"


def spec(**slo_fields):
    return policy(tiers=TIERS, backend="kvtier", engine="vllm", slo={**SLO, **slo_fields})["spec"]


def enabled(*names, since=OLD, **ratios):
    return [{"name": n, "state": "Enabled", "reason": "Enabled", "since": since,
             **({"hitRatio": ratios[n]} if n in ratios else {})} for n in names]


class Canned:
    """A Prometheus that answers each query by what it asks: the device, or a tier over a range."""

    def __init__(self, answers, slo_measurements=None):
        self.answers = answers  # (tier or "gpu", "5m" | "1h") -> Reading, float or None (no series)
        self.asked: list[str] = []
        self.slo = slo_measurements or Measurements.of(0.5, 0.01, 10.0)

    def measure(self, queries):
        return self.slo

    def query_scalar(self, promql):
        self.asked.append(promql)
        what = "gpu" if "prefix_cache_hits" in promql else re.search(r'tier="([^"]+)"', promql).group(1)
        answer = self.answers[(what, re.search(r"\[([0-9]+[smh])\]", promql).group(1))]
        if isinstance(answer, Reading):
            return answer
        return Reading.empty(promql) if answer is None else Reading.of(answer, promql)


# ---------------------------------------------------------------------------------------------- queries

def test_a_tier_query_is_its_hits_over_all_lookups_on_the_policy_pods_only():
    q = hr.tier_query("nvme", SCOPE, 300)
    hits, lookups = q.split(" / ")
    assert hits == ('(sum(rate({__name__=~"vllm[:_]kv_offload_kvtier_hit_tokens_total", namespace="ns", '
                    'pod=~"llm-.+", tier="nvme"}[5m])) or vector(0))')
    assert lookups == ('sum(rate({__name__=~"vllm[:_]kv_offload_kvtier_lookup_tokens_total", namespace="ns", '
                       'pod=~"llm-.+"}[5m]))')
    # The scope's matchers are exactly the SLO queries' (one scoping for both).
    for matcher in SCOPE.matchers():
        assert matcher in hits and matcher in lookups and matcher in slo.build_queries("vllm", SCOPE, 300).ttft_p99
    device = hr.device_query(SCOPE, 300)
    assert "vllm[:_]prefix_cache_hits_total" in device and "vllm[:_]prefix_cache_queries_total" in device
    assert device.count('pod=~"llm-.+"') == 2


def test_queries_cover_the_device_and_each_tier_over_both_windows():
    q = hr.build(["cpu", "nvme"], SCOPE, 300, 3600)
    assert list(q.window) == ["gpu", "cpu", "nvme"] and list(q.idle) == ["cpu", "nvme"]
    assert all("[5m]" in t for t in q.window.values()) and all("[1h]" in t for t in q.idle.values())
    # A declared tier named like the device keeps its name; the device figure is left out.
    assert list(hr.build(["gpu"], SCOPE, 300, 3600).window) == ["gpu"]
    assert "tier=\"gpu\"" in hr.build(["gpu"], SCOPE, 300, 3600).window["gpu"]


# ---------------------------------------------------------------------------------------------- answers

@pytest.mark.parametrize("reading, expected", [
    (Reading.of(0.41234), (True, 0.412)),
    (Reading.of(0.0), (True, 0.0)),
    (Reading.of(1.0004), (True, 1.0)),            # two counters scraped apart overshoot by a hair
    (Reading.empty(), (True, None)),              # no lookup series in the window
    (Reading.of(math.nan), (True, None)),         # 0/0: nothing looked up
    (Reading.of(math.inf), (True, None)),         # hits without lookups
    (Reading.failed("no usable answer"), (False, None)),
])
def test_a_prometheus_answer_becomes_a_rounded_figure_no_figure_or_unknown(reading, expected):
    assert hr.ratio(reading) == expected


def test_the_first_failed_query_stops_the_rest():
    source = Canned({("gpu", "5m"): 0.6, ("cpu", "5m"): Reading.failed("down"), ("nvme", "5m"): 0.1})
    measured = hr.measure(source, hr.build(["cpu", "nvme"], SCOPE, 300, 3600))
    assert measured.window == {"gpu": 0.6} and measured.idle == {} and measured.error == "down"
    assert len(source.asked) == 2


def test_a_slow_prometheus_spends_one_budget_for_all_the_figures():
    clock = [0.0]

    class Slow(Canned):
        def query_scalar(self, promql):
            clock[0] += 1.0   # each answer takes a second
            return super().query_scalar(promql)

    source = Slow({k: 0.5 for k in [("gpu", "5m"), ("cpu", "5m"), ("nvme", "5m"), ("cpu", "1h"), ("nvme", "1h")]})
    # A 2 s budget: two queries start, the third would start with the budget spent.
    measured = hr.measure(source, hr.build(["cpu", "nvme"], SCOPE, 300, 3600), budget_s=2, clock=lambda: clock[0])
    assert measured.window == {"gpu": 0.5, "cpu": 0.5} and "budget" in (measured.error or "")
    assert len(source.asked) == 2


def test_figures_go_to_enabled_tiers_and_an_unanswered_one_keeps_its_stored_figure():
    tiers = enabled("cpu", "nvme", cpu=0.3, nvme=0.2) + [
        {"name": "remote", "state": "Disabled", "reason": "SLOBreach", "since": OLD, "hitRatio": 0.5}]
    out = hr.with_figures(tiers, hr.HitRatios(window={"cpu": 0.41}))
    assert [t.get("hitRatio") for t in out] == [0.41, 0.2, None]
    out = hr.with_figures(tiers, hr.HitRatios(window={"cpu": None, "nvme": 0.0}))
    assert [t.get("hitRatio") for t in out] == [None, 0.0, None]   # no lookups: no figure; 0 is a figure
    assert hr.summary(out, 0.625) == "gpu=0.625 nvme=0"
    assert hr.summary(enabled("cpu"), None) is None


def test_tier_idle_names_the_tier_and_its_figure_and_only_judges_tiers_enabled_for_the_whole_window():
    measured = hr.HitRatios(idle={"cpu": 0.4, "nvme": 0.004}, idle_window_s=3600)
    status, reason, message = hr.idle_condition(enabled("cpu", "nvme"), measured, NOW)
    assert (status, reason) == ("True", "NoHits")
    assert "nvme (0.004)" in message and "cpu" not in message.split("over the last 1h:")[1].split(",")[0]
    assert "holds its memory or disk for no hits" in message and "1h" in message
    # nvme enabled 10 minutes ago: 10 minutes of a 1 h window say nothing yet.
    recent = enabled("cpu") + enabled("nvme", since="2026-01-01T23:50:00Z")
    assert hr.idle_condition(recent, measured, NOW)[:2] == ("False", "Serving")
    assert hr.idle_condition(enabled("cpu", "nvme"), hr.HitRatios(idle={"cpu": None, "nvme": None}), NOW)[:2] == (
        "False", "NoData")
    # A tier the guard disabled is bypassed (no hits by design): never idle.
    disabled = enabled("cpu") + [{"name": "nvme", "state": "Disabled", "reason": "SLOBreach", "since": OLD}]
    assert hr.idle_condition(disabled, measured, NOW)[0] == "False"
    # The threshold is a parameter (IDLE_RATIO by default).
    assert hr.idle_condition(enabled("cpu", "nvme"), measured, NOW, threshold=0.001)[0] == "False"
    assert hr.IDLE_RATIO == 0.01


# ---------------------------------------------------------------------------------------------- the guard step

def _policy_obj(status=None):
    obj = policy(tiers=TIERS, backend="kvtier", engine="vllm", slo=SLO)
    obj["metadata"]["generation"] = 3
    obj["status"] = status or {"engine": "vllm"}
    return obj


ANSWERS = {("gpu", "5m"): 0.6251, ("cpu", "5m"): 0.41234, ("nvme", "5m"): 0.1049,
           ("cpu", "1h"): 0.4, ("nvme", "1h"): 0.004}


def test_the_guard_step_measures_the_enabled_tiers_and_decides_exactly_as_without_them():
    guard = slo_settings(spec())
    scope = scope_for("ns", {"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"}]}, None)
    source = Canned(ANSWERS)
    step = decide(guard, _policy_obj(), source, scope, 1000.0)
    assert step.hit_ratios == hr.HitRatios(window={"gpu": 0.625, "cpu": 0.412, "nvme": 0.105},
                                           idle={"cpu": 0.4, "nvme": 0.004}, idle_window_s=3600.0)
    assert all(f'pod=~"{scope.pod_regex}"' in q and 'namespace="ns"' in q for q in source.asked)

    class NoScalars:  # a source that can only run the SLO queries
        def measure(self, queries):
            return source.slo

    plain = decide(guard, _policy_obj(), NoScalars(), scope, 1000.0)
    assert plain.hit_ratios is None
    assert (plain.state, plain.conditions, plain.events, plain.slo_state) == (
        step.state, step.conditions, step.events, step.slo_state)


def test_prometheus_down_or_a_broken_query_never_fails_the_guard():
    guard = slo_settings(spec())
    scope = scope_for("ns", {"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"}]}, None)
    down = Canned(ANSWERS, Measurements.unreachable("no usable answer"))
    step = decide(guard, _policy_obj(), down, scope, 1000.0)
    assert step.hit_ratios is None and down.asked == []   # the SLO queries failed: not asked again
    assert step.slo_state == "Unknown"

    class Raising(Canned):
        def query_scalar(self, promql):
            raise RuntimeError("transport broke")

    step = decide(guard, _policy_obj(), Raising(ANSWERS), scope, 1000.0)
    assert step.hit_ratios is None and step.slo_state == "OK"
    trt = decide(guard, _policy_obj({"engine": "trtllm"}), Canned(ANSWERS), scope, 1000.0)
    assert trt.hit_ratios is None   # vLLM's counters only


def test_without_backend_kvtier_only_the_gpu_prefix_cache_is_asked():
    native = slo_settings(policy(tiers=TIERS[:1], backend="native", engine="vllm", slo=SLO)["spec"])
    assert not native.tier_counters and slo_settings(spec()).tier_counters
    scope = scope_for("ns", {"targets": [{"kind": "Deployment", "name": "llm", "state": "Applied"}]}, None)
    source = Canned(ANSWERS)
    step = decide(native, _policy_obj(), source, scope, 1000.0)
    assert step.hit_ratios == hr.HitRatios(window={"gpu": 0.625}, idle={}, idle_window_s=3600.0)
    assert len(source.asked) == 1


def _status_after(step, before, now=NOW):
    parsed = KVCachePolicySpec.model_validate(spec())
    tiers = tier_states(parsed, before, now)
    fields = guard_fields(step, before.get("conditions") or [], 3, now, tiers, before.get("deviceHitRatio"))
    doc = {**before, **fields}
    return json.loads(json.dumps(KVCachePolicyStatus.model_validate(doc).model_dump(
        by_alias=True, exclude_none=True, exclude_unset=True)))


def test_status_carries_figures_a_summary_and_tier_idle_and_a_repeat_writes_nothing():
    guard = slo_settings(spec())
    decision = slo.evaluate(guard, None, Measurements.of(0.5, 0.01, 10.0), 1000.0)
    step = step_of(decision, guard.interval_s)
    step.hit_ratios = hr.HitRatios(window={"gpu": 0.625, "cpu": 0.412, "nvme": 0.105},
                                   idle={"cpu": 0.4, "nvme": 0.004}, idle_window_s=3600.0)
    before = {"tiers": enabled("cpu", "nvme"), "conditions": []}
    status = _status_after(step, before)
    assert [(t["name"], t["hitRatio"]) for t in status["tiers"]] == [("cpu", 0.412), ("nvme", 0.105)]
    assert status["hitRatios"] == "gpu=0.625 cpu=0.412 nvme=0.105" and status["deviceHitRatio"] == 0.625
    idle = next(c for c in status["conditions"] if c["type"] == "TierIdle")
    assert (idle["status"], idle["reason"], idle["observedGeneration"]) == ("True", "NoHits", 3)
    event = tier_idle_event(before, status)
    assert event is not None and event.reason == "TierIdle" and "nvme (0.004)" in event.message
    # The same rounded figures next interval: nothing to write, no second Event.
    again = _status_after(step, status, "2026-01-02T00:00:30Z")
    assert status_patch(status, {k: again[k] for k in ("tiers", "hitRatios", "deviceHitRatio", "conditions")}) \
        is None
    assert tier_idle_event(status, again) is None
    # The device's query did not answer: its stored figure stays, the tiers' new figures are written, and the
    # idle check (some of whose queries were never sent) is left as it was.
    step.hit_ratios = hr.HitRatios(window={}, error="down")
    kept = _status_after(step, status)
    assert kept["deviceHitRatio"] == 0.625 and kept["hitRatios"] == status["hitRatios"]
    assert next(c for c in kept["conditions"] if c["type"] == "TierIdle") == idle


def test_between_evaluations_the_figures_stay_and_without_spec_slo_they_go():
    parsed = KVCachePolicySpec.model_validate(spec())
    stored = {"tiers": enabled("cpu", "nvme", cpu=0.41, nvme=0.1)}
    assert [t.get("hitRatio") for t in tier_states(parsed, stored, NOW)] == [0.41, 0.1]
    unguarded = KVCachePolicySpec.model_validate({**spec(), "slo": None})
    assert [t.get("hitRatio") for t in tier_states(unguarded, stored, NOW)] == [None, None]


def test_idle_window_is_bounded_and_reaches_the_guard():
    assert slo_settings(spec()).idle_window_s == 3600
    assert slo_settings(spec(idleWindow="6h")).idle_window_s == 6 * 3600
    with pytest.raises(slo.SLOSpecError, match="idleWindow"):
        slo_settings(spec(idleWindow="48h"))
    with pytest.raises(slo.SLOSpecError, match="idleWindow"):
        slo_settings(spec(idleWindow="0s"))
