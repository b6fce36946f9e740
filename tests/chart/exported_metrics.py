"""The metric names the project exports: the one list the chart's dashboard (and anything else that queries
Prometheus) is checked against.

Reconcile with the exporters when they change:
- runtime: ``runtime/kvtier_runtime/metrics.py`` (prometheus_client; a Counter ``x`` is exported as ``x_total``);
- operator: ``operator/kvtier_operator/metrics.py`` (class ``Metrics``);
- vLLM 0.33 (``vllm:`` names, which a Prometheus 2.x scrape may store as ``vllm_``; see the engine notes) and
  TensorRT-LLM (``trtllm_``), as the SLO guard and the PrometheusRule query them.
tests/chart/test_dashboard.py checks these lists against the real exporters whenever those modules are importable.
Values: the Prometheus type, which fixes the series suffixes a query may use.
"""
from __future__ import annotations

RUNTIME = {
    "kvtier_runtime_lookups": "counter",
    "kvtier_runtime_hits": "counter",
    "kvtier_runtime_promotions": "counter",
    "kvtier_runtime_demotions": "counter",
    "kvtier_runtime_bytes_moved": "counter",
    "kvtier_runtime_transfer_seconds": "histogram",
    "kvtier_runtime_occupancy_bytes": "gauge",
    "kvtier_runtime_capacity_bytes": "gauge",
    "kvtier_runtime_evictions": "counter",
    "kvtier_runtime_stores_rejected": "counter",
    "kvtier_runtime_fs_errors": "counter",
    "kvtier_runtime_fs_backoff": "gauge",
    "kvtier_runtime_remote_misses": "counter",
    "kvtier_runtime_remote_store_failures": "counter",
    "kvtier_runtime_remote_up": "gauge",
    "kvtier_runtime_remote_refused": "gauge",
    "kvtier_runtime_remote_previous_key_reads": "counter",
    "kvtier_runtime_remote_key_reloads": "counter",
}

OPERATOR = {
    "kvtier_operator_reconciles": "counter",
    "kvtier_operator_reconcile_errors": "counter",
    "kvtier_operator_reconcile_duration_seconds": "histogram",
    "kvtier_operator_applied_targets": "gauge",
    "kvtier_operator_api_writes": "counter",
    "kvtier_operator_tier_rollbacks": "counter",
    "kvtier_operator_slo_evaluations": "counter",
}

# Without the ``vllm:`` prefix; queries match either spelling with ``{__name__=~"vllm[:_]<name>"}``.
VLLM = {
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "external_prefix_cache_queries": "counter",
    "external_prefix_cache_hits": "counter",
    "prompt_tokens_cached_by_source": "counter",
}

# Without the ``trtllm_`` prefix; matched as ``{__name__=~"trtllm[:_]<name>"}`` like vLLM's.
TRTLLM = {
    "time_to_first_token_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "kv_cache_hit_rate": "gauge",
    "kv_cache_host_utilization": "gauge",
    "kv_cache_onboard_bytes": "counter",
    "kv_cache_offload_bytes": "counter",
}

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def series_names(families: dict[str, str], prefixes: tuple[str, ...] = ("",)) -> set[str]:
    """Every series name a scrape stores for these metric families."""
    return {f"{prefix}{name}{suffix}" for name, kind in families.items() for suffix in _SUFFIXES[kind]
            for prefix in prefixes}


def allowed_series() -> set[str]:
    return (series_names(RUNTIME) | series_names(OPERATOR) | series_names(VLLM, ("vllm:", "vllm_"))
            | series_names(TRTLLM, ("trtllm:", "trtllm_")))
