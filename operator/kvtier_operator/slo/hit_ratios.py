"""Per-tier hit ratios: what share of the prompt tokens looked up each tier served, measured from the engines'
own counters over the guard's window (and, for the idle check, over ``spec.slo.idleWindow``).

Informational only: nothing here feeds a verdict. The guard asks for them after its SLO queries answered, with the
same client, the same scope (the policy's own pods) and the same bounds (one query per figure, each with the
client's deadline and size limit); the first query that fails stops the rest, and so does a spent time budget
(one query timeout for them all), so they add at most about two query timeouts to an evaluation. The figures are

- a tier's: ``(sum(rate(vllm:kv_offload_kvtier_hit_tokens_total{tier=T}[w])) or vector(0)) /
  sum(rate(vllm:kv_offload_kvtier_lookup_tokens_total[w]))``; the ``or vector(0)`` makes a tier that was
  looked up but never hit read 0 (the runtime exports a tier's counter once it first served a token), and no
  lookups at all read as no data (0/0), never as 0;
- the device's (``gpu``, vLLM's own prefix cache): ``vllm:prefix_cache_hits_total / prefix_cache_queries_total``.

A ratio is clamped to [0, 1] (rates of two counters scraped apart can overshoot by a hair) and rounded to 3
decimals, so status changes only when the rounded figure does.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional, Protocol

from .measurements import Reading
from .queries import Scope, promql_duration, series_selector

# An enabled tier serving fewer than this share of the looked-up tokens over the idle window is TierIdle.
IDLE_RATIO = 0.01
# The summary's name for the engine's own GPU prefix cache (left out when a declared tier has this name).
DEVICE_TIER = "gpu"
DECIMALS = 3
# kvtier's engine counters (defined in kvtier_runtime/engines/metric_defs.py; the operator imports only the runtime's
# config contract, so a runtime test checks that these patterns match the names defined there).
HIT_TOKENS = "vllm[:_]kv_offload_kvtier_hit_tokens_total"
LOOKUP_TOKENS = "vllm[:_]kv_offload_kvtier_lookup_tokens_total"
PREFIX_HITS = "vllm[:_]prefix_cache_hits_total"
PREFIX_QUERIES = "vllm[:_]prefix_cache_queries_total"
# Engines whose counters these are (kvtier's runtime and the prefix-cache counters are vLLM's).
ENGINES = ("vllm",)


class ScalarSource(Protocol):
    def query_scalar(self, promql: str) -> Reading: ...


def _tier_scope(scope: Scope, tier: str) -> Scope:
    return Scope(namespace=scope.namespace, pods=scope.pods, pod_regex=scope.pod_regex, model_name=scope.model_name,
                 extra_labels={**scope.extra_labels, "tier": tier}, namespace_label=scope.namespace_label,
                 pod_label=scope.pod_label)


def tier_query(tier: str, scope: Scope, window_s: float) -> str:
    """Tokens ``tier`` served over all tokens looked up in kvtier, on the scope's pods, over ``window_s``."""
    w = promql_duration(window_s)
    return (f"(sum(rate({series_selector(HIT_TOKENS, _tier_scope(scope, tier))}[{w}])) or vector(0)) / "
            f"sum(rate({series_selector(LOOKUP_TOKENS, scope)}[{w}]))")


def device_query(scope: Scope, window_s: float) -> str:
    """vLLM's GPU prefix cache: hit tokens over queried tokens, on the scope's pods, over ``window_s``."""
    w = promql_duration(window_s)
    return (f"sum(rate({series_selector(PREFIX_HITS, scope)}[{w}])) / "
            f"sum(rate({series_selector(PREFIX_QUERIES, scope)}[{w}]))")


@dataclass(frozen=True)
class HitRatioQueries:
    """PromQL per figure: ``window`` by tier (the device under :data:`DEVICE_TIER`), ``idle`` by enabled tier."""

    window: dict[str, str]
    idle: dict[str, str]
    idle_window_s: float


def build(tiers: Iterable[str], scope: Scope, window_s: float, idle_window_s: float,
          device: bool = True) -> HitRatioQueries:
    names = list(dict.fromkeys(tiers))
    window = {DEVICE_TIER: device_query(scope, window_s)} if device and DEVICE_TIER not in names else {}
    window.update({t: tier_query(t, scope, window_s) for t in names})
    return HitRatioQueries(window=window, idle={t: tier_query(t, scope, idle_window_s) for t in names},
                           idle_window_s=idle_window_s)


# A figure: a ratio in [0, 1], or None when Prometheus answered with no data (no lookups in the window).
Figure = Optional[float]


def ratio(reading: Reading) -> tuple[bool, Figure]:
    """(answered, figure) of one reading. Not answered (an error): the figure is unknown, what status says stays.
    Answered with no series, NaN (0/0: nothing looked up) or Inf (hits without lookups: counters out of step):
    no figure."""
    if reading.is_error:
        return False, None
    value = reading.value
    if value is None or math.isnan(value) or math.isinf(value):
        return True, None
    return True, round(min(1.0, max(0.0, value)), DECIMALS)


@dataclass(frozen=True)
class HitRatios:
    """What one evaluation measured. A tier missing from ``window``/``idle`` was not measured (a query failed):
    its stored figure stays; a tier present with None was measured and has no figure (no lookups)."""

    window: dict[str, Figure] = field(default_factory=dict)
    idle: dict[str, Figure] = field(default_factory=dict)
    idle_window_s: float = 3600.0
    error: Optional[str] = None


def measure(source: ScalarSource, queries: HitRatioQueries, budget_s: Optional[float] = None,
            clock: Callable[[], float] = time.monotonic) -> HitRatios:
    """Ask ``source`` each query in turn; the first error stops the rest (one unreachable server, one timeout),
    and no query starts once ``budget_s`` seconds are spent (a slow Prometheus must not stretch the evaluation)."""
    out: dict[str, dict[str, Figure]] = {"window": {}, "idle": {}}
    start = clock()
    for part, texts in (("window", queries.window), ("idle", queries.idle)):
        for tier, promql in texts.items():
            if budget_s is not None and clock() - start >= budget_s:
                return HitRatios(out["window"], out["idle"], queries.idle_window_s,
                                 f"time budget of {budget_s:g}s spent before every hit ratio was asked")
            reading = source.query_scalar(promql)
            answered, figure = ratio(reading)
            if not answered:
                return HitRatios(out["window"], out["idle"], queries.idle_window_s, reading.error)
            out[part][tier] = figure
    return HitRatios(out["window"], out["idle"], queries.idle_window_s)


# ---------------------------------------------------------------------------------------------- into status

def with_figures(tiers: Iterable[Mapping[str, Any]], measured: HitRatios) -> list[dict[str, Any]]:
    """``status.tiers`` with each tier's ``hitRatio`` from this evaluation: set where measured, removed where the
    tier is not Enabled or had no lookups, kept where its query did not answer (pure)."""
    out = []
    for t in tiers:
        entry = dict(t)
        name = entry.get("name")
        if entry.get("state") != "Enabled":
            entry.pop("hitRatio", None)
        elif name in measured.window:
            figure = measured.window[name]
            if figure is None:
                entry.pop("hitRatio", None)
            else:
                entry["hitRatio"] = figure
        out.append(entry)
    return out


def summary(tiers: Iterable[Mapping[str, Any]], device: Figure) -> Optional[str]:
    """``gpu=0.62 cpu=0.412 nvme=0.005``: the device first, then the tiers with a figure in spec order, each the
    figure status holds (3 decimals, trailing zeros dropped, so the column and the TierIdle message agree); None
    when there is no figure at all."""
    parts = [] if device is None else [f"{DEVICE_TIER}={round(device, DECIMALS):g}"]
    parts += [f"{t['name']}={round(t['hitRatio'], DECIMALS):g}" for t in tiers if t.get("hitRatio") is not None]
    return " ".join(parts) or None


def _seconds(rfc3339: Optional[str]) -> Optional[float]:
    if not rfc3339:
        return None
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def idle_tiers(tiers: Iterable[Mapping[str, Any]], idle: Mapping[str, Figure], now: str, idle_window_s: float,
               threshold: float = IDLE_RATIO) -> tuple[list[tuple[str, float]], bool]:
    """(tiers idle over the whole window with their figure, whether any tier could be judged). A tier is judged
    only when Enabled for at least the window (a tier enabled 5 minutes ago has served 5 minutes of a 1 h window)
    and when its figure exists (lookups happened)."""
    at = _seconds(now)
    idle_out, judged = [], False
    for t in tiers:
        name, figure = t.get("name"), idle.get(str(t.get("name")))
        if t.get("state") != "Enabled" or figure is None or not isinstance(name, str):
            continue
        since = _seconds(t.get("since"))
        if at is None or since is None or at - since < idle_window_s:
            continue
        judged = True
        if figure < threshold:
            idle_out.append((name, figure))
    return idle_out, judged


def idle_condition(tiers: Iterable[Mapping[str, Any]], measured: HitRatios, now: str,
                   threshold: float = IDLE_RATIO) -> tuple[str, str, str]:
    """``TierIdle`` as (status, reason, message): True NoHits naming each idle tier and its figure, False
    otherwise (Serving, or NoData when no tier could be judged)."""
    window = promql_duration(measured.idle_window_s)
    idle, judged = idle_tiers(tiers, measured.idle, now, measured.idle_window_s, threshold)
    if idle:
        named = ", ".join(f"{name} ({figure:.3f})" for name, figure in idle)
        return ("True", "NoHits",
                f"enabled tier(s) served almost no lookups over the last {window}: {named}, under {threshold:g} of "
                "the prompt tokens looked up; each holds its memory or disk for no hits (consider a smaller size, "
                "disabling it, or a longer spec.slo.idleWindow if traffic is bursty)")
    if judged:
        return "False", "Serving", f"every enabled tier served at least {threshold:g} of the lookups over {window}"
    return ("False", "NoData", f"no enabled tier could be judged over {window}: no lookups, or enabled for less "
                               "than the window")

