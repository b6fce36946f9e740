"""Times as status stores them (RFC 3339, UTC): written by the SLO guard, read by the guard and by the reconcile.
Below both, so neither imports the other for them."""
from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

__all__ = ["format_time", "is_time", "parse_time"]


def format_time(epoch: float) -> str:
    """RFC 3339 in UTC with milliseconds, as Kubernetes status fields are read by people.

    Rounded up to the millisecond, never down: every period the guard times from a stored start (a stage's
    observation, cooldown, probation) must last at least its full length, and a start truncated by up to 1 ms
    would end it up to 1 ms early. (Rounded to the microsecond first, so 1.001 s stays 1.001 s.)
    """
    ms = math.ceil(round(epoch * 1000, 3))
    when = datetime.fromtimestamp(ms // 1000, tz=UTC) + timedelta(milliseconds=ms % 1000)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 time (None for None); ValueError when it is not one."""
    if text is None:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def is_time(value: Any) -> bool:
    """Whether ``value`` is an RFC 3339 time :func:`parse_time` reads."""
    try:
        return isinstance(value, str) and parse_time(value) is not None
    except ValueError:
        return False
