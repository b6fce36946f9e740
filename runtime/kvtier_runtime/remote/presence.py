"""What the remote tier knows of keys in the store without asking it: a bounded cache of presence answers (a key
held, or absent and why), and the keys whose presence probe is queued. The scheduler thread reads it; the probe
and I/O threads write it."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from ..tiers.base import KeyState

__all__ = ["PresenceCache"]


class PresenceCache:
    """key -> (present, until, why absent), at most ``entries`` (the least recently answered dropped first). A
    present key is trusted for ``present_ttl_s``, an absent one for ``absent_ttl_s`` (another replica may write it
    any time); a queued probe is waited for ``probe_patience_s``, then the key counts as unknown again."""

    def __init__(self, *, present_ttl_s: float, absent_ttl_s: float, entries: int, probe_patience_s: float,
                 clock: Callable[[], float]) -> None:
        self._present_ttl_s = present_ttl_s
        self._absent_ttl_s = absent_ttl_s
        self._entries = entries
        self._patience_s = probe_patience_s
        self._clock = clock
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, tuple[bool, float, str]] = OrderedDict()
        self._probing: dict[bytes, float] = {}

    def remember(self, key: bytes, present: bool, reason: str = "absent") -> None:
        ttl = self._present_ttl_s if present else self._absent_ttl_s
        with self._lock:
            self._known[key] = (present, self._clock() + ttl, reason)
            self._known.move_to_end(key)
            while len(self._known) > self._entries:
                self._known.popitem(last=False)

    def known_present(self, key: bytes) -> bool:
        with self._lock:
            entry = self._known.get(key)
        return entry is not None and entry[0] and self._clock() < entry[1]

    def lookup(self, key: bytes) -> tuple[KeyState, str] | None:
        """``(HIT, "")`` or ``(MISS, why absent)`` while an answer is fresh, ``(PENDING, "")`` while a probe is queued,
        None for a key it knows nothing of (a stale answer, or a probe stuck behind a slow store, is forgotten)."""
        now = self._clock()
        with self._lock:
            entry = self._known.get(key)
            if entry is not None:
                present, expires, reason = entry
                if now < expires:
                    return (KeyState.HIT, "") if present else (KeyState.MISS, reason)
                del self._known[key]
            queued = self._probing.get(key)
            if queued is not None:
                if now - queued <= self._patience_s:
                    return KeyState.PENDING, ""
                del self._probing[key]
        return None

    def probing(self, key: bytes) -> None:
        """A probe of ``key`` is queued: lookups answer PENDING until it is answered."""
        with self._lock:
            self._probing[key] = self._clock()

    def probed(self, key: bytes) -> None:
        with self._lock:
            self._probing.pop(key, None)
