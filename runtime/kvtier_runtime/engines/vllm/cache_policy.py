"""vLLM ``CachePolicy`` plug-in: kvtier's eviction and admission policies for vLLM's own CPU tier.

Loaded by ``CachePolicyFactory`` as ``getattr(import_module(cache_policy_module_path), eviction_policy)``: one
``Kvtier<Eviction><Admission>CachePolicy`` class per policy pair, and classes carrying a threshold made on first use
(the module ``__getattr__``)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from ...config import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_THRESHOLD,
    EVICTION_POLICIES,
    VLLM_ADAPTER_MODULE,
    CachePolicyChoice,
    vllm_cache_policy_class,
)
from ...policies import AccessContext, EvictionPolicy, get_policy

# ---------------------------------------------------------------------------------------------------------------
# CachePolicy: kvtier's eviction and admission policies for vLLM's CPU tier
# ---------------------------------------------------------------------------------------------------------------


def access_context(key: OffloadKey, req_context: ReqContext | None) -> AccessContext | None:
    """vLLM's request context as the runtime's: the key's end-token position orders a request's chunks."""
    if req_context is None:
        return None
    position = req_context.get_offload_key_position(key)
    if position is None:  # no place in a request's prefix known: an access outside any request's order
        return AccessContext(request_id=None, position=0)
    return AccessContext(request_id=req_context.req_id, position=position)


class KvtierCachePolicy(CachePolicy):
    """A runtime :class:`EvictionPolicy` behind vLLM's ``CachePolicy`` contract.

    vLLM's CPU manager owns the chunk slots; the policy only orders entries and picks victims. Mapping:

    * one chunk = one unit of the policy's byte accounting (capacity = ``cache_capacity`` chunks), so the
      manager's free-slot arithmetic and the policy's agree exactly;
    * ``ChunkStatus.ref_cnt`` -1 (store in flight) or > 0 (transfers reading it) = pinned in the policy;
      ``mark_evictable``/``mark_non_evictable`` (vLLM calls them on 0 transitions) unpin/pin;
    * ``evict(n, protected)`` = the policy's atomic ``evict`` (``None`` and no change when impossible);
    * a reuse is the first access of a ready chunk in a request (``on_request_access``), or ``touch``.

    Admission: vLLM's ``insert`` cannot refuse a store (the slot is already allocated and the GPU->CPU copy
    queued). So a chunk the admission filter declines is kept in a *probation* FIFO that is always evicted
    before any admitted chunk; it joins the policy if it is reused while still resident. A one-off chunk thus
    never displaces a chunk the filter admitted.
    """

    eviction: ClassVar[str] = "lru"
    admission: ClassVar[str] = "none"
    admission_threshold: ClassVar[int] = DEFAULT_ADMISSION_THRESHOLD

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: EvictionPolicy = get_policy(
            self.eviction, max(1, int(cache_capacity)), admission=None if self.admission == "none" else self.admission,
            admission_threshold=self.admission_threshold,
        )
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        # vLLM's lru contract (request ranks, see policies/lru.py) for policies that implement it.
        self._request_aware = self.policy.request_aware
        # Only policies that read the request context get one: building it per access is pure overhead on vLLM's
        # scheduler thread for the others. vLLM's ReqContext carries the request id and each key's end-token
        # position, not the request's length, so adaptive runs here without its prompt-tail class.
        self._uses_context = self.policy.uses_context or self._request_aware

    # ---- lookups ------------------------------------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def probation_size(self) -> int:
        return len(self._probation)

    # ---- insert / remove ----------------------------------------------------------------------------------
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        if key in self._chunks:  # not done by vLLM 0.33; keep the entry's place, adopt the new status
            self._chunks[key] = chunk
            self._sync_pin(key)
            return
        ctx = access_context(key, req_context) if self._uses_context else None
        self._chunks[key] = chunk
        policy = self.policy
        if policy.admission is None or policy.admit(key, 1, ctx):
            self._enter_policy(key, ctx)
            if chunk.ref_cnt != 0:  # -1: vLLM inserts before the GPU->CPU copy is done
                policy.pin(key)
        else:
            self._probation[key] = None

    def remove(self, key: OffloadKey) -> None:
        del self._chunks[key]
        if key in self._probation:
            del self._probation[key]
            return
        if self.policy.is_pinned(key):
            self.policy.unpin(key)
        self.policy.remove(key)

    def _enter_policy(self, key: OffloadKey, ctx: AccessContext | None) -> None:
        evicted = self.policy.insert(key, 1, ctx)
        if evicted:  # the manager evicts before it inserts; the policy must never need to make room itself
            raise AssertionError(f"policy evicted {len(evicted)} chunks on insert; vLLM's slot accounting broke")
        if evicted is None:
            raise AssertionError("policy refused an insert although vLLM allocated a slot for it")

    def _sync_pin(self, key: OffloadKey) -> None:
        if key not in self.policy:
            return
        evictable = self._chunks[key].ref_cnt == 0
        pinned = self.policy.is_pinned(key)
        if evictable and pinned:
            self.policy.unpin(key)
        elif not evictable and not pinned:
            self.policy.pin(key)

    # ---- accesses -----------------------------------------------------------------------------------------
    def _reuse(self, key: OffloadKey, req_context: ReqContext | None) -> None:
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.is_ready:
            return  # a chunk whose store is still in flight was not reused
        ctx = access_context(key, req_context) if self._uses_context else None
        if key in self._probation:
            del self._probation[key]  # reused while on probation: the filter's second chance
            self._enter_policy(key, ctx)
            self._sync_pin(key)
        else:
            self.policy.touch(key, ctx)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # A use outside any request's order (vLLM's lru: the head ends up the most recent).
        for key in reversed(list(keys)):
            if self._request_aware and key in self.policy:
                self.policy.touch(key, None)
            else:
                self._reuse(key, None)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        return  # the keys are not resident yet; insert() sees them (and asks the admission filter)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM passes each key once per request, in the order the request observed it (head to tail).
        if self._request_aware:  # vLLM's lru: the request's rank, tail before head, in flight or not
            for key in keys:
                if key in self.policy:
                    self.policy.touch(key, access_context(key, req_context))
            return
        for key in keys:
            self._reuse(key, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        if not self._request_aware:
            return  # every reuse was recorded when first observed (on_request_access); counting again would double it
        # vLLM's lru: the finished request's chunks become the most recent, head most of all.
        keys = [k for group in key_groups for k in group]
        positions = {k: p for k in keys if (p := req_context.get_offload_key_position(k)) is not None}
        if len(positions) == len(keys):
            keys.sort(key=positions.__getitem__)
        for key in reversed(keys):
            if key in self.policy:
                self.policy.touch(key, None)
        self.policy.forget_request(req_context.req_id)  # type: ignore[attr-defined]

    # ---- eviction -----------------------------------------------------------------------------------------
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        chunks = self._chunks
        from_probation: list[OffloadKey] = []
        for key in self._probation:
            if len(from_probation) == n:
                break
            if chunks[key].ref_cnt == 0 and key not in protected:
                from_probation.append(key)
        rest = n - len(from_probation)
        victims: list[OffloadKey] = []
        if rest:
            found = self.policy.evict(rest, protected)
            if found is None:
                return None  # atomic: the probation FIFO was only read
            victims = found
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in from_probation:
            del self._probation[key]
            out.append((key, chunks.pop(key)))
        for key in victims:
            chunk = chunks.pop(key)
            assert chunk.ref_cnt == 0, f"evicted chunk {key!r} has ref_cnt {chunk.ref_cnt}"
            out.append((key, chunk))
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        policy = self.policy
        if policy.is_pinned(key):  # False for probation chunks: their ref_cnt is read directly
            policy.unpin(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key in self.policy and not self.policy.is_pinned(key):
            self.policy.pin(key)

    def clear(self) -> None:
        self._chunks.clear()
        self._probation.clear()
        self.policy.clear()


# The classes name the module path vLLM loads them from (the adapter, which re-exports them), so pickling and
# ``cls.__module__`` resolve to where users' configs point.
def _make_policy_classes() -> dict[str, type[KvtierCachePolicy]]:
    classes: dict[str, type[KvtierCachePolicy]] = {}
    for eviction in EVICTION_POLICIES:
        for admission in ADMISSION_POLICIES:
            name = vllm_cache_policy_class(eviction, admission)
            classes[name] = type(
                name,
                (KvtierCachePolicy,),
                {
                    "eviction": eviction,
                    "admission": admission,
                    "__module__": VLLM_ADAPTER_MODULE,
                    "__qualname__": name,
                    "__doc__": f"kvtier's {eviction} eviction with {admission} admission as a vLLM CachePolicy.",
                },
            )
    return classes


CACHE_POLICY_CLASSES: dict[str, type[KvtierCachePolicy]] = _make_policy_classes()
# CachePolicyFactory resolves ``getattr(import_module(cache_policy_module_path), eviction_policy)``.
globals().update(CACHE_POLICY_CLASSES)


def __getattr__(name: str) -> type[KvtierCachePolicy]:
    """Classes whose name carries a threshold (``KvtierLRUThreshold5CachePolicy``), made on first use."""
    try:
        choice = CachePolicyChoice.from_class_name(name)
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    cls = type(name, (KvtierCachePolicy,), {
        "eviction": choice.eviction, "admission": choice.admission,
        "admission_threshold": choice.admission_threshold, "__module__": VLLM_ADAPTER_MODULE, "__qualname__": name,
        "__doc__": f"kvtier's {choice.eviction} eviction, storing on offer {choice.admission_threshold}."})
    globals()[name] = cls
    return cls
