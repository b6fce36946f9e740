"""The operator's own Prometheus metrics, in a registry per operator instance (tests run several)."""
from __future__ import annotations

from typing import Optional
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("kvtier_operator_reconciles_total", "Policy reconciles, by result.",
                                  ["result"], registry=r)
        self.errors = Counter("kvtier_operator_reconcile_errors_total",
                              "Reconcile attempts that failed and were retried, by cause.", ["reason"], registry=r)
        self.duration = Histogram("kvtier_operator_reconcile_duration_seconds", "Time of one reconcile.",
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.applied_targets = Gauge("kvtier_operator_applied_targets",
                                     "Workloads carrying a policy's configuration.", ["namespace", "policy"],
                                     registry=r)
        self.api_writes = Counter("kvtier_operator_api_writes_total", "Writes sent to the API server, by kind.",
                                  ["kind"], registry=r)
        self.rollbacks = Counter("kvtier_operator_tier_rollbacks_total",
                                 "Tiers disabled by the SLO guard.", ["namespace", "policy", "tier"], registry=r)
        self.slo_evaluations = Counter("kvtier_operator_slo_evaluations_total",
                                       "SLO guard evaluations, by verdict.", ["verdict"], registry=r)
        self._server: Optional[WSGIServer] = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def value(self, name: str, labels: Optional[dict[str, str]] = None) -> float:
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got
