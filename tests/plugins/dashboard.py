"""What the chart's Grafana dashboard reads, and what the runtime's Prometheus registry holds (for the tests that
require every queried kvtier_runtime_* series to be exported by a production path)."""
from __future__ import annotations

import json
from pathlib import Path

from chart.promql_names import metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvtier" / "files" / "grafana-dashboard.json"


def dashboard_runtime_series() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for target in p.get("targets", []):
                names |= {n for n in metric_names(target["expr"]) if n.startswith("kvtier_runtime_")}
    return names


def samples(name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client import REGISTRY

    return [(s.labels, s.value) for family in REGISTRY.collect() for s in family.samples if s.name == name]
