"""What the benchmarks share for their tables: a robust summary of repeated measurements."""
from __future__ import annotations

import statistics


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) of ``xs``."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[1], q[0], q[2]
