"""vLLM's KV-event stream as a router's index reads it, for tests that compare what the index believes with what
the engine then served.

:class:`EventStream` binds a ZMQ SUB socket that vLLM's publisher connects to (``--kv-events-config`` with a
``tcp://127.0.0.1:PORT`` endpoint) and decodes every batch with vLLM's own msgspec types, in arrival order, with
the time the engine's scheduler made it (vLLM stamps each batch with ``time.time()`` at the end of its step): a test
on the same machine asks for the events published before a moment of its own (:meth:`EventStream.before`), as the
index held them when a request reached the engine, however late the stream delivered them.

:class:`TierIndex` is a model of llm-d's KV-block index (llm-d-kv-cache v0.9.0: ``pkg/kvevents/pool.go`` and
``pkg/kvcache/kvblock/in_memory.go``) for one pod, kept to what these tests need: request keys are prefix chains
of whole blocks of tokens; a ``BlockStored`` with tokens is re-keyed from them, its parent resolved through the
engine-key map; one without tokens (vLLM's placeholder for an offloaded chunk) adds its medium to the request keys
its engine keys already map to; a ``BlockRemoved`` drops one medium, and an engine key's mapping goes once no medium
holds its request keys. :meth:`TierIndex.predict` then says, for a prompt, which tier a router would expect to
serve each block: the device prefix, then each chunk from the host tier (CPU) or a storage tier (STORAGE), up to
the first block no tier holds -- the order vLLM and kvtier look them up in.

Imports vLLM (its event types) and pyzmq lazily: only the engine env has them.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
# What a router's prediction calls each medium, as the engine's tiers are named in these tests (device = vLLM's
# prefix cache).
TIER_OF = {GPU: "device", CPU: "host", STORAGE: "disk"}


class EventStream:
    """vLLM's KV-event batches received on ``endpoint`` (bound here; the engine's publisher connects), decoded, in
    arrival order, collected on a thread, each with the engine's timestamp."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(endpoint)
        self.endpoint = endpoint
        self.topics: set[bytes] = set()
        self._batches: list[tuple[float, list[Any]]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                batch = self._decoder.decode(parts[-1])
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.topics.add(parts[0])
                self._batches.append((float(batch.ts), list(batch.events)))

    def events(self) -> list[Any]:
        with self._lock:
            return [e for _, events in self._batches for e in events]

    def batches(self) -> list[tuple[float, list[Any]]]:
        """(the engine's timestamp, the events) of every batch so far, in arrival order."""
        with self._lock:
            return list(self._batches)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


class TierIndex:
    """One pod's blocks as llm-d's index holds them (see the module's doc): request key -> mediums."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.mediums: dict[int, set[str]] = {}  # request key -> mediums holding it
        self.engine: dict[Any, list[int]] = {}  # engine key (vLLM's block hash) -> request keys
        self.dropped: Counter[str] = Counter()  # events the index could not place, by why

    def chain(self, tokens: Sequence[int], parent: int = 0) -> list[int]:
        """Request keys of the whole blocks of ``tokens`` after ``parent`` (0: the start of a prompt)."""
        keys, key, b = [], parent, self.block_tokens
        for i in range(0, len(tokens) - b + 1, b):
            key = hash((key, tuple(tokens[i:i + b])))
            keys.append(key)
        return keys

    def apply(self, events: Iterable[Any]) -> None:
        for event in events:
            kind = type(event).__name__
            medium = (getattr(event, "medium", None) or GPU).upper()
            if kind == "BlockStored":
                self._stored(event, medium)
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    self._removed(h, medium)
            elif kind == "AllBlocksCleared":
                self.mediums.clear()

    def _stored(self, event: Any, medium: str) -> None:
        hashes = list(event.block_hashes)
        if not event.token_ids:  # a placeholder: the request keys its engine keys already map to
            known = [rk for h in hashes for rk in self.engine.get(h, ())]
            if not known:
                self.dropped["unknown placeholder"] += 1
            for rk in known:
                self.mediums.setdefault(rk, set()).add(medium)
            return
        parent = 0
        if event.parent_block_hash is not None:
            parents = self.engine.get(event.parent_block_hash)
            if not parents:
                self.dropped["unknown parent"] += 1
                return
            parent = parents[-1]
        keys = self.chain(event.token_ids, parent)
        if not keys:
            self.dropped["no whole block"] += 1
            return
        n = max(len(hashes), len(keys))
        mapping: dict[Any, list[int]] = {}
        for i in range(n):  # llm-d's Add: 1:1, many:1 or 1:many by the ratio of the two lengths
            mapping.setdefault(hashes[i * len(hashes) // n], []).append(keys[i * len(keys) // n])
        self.engine.update(mapping)
        for rk in keys:
            self.mediums.setdefault(rk, set()).add(medium)

    def _removed(self, engine_key: Any, medium: str) -> None:
        rks = self.engine.get(engine_key)
        if not rks:
            return
        for rk in rks:
            held = self.mediums.get(rk)
            if held is not None:
                held.discard(medium)
                if not held:
                    del self.mediums[rk]
        if not any(rk in self.mediums for rk in rks):
            del self.engine[engine_key]

    def predict(self, prompt: Sequence[int], chunk_blocks: int = 1) -> Counter[str]:
        """Prompt tokens a router would expect each tier to serve (``device``, ``host``, ``disk``): the longest
        prefix of blocks on the device, then chunk by chunk (``chunk_blocks`` blocks, starting where the device
        prefix ends: these tests use chunks the device's block size) the host tier if it holds the chunk, else a
        storage tier, up to the first chunk neither holds. vLLM recomputes at least the prompt's last token, so a prompt of
        whole blocks never has its last block served."""
        keys = self.chain(prompt[:len(prompt) - 1])
        out: Counter[str] = Counter()
        i = 0
        while i < len(keys) and GPU in self.mediums.get(keys[i], ()):
            i += 1
        out["device"] = i * self.block_tokens
        while i + chunk_blocks <= len(keys):
            held = [self.mediums.get(k, set()) for k in keys[i:i + chunk_blocks]]
            if all(CPU in h for h in held):
                tier = "host"
            elif all(CPU in h or STORAGE in h for h in held):
                tier = "disk"
            else:
                break
            out[tier] += chunk_blocks * self.block_tokens
            i += chunk_blocks
        return out
