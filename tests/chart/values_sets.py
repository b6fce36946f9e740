"""Value sets the chart is rendered with in tests: the defaults and every optional part switched on."""
from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {}

EVERYTHING_ON: dict[str, Any] = {
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "prometheusRule": {"enabled": True}},
    "grafana": {"dashboard": {"enabled": True}},
    "peering": {"enabled": True},
    "replicaCount": 2,
    "slo": {"authSecrets": ["serving"]},
    "image": {"digest": "sha256:" + "a" * 64},
    "podAnnotations": {"example.com/a": "b"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "operator": {"extraEnv": [{"name": "EXTRA", "value": "1"}], "verbose": True},
    "initImage": {"repository": "registry.example.com/kvtier-runtime", "tag": "0.1.0"},
}

NAMESPACED: dict[str, Any] = {
    "operator": {"watchNamespaces": ["serving", "staging"]},
    "peering": {"enabled": True},
    "replicaCount": 2,
    "slo": {"authSecrets": ["serving"]},
}

MINIMAL: dict[str, Any] = {
    "crds": {"enabled": False},
    "metrics": {"enabled": False},
    "rbac": {"aggregateToDefaultRoles": False},
}

ALL = {"defaults": DEFAULTS, "everything-on": EVERYTHING_ON, "namespaced": NAMESPACED, "minimal": MINIMAL}
