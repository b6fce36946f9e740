"""A policy's pass (controller.Operator.run_pass) with the SLO guard due, against an in-memory API and a canned
Prometheus: the measured hit ratios land in the one status write, TierIdle posts one Event when it turns True,
and passes between evaluations keep the figures."""
from __future__ import annotations

from kvtier_operator.status import condition
from plugins.policy_pass import CannedPrometheus, Guarded
from plugins.policy_pass import applied_world as _world


def test_a_guarded_pass_writes_the_figures_once_and_tier_idle_posts_one_event():
    kube, path = _world()
    source = CannedPrometheus({("gpu", "5m"): 0.62, ("cpu", "5m"): 0.4123, ("nvme", "5m"): 0.0049,
                               ("cpu", "1h"): 0.41, ("nvme", "1h"): 0.003})
    op = Guarded(kube, source)
    writes = kube.status_writes
    outcome = op.run_pass("default", "llm", [], guard_due=True)
    assert kube.status_writes == writes + 1   # status written once per pass
    status = kube.objects[path]["status"]
    assert [(t["name"], t.get("hitRatio")) for t in status["tiers"]] == [("cpu", 0.412), ("nvme", 0.005)]
    assert status["hitRatios"] == "gpu=0.62 cpu=0.412 nvme=0.005" and status["deviceHitRatio"] == 0.62
    idle = condition(status, "TierIdle")
    assert (idle["status"], idle["reason"], idle["observedGeneration"]) == ("True", "NoHits", 1)
    assert "nvme (0.003)" in idle["message"]
    [event] = [e for e in outcome.events if e.reason == "TierIdle"]
    assert event.type == "Normal" and "nvme" in event.message
    # Every query stayed on the policy's own pods.
    assert source.asked and all('namespace="default"' in q and 'pod=~"llm-' in q for q in source.asked)

    # The next evaluation measures the same rounded figures (0.41234 and 0.4116 both round to 0.412): the
    # guard's own state is rewritten, the figures and the condition are not, and no second Event.
    source.ratios[("cpu", "5m")] = 0.4116
    writes = kube.status_writes
    again = op.run_pass("default", "llm", [], guard_due=True)
    assert [e for e in again.events if e.reason == "TierIdle"] == []
    assert condition(kube.objects[path]["status"], "TierIdle") == idle
    sent = kube.patches[writes:]
    assert not any(k in patch for patch in sent for k in ("tiers", "hitRatios", "deviceHitRatio", "conditions"))
    # A pass between evaluations keeps the figures (it measures nothing) and writes nothing.
    writes = kube.status_writes
    op.run_pass("default", "llm", [], guard_due=False)
    assert [t.get("hitRatio") for t in kube.objects[path]["status"]["tiers"]] == [0.412, 0.005]
    assert kube.objects[path]["status"]["hitRatios"] == "gpu=0.62 cpu=0.412 nvme=0.005"
    assert kube.status_writes == writes

    # nvme serves again: TierIdle turns False (no Event for that), the new figure is written.
    source.ratios.update({("nvme", "5m"): 0.2, ("nvme", "1h"): 0.15})
    outcome = op.run_pass("default", "llm", [], guard_due=True)
    status = kube.objects[path]["status"]
    assert condition(status, "TierIdle")["status"] == "False" and condition(status, "TierIdle")["reason"] == "Serving"
    assert status["hitRatios"] == "gpu=0.62 cpu=0.412 nvme=0.2"
    assert [e for e in outcome.events if e.reason == "TierIdle"] == []


def test_spec_slo_removed_clears_the_figures():
    kube, path = _world()
    op = Guarded(kube, CannedPrometheus({("gpu", "5m"): 0.5, ("cpu", "5m"): 0.3, ("nvme", "5m"): 0.1,
                                         ("cpu", "1h"): 0.3, ("nvme", "1h"): 0.1}))
    op.run_pass("default", "llm", [], guard_due=True)
    assert kube.objects[path]["status"]["hitRatios"] == "gpu=0.5 cpu=0.3 nvme=0.1"
    del kube.objects[path]["spec"]["slo"]
    kube.objects[path]["metadata"]["generation"] = 2
    op.run_pass("default", "llm", [], guard_due=True)
    status = kube.objects[path]["status"]
    assert "hitRatios" not in status and "deviceHitRatio" not in status
    assert all("hitRatio" not in t for t in status["tiers"])
