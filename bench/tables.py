"""What the benchmarks share for their tables: a robust summary of repeated measurements, and the check that a
table got rows."""
from __future__ import annotations

import statistics
from collections.abc import Sequence


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) of ``xs``."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[1], q[0], q[2]


def percentile(xs: Sequence[float], q: int) -> float:
    """The ``q``-th percentile of ``xs`` (1 <= q <= 99), interpolated between the samples around it."""
    if not 1 <= q <= 99:
        raise ValueError(f"q: {q!r} must be an integer from 1 to 99")
    if not xs:
        raise ValueError("xs: needs at least one sample")
    if len(xs) == 1:
        return float(xs[0])
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


SMOKE_HELP = "a tiny run (seconds): the bench still works and its table has rows; its figures mean nothing"


def require_rows(rows: int, table: str) -> None:
    """Fail the run (exit status 1) when ``table`` got no row: a bench that measured nothing must not pass for one
    that ran (``make check`` runs every bench at a tiny size, ``--smoke``, and relies on this)."""
    if rows < 1:
        raise SystemExit(f"{table}: no row was measured")
