"""What entered and left the remote tier, for the KV cache events the engine publishes (``Tier.take_changes``).

Recorded only once the engine asks (``record``): the batches note the chunks this tier's trims deleted and the
chunks a load found gone (the store evicted them, or another replica's trim did); the books announce this tier's
own writes from its finished store jobs. Bounded: at most ``max_keys`` keys wait for the next take (the engine
takes them every scheduler step); beyond that the oldest are dropped and counted."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from ..tiers.base import TierChanges

__all__ = ["Changes"]

# Keys waiting for the engine's next take: a bound, not a tuning knob (the engine takes them every step).
MAX_PENDING_KEYS = 1 << 16


class Changes:
    """Keys that entered and left the tier since the last :meth:`take` (thread-safe: worker threads note them,
    the scheduler thread takes them)."""

    def __init__(self, max_keys: int = MAX_PENDING_KEYS) -> None:
        self._lock = threading.Lock()
        self._recording = False
        self._pending: deque[tuple[bytes, bool]] = deque()  # (key, held) in the order they happened
        self._max = max_keys
        self.dropped = 0

    def record(self) -> None:
        with self._lock:
            self._recording = True

    @property
    def recording(self) -> bool:
        return self._recording

    def stored(self, keys: Iterable[bytes]) -> None:
        self._note(keys, True)

    def removed(self, keys: Iterable[bytes]) -> None:
        self._note(keys, False)

    def _note(self, keys: Iterable[bytes], held: bool) -> None:
        if not self._recording:
            return
        with self._lock:
            self._pending.extend((bytes(k), held) for k in keys)
            while len(self._pending) > self._max:
                self._pending.popleft()
                self.dropped += 1

    def take(self) -> TierChanges:
        """Each key once, as its last change left it."""
        with self._lock:
            last = dict(self._pending)
            self._pending.clear()
        return TierChanges([k for k, held in last.items() if held], [k for k, held in last.items() if not held])
