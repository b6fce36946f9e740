"""``--sweep``: prefix hit ratio against capacity, one line per policy plus OPT and the infinite-cache ceiling, as a
table and a plot; each policy's capacity equivalence (the LRU capacity loading as many blocks) beside it."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine import PolicySpec, replay_single
from .lru_curve import LRUCurve
from .metrics import flatten, prefix_hit_count
from .opt import opt_hits
from .trace import Trace

DEFAULT_PERCENTS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0)


def sweep(trace: Trace, capacities: Sequence[int], specs: Sequence[PolicySpec], show_progress: bool = True) -> dict[str, Any]:
    """Prefix hit ratios of every policy and OPT at every capacity (blocks)."""
    from tqdm import tqdm

    keys, lengths = flatten(trace.requests)
    n = len(keys)
    series: dict[str, list[float]] = {str(s): [] for s in specs}
    series["OPT"] = []
    factors: dict[str, list[float]] = {str(s): [] for s in specs}
    curve = LRUCurve(keys, lengths)
    with tqdm(total=len(capacities) * (len(specs) + 1), desc="replay sweep", unit="run",
              disable=not show_progress) as bar:
        for cap in capacities:
            for spec in specs:
                hits, _ = replay_single(trace.requests, spec.build(cap))
                ph = prefix_hit_count(hits, lengths)
                series[str(spec)].append(ph / n)
                factors[str(spec)].append(curve.capacity_for(ph) / cap)
                bar.update()
            series["OPT"].append(prefix_hit_count(opt_hits(keys, cap), lengths) / n)
            bar.update()
    return {"capacities_blocks": list(capacities), "prefix_hit_ratio": series,
            "infinite_cache_prefix_hit_ratio": curve.prefix_hit_ratio(curve.n_distinct),
            "memory_factor_vs_lru": factors}


def plot(result: dict[str, Any], out: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = result["capacities_blocks"]
    for name, values in result["prefix_hit_ratio"].items():
        if name == "OPT":
            ax.plot(caps, values, marker="o", label=name, color="black", linestyle="--")
        else:
            ax.plot(caps, values, marker="o", label=name)
    ax.axhline(result["infinite_cache_prefix_hit_ratio"], color="grey", linestyle=":",
               label=f"infinite cache ({result['infinite_cache_prefix_hit_ratio']:.4f})")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def format_sweep(result: dict[str, Any]) -> str:
    names = list(result["prefix_hit_ratio"])
    width = max(10, *(len(n) for n in names))
    lines = ["capacity  " + "  ".join(f"{n:>{width}}" for n in names)]
    for i, cap in enumerate(result["capacities_blocks"]):
        lines.append(f"{cap:>8}  " + "  ".join(f"{result['prefix_hit_ratio'][n][i]:>{width}.4f}" for n in names))
    lines.append(f"infinite cache: {result['infinite_cache_prefix_hit_ratio']:.4f}")
    factors = result["memory_factor_vs_lru"]
    lines.append("capacity equivalence (LRU capacity loading as many blocks / capacity; 1.25 = worth 1.25x the memory):")
    lines.append("capacity  " + "  ".join(f"{n:>{width}}" for n in factors))
    for i, cap in enumerate(result["capacities_blocks"]):
        lines.append(f"{cap:>8}  " + "  ".join(f"{factors[n][i]:>{width}.2f}" for n in factors))
    return "\n".join(lines)
