"""What one evaluation measured: each reading is a number, "no data", or an error, never a silent default."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reading:
    """One query's outcome. ``value is None and error is None`` means the query answered with no series."""

    value: float | None = None
    error: str | None = None
    query: str = ""
    # What exactly failed (timeout, refused, too large, HTTP status), for tests and the operator's own log only:
    # ``error`` is what status shows, and it does not tell these apart (see slo.client.unavailable).
    detail: str = field(default="", compare=False)

    @classmethod
    def of(cls, value: float, query: str = "") -> Reading:
        return cls(value=float(value), query=query)

    @classmethod
    def empty(cls, query: str = "") -> Reading:
        return cls(query=query)

    @classmethod
    def failed(cls, error: str, query: str = "", detail: str = "") -> Reading:
        return cls(error=error, query=query, detail=detail)

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def is_empty(self) -> bool:
        return self.error is None and self.value is None

    @property
    def is_nan(self) -> bool:
        return self.value is not None and math.isnan(self.value)


@dataclass(frozen=True)
class Measurements:
    """The three readings one SLO evaluation needs."""

    ttft_p99: Reading
    itl_p99: Reading
    request_rate: Reading

    @classmethod
    def unreachable(cls, error: str) -> Measurements:
        failed = Reading.failed(error)
        return cls(failed, failed, failed)

    @classmethod
    def of(cls, ttft: float | None, itl: float | None, rate: float | None) -> Measurements:
        """Shorthand for tests and tools: ``None`` is "no data"."""

        def reading(v: float | None) -> Reading:
            return Reading.empty() if v is None else Reading.of(v)

        return cls(reading(ttft), reading(itl), reading(rate))
