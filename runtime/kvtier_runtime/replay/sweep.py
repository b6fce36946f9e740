"""``--sweep``: prefix hit ratio against capacity, one line per policy plus OPT, as a table and a PNG plot."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .engine import PolicySpec, replay_single
from .metrics import flatten, prefix_hit_count
from .opt import opt_hits
from .trace import Trace

DEFAULT_PERCENTS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0)


def sweep(trace: Trace, capacities: Sequence[int], specs: Sequence[PolicySpec], show_progress: bool = True) -> dict:
    """Prefix hit ratios of every policy and OPT at every capacity (blocks)."""
    from tqdm import tqdm

    keys, lengths = flatten(trace.requests)
    n = len(keys)
    series: dict[str, list[float]] = {str(s): [] for s in specs}
    series["OPT"] = []
    with tqdm(total=len(capacities) * (len(specs) + 1), desc="replay sweep", unit="run",
              disable=not show_progress) as bar:
        for cap in capacities:
            for spec in specs:
                hits, _ = replay_single(trace.requests, spec.build(cap))
                series[str(spec)].append(prefix_hit_count(hits, lengths) / n)
                bar.update()
            series["OPT"].append(prefix_hit_count(opt_hits(keys, cap), lengths) / n)
            bar.update()
    return {"capacities_blocks": list(capacities), "prefix_hit_ratio": series}


def plot(result: dict, out: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = result["capacities_blocks"]
    for name, values in result["prefix_hit_ratio"].items():
        style = {"color": "black", "linestyle": "--"} if name == "OPT" else {}
        ax.plot(caps, values, marker="o", label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def format_sweep(result: dict) -> str:
    names = list(result["prefix_hit_ratio"])
    width = max(10, *(len(n) for n in names))
    lines = ["capacity  " + "  ".join(f"{n:>{width}}" for n in names)]
    for i, cap in enumerate(result["capacities_blocks"]):
        lines.append(f"{cap:>8}  " + "  ".join(f"{result['prefix_hit_ratio'][n][i]:>{width}.4f}" for n in names))
    return "\n".join(lines)
