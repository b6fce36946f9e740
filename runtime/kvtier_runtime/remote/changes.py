"""What entered and left the remote tier, for the KV cache events the engine publishes (``Tier.take_changes``).

A store every replica of the model shares is the shared tier of each of them: a router's index should score a chunk
there for every replica that can load it, not only for the one that wrote it. So while the engine publishes events
(``record``), the tier keeps a shared log in the store, a capped stream beside the capacity index
(``kvtier:<scope>:<identity>:changes``: one entry per batch, ``s`` = the chunk keys written, ``r`` = those a trim
deleted or a load found gone), appends its own writes and removals to it, and reads every replica's on a thread of
its own every :data:`POLL_S`. A replica that starts reading takes the index's current members as stored first (the
store's chunks written before it came). What it reads becomes this tier's changes: another replica's write is a chunk
this replica can load too. Its own writes come back from the log as well (the books announce each chunk once).

Bounded: at most :data:`MAX_PENDING_KEYS` keys wait for the engine's next take (the engine takes them every
scheduler step; beyond that the oldest are dropped and counted); the stream keeps about :data:`LOG_ENTRIES` entries
(``XADD MAXLEN ~``), each poll reads at most :data:`POLL_PAGES` pages of :data:`PAGE_ENTRIES`; a replica that falls
further behind misses what scrolled off (its index then lacks those chunks: a router under-scores, never
over-scores). A store that refuses the log's commands (an ACL without them: docs/remote.md) leaves the events of the
replica's own writes and removals; the refusal is logged once.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..tiers.base import TierChanges
from .client import RemoteStore

__all__ = ["Changes", "SharedLog"]

log = logging.getLogger("kvtier_runtime.remote")

# Keys waiting for the engine's next take: a bound, not a tuning knob (the engine takes them every step).
MAX_PENDING_KEYS = 1 << 16
# The shared log: how often a replica reads it, how much the store keeps, how much one poll reads.
POLL_S = 0.5
LOG_ENTRIES = 4096
PAGE_ENTRIES = 512
POLL_PAGES = 8
STORED, REMOVED = b"s", b"r"


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


def log_key(prefix: bytes) -> bytes:
    """The shared log's stream (beside the capacity index; no chunk key is spelled so: chunk keys are hex)."""
    return prefix + b"changes"


class SharedLog:
    """The scope's shared log of chunks written and removed (see the module's doc), for one tier: appended to by
    the tier's batches once :meth:`start` ran, read by a thread of its own into ``changes``."""

    def __init__(self, *, name: str, store: RemoteStore, prefix: bytes, index_key: bytes, max_index: int,
                 changes: Changes, available: Callable[[], bool]) -> None:
        self.name = name
        self.key = log_key(prefix)
        self._store = store
        self._index_key = index_key
        self._max_index = max_index
        self._changes = changes
        self._available = available
        self._last: bytes | None = None  # the id of the last entry read (None: not caught up with the index yet)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused = False
        self.polls = 0

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kvtier-{self.name}-log", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- appending (the tier's batch threads) --------------------------------------------------------------
    def entry(self, op: bytes, keys: Sequence[bytes]) -> tuple[bytes, dict[bytes, bytes]]:
        """The stream and the fields of one entry: ``op`` and the keys, hex, space-separated."""
        return self.key, {b"op": op, b"keys": b" ".join(bytes(k).hex().encode() for k in keys)}

    def command(self, op: bytes, keys: Sequence[bytes]) -> tuple[bytes | str, ...]:
        """:meth:`add` as one raw command (for the tier's own store connections; its reply as :meth:`add`'s)."""
        key, fields = self.entry(op, keys)
        return ("XADD", key, "MAXLEN", "~", str(LOG_ENTRIES), "*", *(x for kv in fields.items() for x in kv))

    def add(self, pipe: Any, op: bytes, keys: Sequence[bytes]) -> None:
        """Add the entry for ``keys`` to ``pipe`` (its reply is the entry's id, or an error to ignore)."""
        key, fields = self.entry(op, keys)
        pipe.xadd(key, fields, maxlen=LOG_ENTRIES, approximate=True)

    def append(self, op: bytes, keys: Sequence[bytes]) -> None:
        """One entry now, on the caller's thread (a trim's or a load's removals); a fault is only logged."""
        if not self.active or not keys:
            return
        try:
            key, fields = self.entry(op, keys)
            self._store.connect().xadd(key, fields, maxlen=LOG_ENTRIES, approximate=True)
        except Exception as exc:
            self.refused(exc)

    def refused(self, exc: object) -> None:
        if not self._refused:
            self._refused = True
            log.warning("kvtier remote tier %s: the shared log of chunks (%s) failed (%s): other replicas' "
                        "writes are not announced by this one", self.name, self.key.decode(errors="replace"), exc)

    # ---- reading (its own thread) ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self._available():
                continue
            try:
                self.poll()
            except Exception as exc:  # the store went away: the next poll retries
                log.debug("kvtier remote tier %s: reading the shared log failed (%s)", self.name, exc)

    def poll(self) -> None:
        """Read what the log gained since the last poll into ``changes`` (the first time: the index's members)."""
        client = self._store.connect()
        self.polls += 1
        if self._last is None:
            newest = client.xrevrange(self.key, count=1)
            members = client.zrange(self._index_key, 0, self._max_index - 1)
            self._changes.stored([bytes.fromhex(bytes(m).decode()) for m in members if _is_hex(m)])
            self._last = bytes(newest[0][0]) if newest else b"0-0"
        for _ in range(POLL_PAGES):
            entries = client.xrange(self.key, min=b"(" + self._last, max=b"+", count=PAGE_ENTRIES)
            for entry_id, fields in entries:
                self._last = bytes(entry_id)
                self._read(fields)
            if len(entries) < PAGE_ENTRIES:
                return

    def _read(self, fields: dict[Any, Any]) -> None:
        op, keys = fields.get(b"op"), fields.get(b"keys") or b""
        parsed = [bytes.fromhex(k.decode()) for k in bytes(keys).split() if _is_hex(k)]
        if op == STORED:
            self._changes.stored(parsed)
        elif op == REMOVED:
            self._changes.removed(parsed)


def _is_hex(member: Any) -> bool:
    value = bytes(member)
    return bool(value) and len(value) % 2 == 0 and all(c in b"0123456789abcdef" for c in value)
