"""A policy's pass (controller.Operator.run_pass) against an in-memory API and a canned Prometheus: the objects of
one applied policy and its workload, the reads and writes a pass makes on them, and an operator whose guard
measures the canned source."""
from __future__ import annotations

import copy
import re
from typing import Optional

from kvtier_operator import reconcile as rc
from kvtier_operator.controller import Operator
from kvtier_operator.kube import policy_path, workload_path
from kvtier_operator.settings import Settings
from kvtier_operator.slo.measurements import Measurements, Reading
from kvtier_operator.status import compose

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
        self.applied: list[tuple[str, dict]] = []  # (path, body) of every apply, in order

    def get(self, path: str) -> Optional[dict]:
        return copy.deepcopy(self.objects.get(path))

    def list(self, path: str, label_selector: Optional[str] = None) -> list[dict]:
        return [copy.deepcopy(o) for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path]

    def apply(self, path: str, body: dict, manager: str = "") -> dict:
        self.applied.append((path, copy.deepcopy(body)))
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
    """p99 TTFT and ITL and the request rate as set (by default within the SLO); the GPU prefix cache, cpu and nvme
    hit ratios as set."""

    def __init__(self, ratios: dict[tuple[str, str], float], p99s: tuple[float, float, float] = (0.5, 0.01, 10.0)):
        self.ratios = ratios
        self.p99s = p99s
        self.asked: list[str] = []

    def measure(self, queries):
        return Measurements.of(*self.p99s)

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


def applied_world(slo: Optional[dict] = None) -> tuple[MemoryKube, str]:
    """The policy (``slo``: its spec.slo, by default SLO) applied to its workload, both tiers enabled since long
    ago: the API's objects and the policy's path."""
    pol = policy(tiers=TIERS, backend="kvtier", engine="vllm", slo=slo or SLO)
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
