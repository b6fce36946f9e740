"""The SLO guard wired into the operator, against the real API server.

Prometheus itself is exercised by the SLO guard's own tests (tests/operator/slo/test_slo_prometheus.py, with a real
Prometheus); here the measurements come from a scripted source so that what is tested is the wiring: the
daemon's interval, status.slo, tier states, the re-render without the rolled-back tier, the Warning Event,
history and the rollback metric.
"""
from __future__ import annotations

import pytest
from kvtier_operator import slo
from kvtier_operator.kube import policy_path
from plugins.operator import (
    cond,
    deployment,
    get_policy,
    get_workload,
    make_policy,
    nvme_tier,
    template_hash,
    user_apply,
    wait_applied,
    wait_for,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


class Scripted:
    """Every evaluation measures p99 TTFT ``ttft`` seconds at 10 requests/s."""

    def __init__(self, ttft: float):
        self.ttft = ttft
        self.calls = 0

    def measure(self, queries):
        self.calls += 1
        return slo.Measurements.of(self.ttft, 0.01, 10.0)

    def close(self):
        pass


def test_sustained_breach_disables_the_newest_tier_and_rerenders(kube, namespace, run_operator):
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator()
    source = Scripted(ttft=0.5)
    runner.op.slo_source = lambda ns, name: source
    create_policy_body = make_policy(
        "llm", namespace, tiers=[{"name": "cpu", "medium": "cpu", "size": "16Gi"}, nvme_tier()],
        slo={"prometheus": {"url": "http://prometheus.invalid:9090"}, "ttftP99": "2s", "interval": "1s",
             "window": "1s", "consecutiveBreaches": 2, "cooldown": "1h", "minRequestRate": 0.1})
    kube.create(policy_path(namespace), create_policy_body)
    pol, wl = wait_applied(kube, namespace, "llm", "llm")
    assert pol["status"]["activeTiers"] == "cpu,nvme"
    wait_for(lambda: (get_policy(kube, namespace, "llm")["status"].get("sloState") == "OK"), 15, what="SLO OK")
    before = template_hash(wl)

    source.ttft = 5.0  # sustained breach
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   any(t["name"] == "nvme" and t["state"] == "Disabled" for t in p["status"]["tiers"]) and p,
                   20, what="nvme disabled by the guard")
    pol, wl = wait_applied(kube, namespace, "llm", "llm")
    wait_for(lambda: template_hash(get_workload(kube, namespace, "llm")) != before, 15, what="re-render")
    # The reconcile applies the workload first and writes the policy's status after it, so wait for both.
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and p["status"]["activeTiers"] == "cpu" and p,
                   15, what="status.activeTiers without nvme")
    volumes = {v["name"] for v in get_workload(kube, namespace, "llm")["spec"]["template"]["spec"]["volumes"]}
    assert "kvtier-tier-nvme" not in volumes and "kvtier-shm" in volumes
    [entry] = [h for h in pol["status"]["slo"]["history"] if h["action"] == "Disabled"]
    assert entry["tier"] == "nvme" and entry["metric"] == "ttftP99" and entry["value"] == 5.0
    assert entry["threshold"] == 2.0
    assert cond(pol, "TierRolledBack")["status"] == "True"
    assert runner.op.metrics.value("kvtier_operator_tier_rollbacks_total",
                                   {"namespace": namespace, "policy": "llm", "tier": "nvme"}) == 1
    events = kube.list(f"/api/v1/namespaces/{namespace}/events")
    assert any(e.get("reason") == "TierDisabled" and e.get("type") == "Warning" for e in events)

    # A person re-enables the tier with the annotation: the guard acknowledges it (drops the annotation), the
    # tier is Enabled again and the workload is re-rendered with it.
    source.ttft = 0.5
    kube.patch(policy_path(namespace, "llm"), {"metadata": {"annotations": {"kvtier.io/reenable": "nvme"}}})
    wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
             "kvtier.io/reenable" not in (p["metadata"].get("annotations") or {}) and
             p["status"]["activeTiers"] == "cpu,nvme", 20, what="nvme re-enabled, annotation acknowledged")
    assert get_policy(kube, namespace, "llm")["status"]["slo"]["disabled"] == {}
    wait_for(lambda: "kvtier-tier-nvme" in {v["name"] for v in get_workload(kube, namespace, "llm")
                                            ["spec"]["template"]["spec"]["volumes"]}, 20, what="nvme mounted again")
    assert any(h["action"] == "Reenabled" and h["tier"] == "nvme"
               for h in get_policy(kube, namespace, "llm")["status"]["slo"]["history"])


def test_missing_prometheus_secret_is_slo_unknown_like_an_unreachable_endpoint(kube, namespace, run_operator):
    # No scripted source: the guard must resolve spec.slo.prometheus itself, and the Secret it names is absent.
    # Issue 24 (class F, oracles): the condition reads exactly as for an endpoint that cannot be reached, so a
    # policy author cannot tell whether a Secret exists; the guard keeps evaluating, and nothing is sent.
    user_apply(kube, deployment("llm", namespace))
    runner = run_operator(prometheus_allowed=("prometheus.invalid:9090",))  # the admin allows it; the Secret is absent
    kube.create(policy_path(namespace), make_policy(
        "llm", namespace, slo={"prometheus": {"url": "http://prometheus.invalid:9090",
                                              "auth": {"bearerToken": {"name": "prom-token", "key": "token"}}},
                               "ttftP99": "2s", "interval": "1s", "window": "1s"}))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "SLOUnknown").get("status") == "True" and p, 20, what="SLOUnknown on a missing Secret")
    unknown = cond(pol, "SLOUnknown")
    assert unknown["reason"] == "QueryError"
    assert "no usable answer from http://prometheus.invalid:9090" in unknown["message"]
    assert "prom-token" not in unknown["message"]
    assert pol["status"]["sloState"] == "Unknown"
    since = unknown["lastTransitionTime"]
    before = runner.op.metrics.value("kvtier_operator_slo_evaluations_total", {"verdict": "error"})
    wait_for(lambda: runner.op.metrics.value("kvtier_operator_slo_evaluations_total",
                                             {"verdict": "error"}) >= before + 3, 20, what="three more evaluations")
    # The same problem on every interval: the transition time holds.
    assert cond(get_policy(kube, namespace, "llm"), "SLOUnknown")["lastTransitionTime"] == since
