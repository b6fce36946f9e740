"""What the books (:class:`kvtier_runtime.store.books.OffloadBooks`) need of a tier behind the host tier, whatever
its medium: :class:`KeyState` and the :class:`Tier` protocol. Pure: no torch at import."""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..policies import AccessContext
    from .jobs import JobResult

__all__ = ["EventPlace", "KeyState", "ReplayPolicy", "Tier", "TierChanges"]


class KeyState(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # not settled yet (a store in flight, or a presence probe): ask again later


class ReplayPolicy(NamedTuple):
    """How ``kvtier replay`` models a tier: its eviction policy and admission filter, and whether every replica of
    the model shares it (a remote store) or each has its own."""

    eviction_policy: str
    admission: str
    shared: bool


class EventPlace(NamedTuple):
    """Where the KV cache events an engine publishes (vLLM's ``BlockStored``/``BlockRemoved``) place a tier's chunks,
    so that a router's index (llm-d's KV-block index) scores them for this replica: ``medium`` (vLLM's medium name:
    ``STORAGE`` for every tier behind the host tier; the index weights blocks by it), ``locality`` (``LOCAL``: this
    replica's own; ``REMOTE``: a store every replica of the model reads) and ``owner`` (the tier's kind and, for a
    shared tier, its scope: vLLM's ``ownership``, prefixed by the books with the tier's place in the lookup
    order)."""

    medium: str
    locality: str
    owner: str


class TierChanges(NamedTuple):
    """What changed in a tier since the last :meth:`Tier.take_changes`: keys that entered it other than through
    this engine's own stores (a shared store: another replica's writes) and keys that left it (evicted, corrupt,
    trimmed, dropped by the store or another replica)."""

    stored: list[bytes]
    removed: list[bytes]


@runtime_checkable
class Tier(Protocol):
    """A tier behind the host tier: it stores host rows and loads them back into host rows, by jobs that never
    block the caller, and answers lookups from what it knows without I/O.

    The books decide nothing by a tier's class or place: each question below is answered by the tier."""

    name: str
    # The tier blocks move to and from (the host tier's name), for the tier's promotion/demotion metrics.
    peer: str
    # What the tier is: "filesystem", "remote" (log lines, the registry that builds tiers from a spec).
    medium: str
    # What the books call a chunk promoted from this tier (:meth:`OffloadBooks.served_by`), and the family of their
    # counters it is counted in: "disk" or "remote".
    origin: str
    # Whether the tier scopes keys to the model itself (a remote store key carries the model identity): the books
    # then hand it raw offload keys, else offload keys with their run-identity suffix.
    scoped_keys: bool
    # Whether the tier logs its own failed loads (the books then do not: an evicted shared chunk is no incident).
    logs_load_faults: bool

    @property
    def io_timeout_s(self) -> float:
        """How long a promotion may take before the books treat its key as missed."""
        ...

    @property
    def address(self) -> str:
        """Where its data lives: a directory, a store's url (how metrics named a tier before tiers had names)."""
        ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity_blocks(self) -> int:
        """Rows of the nominal size (its codec's, its value's) the tier holds when full."""
        ...

    @property
    def evictions(self) -> int:
        """Entries it evicted so far (its own trims: a filesystem tier's policy, a remote tier's index)."""
        ...

    @property
    def replay_policy(self) -> ReplayPolicy: ...

    @property
    def event_place(self) -> EventPlace:
        """How the engine's KV cache events describe this tier's chunks."""
        ...

    def record_changes(self) -> None:
        """From now on remember what enters and leaves the tier (:meth:`take_changes`): the engine publishes KV
        cache events. Until then a tier keeps no such record."""
        ...

    def take_changes(self) -> TierChanges:
        """What changed since the last call (empty until :meth:`record_changes` was called). Never does I/O."""
        ...

    def gauges(self) -> Mapping[str, float]:
        """Its state beyond its bytes, by kind, as the engine exports it (``kvtier_runtime.engines.metric_defs``
        ``TIER_GAUGES``): e.g. ``backoff`` (1 while refusing stores after repeated faults), ``up`` (1 while its
        store answers)."""
        ...

    def reasons(self) -> Mapping[str, Mapping[str, int]]:
        """Counts by kind and reason it keeps itself, as the engine exports them (``TIER_REASONS``): e.g. a remote
        tier's ``misses`` and ``store_failures`` by reason. Totals since the start, never reset."""
        ...

    def state(self, key: bytes) -> KeyState:
        """Where ``key`` is, without I/O and without counting a lookup (a caller that asks again and again)."""
        ...

    def probe(self, key: bytes) -> KeyState:
        """Where ``key`` is, for a lookup of the engine's (counted in the tier's lookups and hits), without I/O:
        HIT (a load may start now), PENDING (the answer is being fetched: ask again next step), MISS."""
        ...

    def needs_store(self, key: bytes) -> bool:
        """Whether a write-through of ``key`` is worth queuing (the tier does not know it held or being written)."""
        ...

    def covers(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` firmly enough that the host tier need not store it (a lookup promotes it
        from here instead). A tier whose knowledge is a hint (a shared store another replica may evict) says no."""
        ...

    def submit_store(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                     ctx: AccessContext | None = None) -> int: ...

    def submit_load(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor],
                    ctx: AccessContext | None = None) -> int: ...

    def get_finished(self) -> list[JobResult]: ...

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (TimeoutError after ``timeout`` seconds; None: each job's own
        deadline bounds it)."""
        ...

    def close(self) -> None: ...
