"""A policy's pass (controller.Operator.run_pass) with the SLO guard due, against an in-memory API and a canned
Prometheus: the measured hit ratios land in the one status write, TierIdle posts one Event when it turns True,
and passes between evaluations keep the figures."""
from __future__ import annotations

import copy
import re
from typing import Optional

from kvtier_operator import reconcile as rc
from kvtier_operator.controller import Operator
from kvtier_operator.kube import policy_path, workload_path
from kvtier_operator.settings import Settings
from kvtier_operator.slo.measurements import Measurements, Reading
from kvtier_operator.status import compose, condition

from plugins.operator import deployment, observed, policy

LONG_AGO = "2026-01-01T00:00:00Z"
TIERS = [{"name": "cpu", "medium": "cpu", "size": "16Gi"},
         {"name": "nvme", "medium": "filesystem", "size": "100Gi", "path": "/mnt/nvme", "volume": {"emptyDir": {}}}]
SLO = {"prometheus": {"url": "http://prometheus.monitoring:9090"}, "ttftP99": "2s", "window": "5m",
       "idleWindow": "1h"}


class MemoryKube:
    """The reads and writes of a pass on a dict of objects by path; status patches merged, writes counted."""

    def __init__(self, objects: dict[str, dict]):
        self.objects = objects
        self.status_writes = 0
        self.patches: list[dict] = []

    def get(self, path: str) -> Optional[dict]:
        return copy.deepcopy(self.objects.get(path))

    def list(self, path: str, label_selector: Optional[str] = None) -> list[dict]:
        return [copy.deepcopy(o) for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path]

    def apply(self, path: str, body: dict, manager: str = "") -> dict:
        obj = self.objects.setdefault(path, copy.deepcopy(body))
        obj.setdefault("metadata", {})["resourceVersion"] = "2"
        return copy.deepcopy(obj)

    def patch(self, path: str, body: dict, content_type: str = "") -> dict:
        obj = self.objects[path.removesuffix("/status")]
        if "status" in body:
            self.status_writes += 1
            self.patches.append(body["status"])
            status = obj.setdefault("status", {})
            for k, v in body["status"].items():
                if v is None:
                    status.pop(k, None)
                else:
                    status[k] = v
        return copy.deepcopy(obj)

    def delete(self, path: str) -> bool:
        return self.objects.pop(path, None) is not None


class CannedPrometheus:
    """p99s within the SLO; the GPU prefix cache, cpu and nvme hit ratios as set."""

    def __init__(self, ratios: dict[tuple[str, str], float]):
        self.ratios = ratios
        self.asked: list[str] = []

    def measure(self, queries):
        return Measurements.of(0.5, 0.01, 10.0)

    def query_scalar(self, promql: str) -> Reading:
        self.asked.append(promql)
        what = "gpu" if "prefix_cache_hits" in promql else re.search(r'tier="([^"]+)"', promql).group(1)
        return Reading.of(self.ratios[(what, re.search(r"\[([0-9]+[smh])\]", promql).group(1))], promql)

    def close(self) -> None:
        pass


class Guarded(Operator):
    def __init__(self, kube, source):
        super().__init__(Settings(read_nodes=False), kube)
        self.source = source

    def measurement_source(self, namespace, name):
        return self.source


def _world() -> tuple[MemoryKube, str]:
    pol = policy(tiers=TIERS, backend="kvtier", engine="vllm", slo=SLO)
    pol["metadata"]["resourceVersion"] = "1"
    wl = observed(deployment())
    [t] = rc.plan(pol, [wl], [], now=LONG_AGO).targets
    wl["metadata"]["labels"].update(t.apply["metadata"]["labels"])
    args = wl["spec"]["template"]["spec"]["containers"][0]["args"]
    wl["spec"]["template"] = copy.deepcopy(t.apply["spec"]["template"])
    wl["spec"]["template"]["spec"]["containers"][0]["args"] = args
    # Applied, with both tiers enabled since long before the idle window.
    pol["status"] = compose({}, rc.plan(pol, [wl], [], now=LONG_AGO).status)
    path = policy_path("default", "llm")
    return MemoryKube({path: pol, workload_path("Deployment", "default", "llm"): wl}), path


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
