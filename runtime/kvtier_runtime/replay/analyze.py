"""``kvtier replay analyze``: how a trace reuses its prefixes, and what block size and capacity it calls for."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import PolicySpec, replay_single
from .lru_curve import LRUCurve, reuse_distances
from .metrics import flatten, prefix_hit_count
from .trace import Trace

# How far below LRU a policy may fall at any measured size and still be recommended (the floor the recommended
# policy is tested against, tests/runtime/policies/test_policies_floor.py).
LRU_FLOOR = 0.005

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


def reuse_times_ms(trace: Trace) -> list[float]:
    """Milliseconds between consecutive requests that access the same block (empty when the trace's timestamps
    are out of order: a negative reuse time would be a lie, and the loader has warned)."""
    if trace.out_of_order:
        return []
    last: dict[int, float] = {}
    out: list[float] = []
    for ts, req in zip(trace.timestamps_ms, trace.requests):
        for k in req:
            prev = last.get(k)
            if prev is not None:
                out.append(ts - prev)
            last[k] = ts
    return out


def quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {f"p{int(q * 100)}": s[min(len(s) - 1, int(q * len(s)))] for q in QUANTILES}


def top_prefixes(trace: Trace, block_tokens: int, n: int = 10) -> list[dict[str, Any]]:
    """The prefixes whose reuse is worth the most tokens: (accesses - 1) x prefix length.

    A block is reported only where its prefix ends, i.e. not when its child block has the same access count
    (then the child names the same, longer reused prefix), so one long document is one row, not seventy.
    """
    counts: Counter[int] = Counter()
    depth: dict[int, int] = {}
    for req in trace.requests:
        for pos, k in enumerate(req):
            counts[k] += 1
            depth.setdefault(k, pos)
    subsumed: set[int] = set()
    for req in trace.requests:
        for parent, child in zip(req, req[1:]):
            if counts[child] == counts[parent]:
                subsumed.add(parent)
    candidates = [k for k in counts if counts[k] > 1 and k not in subsumed]
    ranked = sorted(candidates, key=lambda k: (-(counts[k] - 1) * (depth[k] + 1), k))[:n]
    return [{"block_id": k, "prefix_blocks": depth[k] + 1, "prefix_tokens": (depth[k] + 1) * block_tokens,
             "accesses": counts[k], "reused_tokens": (counts[k] - 1) * (depth[k] + 1) * block_tokens}
            for k in ranked]


def chunk_requests(requests: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """Requests as chunks of ``k`` blocks, a chunk keyed by its last block (ids are prefix-chained, so the last
    id names the whole prefix). A trailing partial chunk is dropped: only full chunks are stored."""
    return [[req[i + k - 1] for i in range(0, len(req) - k + 1, k)] for req in requests]


@dataclass(frozen=True)
class Budgets:
    kv_bytes_per_token: int | None = None
    bandwidth_gb_s: float | None = None
    prefill_tokens_per_s: float | None = None
    transfer_latency_s: float = 50e-6
    capacity_bytes: int | None = None


NO_BUDGETS = Budgets()


def hit_ratio_at(trace: Trace, capacity_blocks: int, spec: PolicySpec, chunk_blocks: int = 1) -> tuple[int, int]:
    """(prefix-hit blocks, loaded chunks) replaying ``spec`` over chunks of ``chunk_blocks`` blocks."""
    reqs = trace.requests if chunk_blocks == 1 else chunk_requests(trace.requests, chunk_blocks)
    cap = max(1, capacity_blocks // chunk_blocks)
    hits, _ = replay_single(reqs, spec.build(cap))
    _, lengths = flatten(reqs)
    loaded = prefix_hit_count(hits, lengths)
    return loaded * chunk_blocks, loaded


def analyze(trace: Trace, block_tokens: int, specs: Sequence[PolicySpec] | PolicySpec, budgets: Budgets = NO_BUDGETS,
            progress: Callable[[], object] | None = None) -> dict[str, Any]:
    """Reuse statistics and sizing advice; capacity is recommended from the BEST of ``specs`` at each size (the
    default policy is not always the best, and advice should not be worse than what the user can deploy)."""
    if isinstance(specs, PolicySpec):
        specs = [specs]
    keys, lengths = flatten(trace.requests)
    n = len(keys)
    counts = Counter(keys)
    distinct = len(counts)
    dist = reuse_distances(keys)
    out: dict[str, Any] = {
        "requests": len(trace.requests),
        "block_accesses": n,
        "distinct_blocks": distinct,
        "block_tokens": block_tokens,
        "never_reused_fraction": sum(1 for c in counts.values() if c == 1) / distinct,
        "reuse_distance_blocks": quantiles(dist),
        "reuse_time_ms": quantiles(reuse_times_ms(trace)),
        "reuse_time_note": ("omitted: timestamps are out of order" if trace.out_of_order else ""),
        "top_prefixes": top_prefixes(trace, block_tokens),
    }
    # Infinite-cache bound: every block seen before is a hit.
    seen: set[int] = set()
    inf_hits: list[bool] = []
    for k in keys:
        inf_hits.append(k in seen)
        seen.add(k)
    out["infinite_cache_prefix_hit_ratio"] = prefix_hit_count(inf_hits, lengths) / n

    # Capacity: the smallest tested size reaching 90% of the infinite-cache ratio, within the byte budget.
    block_bytes = budgets.kv_bytes_per_token * block_tokens if budgets.kv_bytes_per_token else None
    max_blocks = distinct
    if budgets.capacity_bytes and block_bytes:
        max_blocks = max(1, min(distinct, budgets.capacity_bytes // block_bytes))

    pcts = (1, 2, 5, 10, 20, 30, 50, 100)
    lru_curve = LRUCurve(keys, lengths)
    curve: list[dict[str, Any]] = []
    for pct in pcts:
        cap = max(1, round(distinct * pct / 100))
        if cap > max_blocks:
            cap = max_blocks
        by_policy: dict[str, float] = {}
        for spec in specs:
            ph, _ = hit_ratio_at(trace, cap, spec)
            by_policy[str(spec)] = ph / n
            if progress:
                progress()
        curve.append({"capacity_blocks": cap, "lru_prefix_hit_ratio": lru_curve.prefix_hit_ratio(cap),
                      "by_policy": by_policy})
        if cap == max_blocks:
            break
    # A policy that wins at one size but falls below LRU at another learned this trace, not the workload: advice
    # must hold on the traffic the user has not replayed yet, so only policies that stay within the floor of LRU
    # at every measured size are recommended (all of them if none does).
    names = [str(s) for s in specs]
    holds = [name for name in names
             if all(p["by_policy"][name] >= p["lru_prefix_hit_ratio"] - LRU_FLOOR for p in curve)] or names
    out["policies_below_lru"] = [name for name in names if name not in holds]
    for point in curve:
        by_policy = point["by_policy"]
        best = max(holds, key=lambda name: (by_policy[name], -names.index(name)))
        point["policy"], point["prefix_hit_ratio"] = best, by_policy[best]
    goal = 0.9 * out["infinite_cache_prefix_hit_ratio"]
    pick = next((p for p in curve if p["prefix_hit_ratio"] >= goal), curve[-1])
    out["capacity_curve"] = curve
    out["recommended_capacity_blocks"] = pick["capacity_blocks"]
    out["recommended_policy"] = pick["policy"]
    best_spec = next(s for s in specs if str(s) == pick["policy"])
    out["recommended_capacity_reason"] = (
        f"smallest tested capacity where the best policy ({pick['policy']}) reaches 90% of the infinite-cache "
        f"prefix hit ratio"
        if pick["prefix_hit_ratio"] >= goal else
        "the budget caps the capacity below 90% of the infinite-cache ratio; this is the largest that fits")
    out["recommended_capacity_bytes"] = pick["capacity_blocks"] * block_bytes if block_bytes else None

    # Chunk size: larger chunks amortise the per-transfer latency but lose the partial chunk at each prefix end.
    chunks: list[dict[str, Any]] = []
    for k in (1, 2, 4, 8):
        hit_blocks, loaded_chunks = hit_ratio_at(trace, pick["capacity_blocks"], best_spec, k)
        row = {"chunk_tokens": k * block_tokens, "prefix_hit_ratio": hit_blocks / n,
               "estimated_prefill_seconds_saved": None}
        if block_bytes and budgets.bandwidth_gb_s and budgets.prefill_tokens_per_s:
            transfer = loaded_chunks * (budgets.transfer_latency_s + k * block_bytes / (budgets.bandwidth_gb_s * 1e9))
            row["estimated_prefill_seconds_saved"] = hit_blocks * block_tokens / budgets.prefill_tokens_per_s - transfer
        chunks.append(row)
        if progress:
            progress()
    out["chunk_sizes"] = chunks
    out["chunk_sizes_measured_at"] = {"capacity_blocks": pick["capacity_blocks"], "policy": pick["policy"]}
    if all(r["estimated_prefill_seconds_saved"] is not None for r in chunks):
        best_chunk = max(chunks, key=lambda r: r["estimated_prefill_seconds_saved"])
        reason = "largest estimated prefill time saved under the given bandwidth, latency and prefill rate"
    else:
        best_chunk = max(chunks, key=lambda r: r["prefix_hit_ratio"])
        reason = ("highest prefix hit ratio (give --model-kv-bytes-per-token, --bandwidth and "
                  "--prefill-tokens-per-s to weigh transfer cost)")
    out["recommended_chunk_tokens"] = best_chunk["chunk_tokens"]
    out["recommended_chunk_reason"] = reason
    if budgets.kv_bytes_per_token and budgets.bandwidth_gb_s and budgets.prefill_tokens_per_s:
        per_token_transfer = budgets.kv_bytes_per_token / (budgets.bandwidth_gb_s * 1e9)
        out["transfer_slower_than_recompute"] = per_token_transfer > 1 / budgets.prefill_tokens_per_s
    return out


def format_analysis(a: dict[str, Any]) -> str:
    lines = [
        f"requests {a['requests']}, block accesses {a['block_accesses']}, distinct blocks {a['distinct_blocks']}, "
        f"{a['block_tokens']} tokens/block",
        f"blocks never reused: {a['never_reused_fraction']:.1%}",
        f"infinite-cache prefix hit ratio: {a['infinite_cache_prefix_hit_ratio']:.4f}",
        "reuse distance (distinct blocks between uses; an LRU cache of C blocks hits below C): "
        + ", ".join(f"{k} {v}" for k, v in a["reuse_distance_blocks"].items()),
        "reuse time (ms): " + (", ".join(f"{k} {v:g}" for k, v in a["reuse_time_ms"].items())
                               or a.get("reuse_time_note") or "no reuse"),
        "most reused prefixes (by reusable tokens):",
    ]
    for p in a["top_prefixes"]:
        lines.append(f"  ends at block {p['block_id']}: {p['prefix_blocks']} blocks ({p['prefix_tokens']} tokens), "
                     f"{p['accesses']} accesses, {p['reused_tokens']} tokens reusable")
    lines.append("capacity curve (best policy at each size): " + ", ".join(
        f"{c['capacity_blocks']} blocks -> {c['prefix_hit_ratio']:.4f} ({c['policy']})" for c in a["capacity_curve"]))
    cap = f"recommended capacity: {a['recommended_capacity_blocks']} blocks"
    if a.get("recommended_capacity_bytes"):
        cap += f" ({a['recommended_capacity_bytes'] / 2**30:.2f} GiB)"
    lines.append(cap + f" -- {a['recommended_capacity_reason']}")
    if a.get("policies_below_lru"):
        lines.append("not recommended (more than " + f"{LRU_FLOOR} below LRU's prefix hit ratio at some measured size, "
                     "so unlikely to hold on traffic not replayed here): " + ", ".join(a["policies_below_lru"]))
    at = a["chunk_sizes_measured_at"]
    lines.append(f"chunk sizes, measured at {at['capacity_blocks']} blocks (the recommended capacity) with {at['policy']}:")
    for c in a["chunk_sizes"]:
        saved = c["estimated_prefill_seconds_saved"]
        lines.append(f"  chunk {c['chunk_tokens']} tokens: prefix hit ratio {c['prefix_hit_ratio']:.4f}"
                     + (f", est. prefill saved {saved:.1f} s" if saved is not None else ""))
    lines.append(f"recommended chunk size: {a['recommended_chunk_tokens']} tokens -- {a['recommended_chunk_reason']}")
    if a.get("transfer_slower_than_recompute"):
        lines.append("WARNING: at this bandwidth, loading KV is slower than recomputing it; tiering will not pay off")
    return "\n".join(lines)
