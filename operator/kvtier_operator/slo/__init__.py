"""The SLO guard: PromQL per engine, a Prometheus reader, and the pure decision engine that rolls back the
newest tier when p99 TTFT/ITL stays over budget and enables tiers one stage at a time."""
from .decisions import (
    AcknowledgeReenable,
    Action,
    Decision,
    DisableTier,
    EnableTier,
    RecordEvent,
    SetCondition,
    action_to_dict,
    assess,
    evaluate,
    read_state,
    stored_state,
    thresholds,
)
from .guard import queries_for, tick
from .measurements import Measurements, Reading
from .queries import QuerySet, Scope, build_queries
from .settings import PrometheusSettings, SecretKeyRef, SLOSettings, SLOSpecError

__all__ = [
    "AcknowledgeReenable", "Action", "Decision", "DisableTier", "EnableTier", "Measurements",
    "PrometheusSettings", "QuerySet", "Reading", "RecordEvent", "SLOSettings", "SLOSpecError", "Scope",
    "SecretKeyRef", "SetCondition", "action_to_dict", "assess", "build_queries", "evaluate", "queries_for",
    "read_state", "stored_state", "thresholds", "tick",
]
