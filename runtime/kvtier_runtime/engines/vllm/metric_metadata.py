"""kvtier's engine metrics (:mod:`kvtier_runtime.engines.metric_defs`, defined once for every backend) as vLLM's
offloading metric metadata, what ``build_metric_definitions`` of a spec or a secondary tier returns."""
from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from ..metric_defs import EngineMetric

__all__ = ["vllm_metric_definitions"]


def vllm_metric_definitions(defs: Iterable[EngineMetric]) -> dict[str, OffloadingMetricMetadata]:
    """vLLM's metadata of each of ``defs``, by name (a name defined twice is a ValueError naming it)."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for d in defs:
        if d.name in out:
            raise ValueError(f"metric: {d.name} is defined twice")
        cls = OffloadingGaugeMetadata if d.kind == "gauge" else OffloadingCounterMetadata
        out[d.name] = cls(d.help, d.labels)
    return out
