"""PromQL for the SLO guard: p99 TTFT, p99 inter-token latency and request rate, per engine, per target.

Names are matched by regex on ``__name__`` because the stored name depends on the scrape: prometheus_client
0.26 answers an OpenMetrics-negotiating scraper (Prometheus 2.x by default) with ``escaping=underscores``, so
vLLM's ``vllm:time_to_first_token_seconds`` is stored as ``vllm_time_to_first_token_seconds``; a classic text
scrape keeps the colon. ``vllm[:_]...`` finds either.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .settings import QUERY_OVERRIDE_KEYS


@dataclass(frozen=True)
class EngineMetrics:
    """Regexes (RE2, fully anchored by Prometheus) over ``__name__`` for one engine's series."""

    ttft_bucket: str
    itl_bucket: str
    requests_count: str


ENGINE_METRICS: dict[str, EngineMetrics] = {
    "vllm": EngineMetrics(
        ttft_bucket="vllm[:_]time_to_first_token_seconds_bucket",
        itl_bucket="vllm[:_]inter_token_latency_seconds_bucket",
        requests_count="vllm[:_]e2e_request_latency_seconds_count",
    ),
    # TensorRT-LLM's collector prefixes with ``trtllm_`` (no colon); Dynamo re-exports with ``trtllm:``.
    "trtllm": EngineMetrics(
        ttft_bucket="trtllm[:_]time_to_first_token_seconds_bucket",
        itl_bucket="trtllm[:_]time_per_output_token_seconds_bucket",
        requests_count="trtllm[:_]e2e_request_latency_seconds_count",
    ),
}


@dataclass(frozen=True)
class Scope:
    """Which series belong to the policy's targets: a namespace plus pod names, a pod regex or a model name."""

    namespace: str | None = None
    pods: Sequence[str] = ()
    pod_regex: str | None = None
    model_name: str | None = None
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    # Label names differ between scrape set-ups (kube-prometheus uses namespace/pod; a static job may not).
    namespace_label: str = "namespace"
    pod_label: str = "pod"

    def matchers(self) -> list[str]:
        out: list[str] = []
        if self.namespace:
            out.append(f'{self.namespace_label}="{escape_label_value(self.namespace)}"')
        if self.pods and self.pod_regex:
            raise ValueError("scope: give pods or pod_regex, not both")
        if self.pods:
            alternatives = "|".join(_re2_literal(p) for p in sorted(set(self.pods)))
            out.append(f'{self.pod_label}=~"{escape_label_value(alternatives)}"')
        elif self.pod_regex:
            out.append(f'{self.pod_label}=~"{escape_label_value(self.pod_regex)}"')
        if self.model_name:
            out.append(f'model_name="{escape_label_value(self.model_name)}"')
        for name, value in sorted(self.extra_labels.items()):
            if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name):
                raise ValueError(f"scope.extra_labels: {name!r} is not a Prometheus label name")
            out.append(f'{name}="{escape_label_value(value)}"')
        return out


@dataclass(frozen=True)
class QuerySet:
    ttft_p99: str
    itl_p99: str
    request_rate: str


def _re2_literal(text: str) -> str:
    """``text`` as an RE2 literal (Python's re.escape also escapes ``-``, which makes pod regexes unreadable)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)


def escape_label_value(value: str) -> str:
    """A PromQL double-quoted string body."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def promql_duration(seconds: float) -> str:
    """``300`` -> ``5m``, ``2.5`` -> ``2500ms``: the shortest exact PromQL range."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"window: {seconds!r} must be a positive number of seconds")
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"window: {seconds!r} is shorter than 1ms")
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def series_selector(name_regex: str, scope: Scope) -> str:
    """The series whose name matches ``name_regex``, of the scope's pods: ``{__name__=~"...", namespace=...}``."""
    return "{" + ", ".join([f'__name__=~"{name_regex}"', *scope.matchers()]) + "}"


def p99_query(bucket_regex: str, scope: Scope, window_s: float, quantile: float = 0.99) -> str:
    """p99 across all target pods: rates summed by ``le`` before the quantile, as histograms must be."""
    return (
        f"histogram_quantile({quantile}, sum by (le) "
        f"(rate({series_selector(bucket_regex, scope)}[{promql_duration(window_s)}])))"
    )


def rate_query(count_regex: str, scope: Scope, window_s: float) -> str:
    return f"sum(rate({series_selector(count_regex, scope)}[{promql_duration(window_s)}]))"


def build_queries(engine: str, scope: Scope, window_s: float,
                  overrides: Mapping[str, str] | None = None) -> QuerySet:
    """The three queries for ``engine``; ``overrides`` (keys ttftP99, itlP99, requestRate) replace any of them.

    In an override, ``$window`` is replaced by the window (``5m``) and ``$selector`` by the scope's label
    matchers (``namespace="x", pod=~"a|b"``), so a custom query can still follow the policy's targets.
    """
    if engine not in ENGINE_METRICS:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINE_METRICS)}")
    names = ENGINE_METRICS[engine]
    queries = {
        "ttftP99": p99_query(names.ttft_bucket, scope, window_s),
        "itlP99": p99_query(names.itl_bucket, scope, window_s),
        "requestRate": rate_query(names.requests_count, scope, window_s),
    }
    for key, text in (overrides or {}).items():
        if key not in QUERY_OVERRIDE_KEYS:
            raise ValueError(f"spec.slo.queries.{key}: unknown; expected one of {', '.join(QUERY_OVERRIDE_KEYS)}")
        queries[key] = (
            text.replace("$window", promql_duration(window_s)).replace("$selector", ", ".join(scope.matchers()))
        )
    return QuerySet(ttft_p99=queries["ttftP99"], itl_p99=queries["itlP99"], request_rate=queries["requestRate"])
