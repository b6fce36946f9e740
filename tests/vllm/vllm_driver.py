"""Drives vLLM's real TieringOffloadingManager the way its scheduler-side connector does, on CPU.

The GPU worker's part (copying a chunk between GPU and the CPU tier) is played by writing/reading the CPU tier's
rows directly: that is the only piece of vLLM replaced here, because it needs a GPU.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# One KV block of one layer group: 16 tokens x 8 KiB. A chunk is one block (blocks_per_chunk=1).
BLOCK_BYTES = 16 * 1024


def offloading_config(
    engine_id: str,
    extra_config: dict[str, Any],
    *,
    model: str = "kvtier-test/model",
    kv_dtype: str = "bfloat16",
    block_bytes: int = BLOCK_BYTES,
) -> OffloadingConfig:
    """The normalized config vLLM builds from a VllmConfig (vllm.config needs a model on disk; this does not)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=kv_dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True,
        ),
    )


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


@dataclass
class Scheduler:
    """The scheduler-side call sequence of vLLM's OffloadingConnector against one manager."""

    spec: TieringOffloadingSpec
    manager: Any = None
    rows: np.ndarray = field(default=None)  # type: ignore[assignment]

    @classmethod
    def start(cls, engine_id: str, extra_config: dict[str, Any], **config_kw: Any) -> Scheduler:
        spec = TieringOffloadingSpec(offloading_config(engine_id, extra_config, **config_kw))
        sched = cls(spec)
        sched.manager = spec.get_manager()
        sched.rows = np.asarray(sched.manager.primary_tier.get_kv_memoryview())
        return sched

    @property
    def tiers(self) -> list[Any]:
        return self.manager.secondary_tiers

    def context(self, req_id: str | None = None) -> ReqContext:
        ctx = ReqContext(req_id=req_id or uuid.uuid4().hex)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no transfer between tiers is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                busy = self.manager.has_pending_work()
            if not busy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("tier transfers did not finish")
            time.sleep(0.002)

    def store(self, ctx: ReqContext, keys: list[bytes], payloads: dict[bytes, bytes]) -> list[bytes]:
        """GPU -> CPU store of ``keys`` (the worker's copy is a write into the CPU rows), then the cascade."""
        for pos, k in enumerate(keys):
            ctx.set_offload_key_position(k, (pos + 1) * 16)
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        if out is None:
            return []
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(cid)] = np.frombuffer(payloads[k], dtype=np.uint8)
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        return list(out.keys_to_store)

    def lookup_until_settled(self, k: bytes, ctx: ReqContext, timeout: float = 30.0) -> LookupResult:
        """lookup() as the connector repeats it: RETRY and HIT_PENDING mean "ask again next step"."""
        deadline = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                result = self.manager.lookup(k, ctx)
            if result in (LookupResult.HIT, LookupResult.MISS):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup stayed {result}")
            self.step()
            time.sleep(0.002)

    def load(self, ctx: ReqContext, keys: list[bytes]) -> dict[bytes, bytes]:
        """CPU -> GPU load of keys that are HIT (the worker's copy is a read of the CPU rows)."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        data = {k: self.rows[int(cid)].tobytes() for k, cid in zip(keys, spec.chunk_ids)}
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
        return data

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def shutdown(self) -> None:
        self.settle()
        self.rows = None  # type: ignore[assignment]  (a live export keeps vLLM from unmapping its region)
        self.manager.shutdown()
