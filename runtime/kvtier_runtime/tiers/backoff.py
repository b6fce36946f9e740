"""Exponential backoff after repeated faults, shared by the filesystem tier (stores refused while a disk keeps
failing) and the remote tier (a store marked down until one reconnect is tried)."""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """Counts faults in a row: the ``after``-th one starts a pause of ``base_s``, each further one doubles it, up to
    ``max_s``; :meth:`success` resets the count (a pause under way runs out by itself). Not locked: the caller
    holds its own lock around :meth:`failure` and :meth:`success` when several threads report."""

    def __init__(self, base_s: float, max_s: float, *, after: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not base_s > 0 or not max_s >= base_s:
            raise ValueError(f"backoff: base_s={base_s} and max_s={max_s} must satisfy 0 < base_s <= max_s")
        if after < 1:
            raise ValueError(f"backoff: after={after} must be at least 1 (the fault that starts a pause)")
        self.base_s = float(base_s)
        self.max_s = float(max_s)
        self.after = int(after)
        self._clock = clock
        self.failures = 0  # faults in a row since the last success
        self.until = 0.0  # on the clock: the current pause ends then

    @property
    def active(self) -> bool:
        """Whether a pause is under way."""
        return self._clock() < self.until

    def failure(self, now: float | None = None) -> float | None:
        """One more fault in a row: the pause it starts (seconds), or None while fewer than ``after`` in a row."""
        self.failures += 1
        over = self.failures - self.after
        if over < 0:
            return None
        delay = min(self.max_s, self.base_s * (1 << min(over, 30)))
        self.until = (self._clock() if now is None else now) + delay
        return delay

    def success(self) -> None:
        self.failures = 0
