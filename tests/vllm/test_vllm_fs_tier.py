"""KvtierFilesystemTier inside vLLM 0.33: built by vLLM's own factories, driven as vLLM's scheduler drives it.

Two levels: the tier alone from ``SecondaryTierFactory`` over a plain CPU memoryview (job-level behaviour: never
blocking, RETRY while pending, failures), and the tier behind vLLM's real ``TieringOffloadingManager`` with its
real CPU tier (an mmap in /dev/shm), where the only stand-in is the GPU worker's copy (see ``vllm_driver``).
"""
from __future__ import annotations

import os
import pathlib
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is not installed here; see .ci/vllm-env")

import torch  # noqa: E402
from kvtier_runtime.codecs import ERROR_BUDGETS, get_codec  # noqa: E402
from kvtier_runtime.config import (  # noqa: E402
    VLLM_ADAPTER_MODULE,
    VLLM_SECONDARY_TIER_CLASS,
    ConfigError,
    FilesystemTierConfig,
    vllm_cache_policy_class,
)
from kvtier_runtime.engines.metric_defs import (  # noqa: E402
    FS_EVICTED_CHUNKS,
    FS_FAILED_CHUNKS,
    FS_STORED_CHUNKS,
    FS_USED_BYTES,
)
from kvtier_runtime.engines.vllm_adapter import KvtierFilesystemTier  # noqa: E402
from kvtier_runtime.fs.format import file_bytes_for  # noqa: E402
from plugins.runtime import tier_bytes_for  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_driver import BLOCK_BYTES, Scheduler, key, offloading_config  # noqa: E402

ROW = BLOCK_BYTES  # the CPU tier's row for one chunk (already 4 KiB aligned)


def file_bytes(codec: str, dtype: torch.dtype = torch.float16) -> int:
    """Bytes one chunk takes on disk: file header + the codec's block (its header included), 4 KiB aligned."""
    return file_bytes_for(get_codec(codec).encoded_nbytes((ROW // dtype.itemsize,), dtype))


def tier_dict(root: pathlib.Path, **kw) -> dict:
    """A secondary_tiers entry as the renderer writes it (built from the shared config contract)."""
    cfg = FilesystemTierConfig(root_dir=str(root), capacity_bytes=kw.pop("capacity_bytes", 1 << 30), **kw)
    return {"type": VLLM_SECONDARY_TIER_CLASS, "module_path": VLLM_ADAPTER_MODULE, **cfg.to_kwargs()}


def extra_config(root: pathlib.Path, cpu_chunks: int = 8, policy: str = "s3fifo", **tier_kw) -> dict:
    return {
        "cpu_bytes_to_use": cpu_chunks * ROW,
        "eviction_policy": vllm_cache_policy_class(policy),
        "cache_policy_module_path": VLLM_ADAPTER_MODULE,
        "secondary_tiers": [tier_dict(root, **tier_kw)],
    }


def bf16_payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROW // 2, generator=g) * 0.5).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def sched_factory(engine_id):
    started: list[Scheduler] = []

    def start(extra: dict, **kw) -> Scheduler:
        sched = Scheduler.start(f"{engine_id}-{len(started)}", extra, **kw)
        started.append(sched)
        return sched

    yield start
    for sched in started:
        if sched.manager is not None:
            sched.shutdown()


def store_requests(sched: Scheduler, payloads: dict[bytes, bytes], per_request: int = 4) -> None:
    keys = list(payloads)
    for start in range(0, len(keys), per_request):
        ctx = sched.context()
        sched.store(ctx, keys[start : start + per_request], payloads)
        sched.finish(ctx)
        sched.settle()


def read_back(sched: Scheduler, keys: list[bytes]) -> dict[bytes, bytes | None]:
    ctx = sched.context()
    out: dict[bytes, bytes | None] = {}
    for k in keys:
        hit = sched.lookup_until_settled(k, ctx) is LookupResult.HIT
        out[k] = sched.load(ctx, [k])[k] if hit else None
    sched.finish(ctx)
    return out


# ---- construction through vLLM's factories ---------------------------------------------------------------------


def cpu_view(n_rows: int) -> tuple[bytearray, memoryview]:
    buf = bytearray(n_rows * ROW)
    return buf, memoryview(buf).cast("B", (n_rows, ROW))


def spec_for(engine_id: str, root: pathlib.Path, **kw) -> TieringOffloadingSpec:
    return TieringOffloadingSpec(offloading_config(engine_id, extra_config(root), **kw))


def test_secondary_tier_factory_builds_it_from_the_tier_dict(tmp_path, engine_id):
    _, view = cpu_view(4)
    cfg = tier_dict(tmp_path, codec="int8", eviction_policy="arc", n_read_threads=2, n_write_threads=3)
    cfg["locality"] = "LOCAL"  # vLLM passes unknown tier keys through as kwargs
    tier = SecondaryTierFactory.create_secondary_tier(cfg, view, spec_for(engine_id, tmp_path))
    try:
        assert isinstance(tier, KvtierFilesystemTier)
        assert tier.tier_type == VLLM_SECONDARY_TIER_CLASS
        assert tier.block_size_bytes == ROW
        assert tier.config.codec == "int8" and tier.config.eviction_policy == "arc"
        assert tier.config.extra == {"locality": "LOCAL"} and tier.locality.value == "LOCAL"
        assert tier.tier.dtype == torch.bfloat16  # the engine's KV dtype, for the codec
        assert tier.config_info()["kvtier_codec"] == "int8"
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"codec": "zstd"}, "codec"),
        ({"root_dir": "relative/dir"}, "root_dir"),
        ({"eviction_policy": "mru"}, "eviction_policy"),
    ],
)
def test_bad_tier_keys_fail_construction_naming_the_key(tmp_path, engine_id, change, message):
    _, view = cpu_view(2)
    cfg = {"type": VLLM_SECONDARY_TIER_CLASS, "module_path": VLLM_ADAPTER_MODULE, "root_dir": str(tmp_path),
           "capacity_bytes": 1 << 20, **change}
    with pytest.raises(ConfigError, match=message):
        SecondaryTierFactory.create_secondary_tier(cfg, view, spec_for(engine_id, tmp_path))


def test_a_lossy_codec_refuses_an_fp8_kv_cache(tmp_path, engine_id):
    _, view = cpu_view(2)
    with pytest.raises(ConfigError, match="codec: 'int4'.*fp8"):
        SecondaryTierFactory.create_secondary_tier(
            tier_dict(tmp_path, codec="int4"), view, spec_for(engine_id, tmp_path, kv_dtype="fp8")
        )


# ---- the tier alone: jobs as the tiering manager submits them ------------------------------------------------------


class GatedWrites:
    """Blocks the tier's write threads until released, to observe the scheduler side while I/O is in flight."""

    def __init__(self, tier: KvtierFilesystemTier) -> None:
        self.gate = threading.Event()
        ops = tier.tier.file_ops
        original = ops.write

        def write(fd, data):
            self.gate.wait(30)
            return original(fd, data)

        ops.write = write


def test_nothing_blocks_while_the_disk_is_stuck(tmp_path, engine_id):
    buf, view = cpu_view(4)
    buf[:ROW] = os.urandom(ROW)
    tier = SecondaryTierFactory.create_secondary_tier(tier_dict(tmp_path), view, spec_for(engine_id, tmp_path))
    gated = GatedWrites(tier)
    try:
        ctx = ReqContext(req_id="r")
        started = time.perf_counter()
        tier.submit_store(TransferJob(7, [key(1)], np.array([0], dtype=np.int32), False, ctx))
        submit_s = time.perf_counter() - started
        assert submit_s < 0.5, f"submit_store took {submit_s:.3f}s while the disk was stuck"
        assert tier.lookup(key(1), ctx) is LookupResult.RETRY
        assert tier.lookup(key(2), ctx) is LookupResult.MISS
        assert list(tier.get_finished_jobs()) == []
        assert tier.has_pending_work()
        gated.gate.set()
        deadline = time.monotonic() + 30
        finished = []
        while not finished and time.monotonic() < deadline:
            finished = list(tier.get_finished_jobs())
            time.sleep(0.005)
        assert [(r.job_id, r.success, r.transfer_bytes) for r in finished] == [(7, True, ROW)]
        assert tier.lookup(key(1), ctx) is LookupResult.HIT
        buf[ROW : 2 * ROW] = bytes(ROW)
        tier.submit_load(TransferJob(8, [key(1)], np.array([1], dtype=np.int32), True, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(8, True)]
        assert buf[ROW : 2 * ROW] == buf[:ROW]
    finally:
        gated.gate.set()
        tier.shutdown()


def test_a_refused_store_is_not_a_failed_store(tmp_path, engine_id):
    """Admission refusals are decisions, not I/O faults: vLLM's back-pressure detector must not count them."""
    buf, view = cpu_view(2)
    tier = SecondaryTierFactory.create_secondary_tier(
        tier_dict(tmp_path, admission="doorkeeper"), view, spec_for(engine_id, tmp_path)
    )
    try:
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, [key(1)], np.array([0], dtype=np.int32), False, ctx))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.success and result.transfer_bytes is None  # refused on first offer, nothing written
        assert tier.lookup(key(1), ctx) is LookupResult.MISS
        tier.submit_store(TransferJob(2, [key(1)], np.array([0], dtype=np.int32), False, ctx))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.success and result.transfer_bytes == ROW  # second offer admitted
        stats = tier.get_stats().reduce()
        assert stats[f"{FS_STORED_CHUNKS.name}:{(str(tmp_path),)}"] == 1
    finally:
        tier.shutdown()


# ---- behind vLLM's real tiering manager ----------------------------------------------------------------------------


def test_bytes_round_trip_exactly_through_cpu_eviction_and_promotion(tmp_path, sched_factory):
    sched = sched_factory(extra_config(tmp_path, cpu_chunks=8, codec="none"))
    payloads = {key(i): os.urandom(ROW) for i in range(24)}  # 3x the CPU tier: most chunks leave it
    store_requests(sched, payloads)
    tier = sched.tiers[0]
    assert len(tier.tier) == 24
    evicted_from_cpu = [k for k in payloads if sched.manager.primary_tier.lookup(k, ReqContext("x")) is LookupResult.MISS]
    assert len(evicted_from_cpu) >= 16
    got = read_back(sched, list(payloads))
    assert got == payloads
    stats = sched.manager.get_stats().reduce()
    assert stats[f"vllm:kv_offload_tiering_chunk_hits:('1:{VLLM_SECONDARY_TIER_CLASS}',)"] >= 16


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_codecs_round_trip_within_their_budget_and_use_less_disk(tmp_path, sched_factory, codec):
    sched = sched_factory(extra_config(tmp_path, cpu_chunks=4, codec=codec, codec_fallback=False))
    payloads = {key(i): bf16_payload(i) for i in range(12)}
    store_requests(sched, payloads)
    tier = sched.tiers[0]
    assert tier.tier.used_bytes == 12 * file_bytes(codec, torch.bfloat16) < 12 * file_bytes("none")
    got = read_back(sched, list(payloads))
    for k, raw in payloads.items():
        assert got[k] is not None
        x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float()
        y = torch.frombuffer(bytearray(got[k]), dtype=torch.bfloat16).float()
        rel = float((x - y).norm() / x.norm())
        assert 0 < rel <= ERROR_BUDGETS[codec], f"{codec}: relative error {rel:.4f}"


def test_capacity_is_a_hard_bound_and_the_policy_evicts(tmp_path, sched_factory):
    per_file = file_bytes("none")
    sched = sched_factory(extra_config(tmp_path, cpu_chunks=4, capacity_bytes=tier_bytes_for(10, per_file), policy="lru",
                                       eviction_policy="lru"))
    payloads = {key(i): os.urandom(ROW) for i in range(30)}
    store_requests(sched, payloads)
    tier = sched.tiers[0]
    files = [p for p in tmp_path.rglob("*.kvb")]
    assert tier.tier.used_bytes <= 10 * per_file
    assert len(files) == len(tier.tier) == 10
    assert sum(p.stat().st_size for p in files) <= 10 * per_file
    got = read_back(sched, list(payloads))
    assert [k for k, v in got.items() if v is not None] == list(payloads)[-10:]  # lru keeps the newest
    assert all(got[k] == payloads[k] for k in list(payloads)[-10:])
    evicted = REGISTRY.get_sample_value("kvtier_runtime_evictions_total", {"tier": tier.tier.name})
    assert evicted == 20  # 30 stored, 10 kept: exactly the policy's evictions
    stats = sched.manager.get_stats().reduce()
    assert stats[f"{FS_EVICTED_CHUNKS.name}:{(str(tmp_path),)}"] == 20, "vLLM's metric reports the same evictions"


def test_restart_finds_the_blocks_again(tmp_path, sched_factory):
    extra = extra_config(tmp_path, cpu_chunks=4)
    first = sched_factory(extra)
    payloads = {key(i): os.urandom(ROW) for i in range(10)}
    store_requests(first, payloads)
    first.shutdown()
    first.manager = None
    second = sched_factory(extra)  # a new engine: empty CPU tier, same disk
    assert second.tiers[0].tier.rebuild_stats["blocks"] == 10
    assert read_back(second, list(payloads)) == payloads


def test_another_model_never_sees_the_blocks(tmp_path, sched_factory):
    extra = extra_config(tmp_path, cpu_chunks=4)
    first = sched_factory(extra)
    payloads = {key(i): os.urandom(ROW) for i in range(4)}
    store_requests(first, payloads)
    first.shutdown()
    first.manager = None
    other = sched_factory(extra, model="kvtier-test/another-model")
    assert all(v is None for v in read_back(other, list(payloads)).values())


def flip_one_byte(path: pathlib.Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_block_is_a_miss_not_wrong_bytes(tmp_path, sched_factory):
    sched = sched_factory(extra_config(tmp_path, cpu_chunks=2))
    payloads = {key(i): os.urandom(ROW) for i in range(6)}
    store_requests(sched, payloads, per_request=2)
    victim = key(0)
    assert sched.manager.primary_tier.lookup(victim, ReqContext("x")) is LookupResult.MISS  # only on disk now
    tier = sched.tiers[0]
    path = pathlib.Path(tier.tier.block_path(tier.tier_key(victim)))
    flip_one_byte(path, offset_from_end=ROW // 2)
    ctx = sched.context()
    assert sched.lookup_until_settled(victim, ctx) is LookupResult.MISS  # the failed promotion is recomputed
    sched.finish(ctx)
    assert not path.exists()
    stats = sched.manager.get_stats().reduce()
    assert stats[f"{FS_FAILED_CHUNKS.name}:{(str(tmp_path), 'corrupt')}"] == 1
    assert stats.get(f"{FS_EVICTED_CHUNKS.name}:{(str(tmp_path),)}", 0) == 0, "a corrupt block is not an eviction"
    assert stats[f"vllm:kv_offload_tiering_promotion_job_failures:('1:{VLLM_SECONDARY_TIER_CLASS}',)"] == 1
    rest = read_back(sched, list(payloads)[1:])
    assert rest == {k: payloads[k] for k in list(payloads)[1:]}


def test_contrast_vllm_fs_tier_serves_a_corrupted_block_as_a_hit(tmp_path, sched_factory):
    """The same fault against vLLM's built-in ``fs`` tier: the flipped byte comes back as data."""
    extra = {
        "cpu_bytes_to_use": 2 * ROW,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}],
    }
    sched = sched_factory(extra)
    payloads = {key(i): os.urandom(ROW) for i in range(6)}
    store_requests(sched, payloads, per_request=2)
    victim = key(0)
    (path,) = [p for p in tmp_path.rglob("*.bin") if p.stem == victim[:-4].hex()]
    flip_one_byte(path, offset_from_end=ROW // 2)
    (got,) = read_back(sched, [victim]).values()
    assert got is not None and got != payloads[victim]  # a normal hit with wrong bytes
    assert sum(a != b for a, b in zip(got, payloads[victim])) == 1


def test_metrics_reach_vllm_through_its_definitions_hook(tmp_path, sched_factory):
    extra = extra_config(tmp_path, cpu_chunks=4)
    definitions = TieringOffloadingSpec.build_metric_definitions(extra)
    sched = sched_factory(extra)
    payloads = {key(i): os.urandom(ROW) for i in range(8)}
    store_requests(sched, payloads)
    stats = sched.manager.get_stats()
    types, values = stats.metric_sections()
    ours = {name for name in values if name.startswith("vllm:kv_offload_kvtier_fs_")}
    assert ours and ours <= set(definitions), "a metric vLLM would reject: not declared by the tier"
    for name in ours:  # vLLM asserts label arity when it exports; check it here without a frontend
        for labelvalues in values[name]:
            assert len(labelvalues) == len(definitions[name].labelnames), name
    assert values[FS_USED_BYTES.name][(str(tmp_path),)] == sched.tiers[0].tier.used_bytes > 0
    # The runtime's own metrics (prometheus_client default registry) count the same writes.
    demoted = REGISTRY.get_sample_value("kvtier_runtime_demotions_total", {"src": "host", "dst": sched.tiers[0].tier.name})
    assert demoted == 8


def test_a_disk_fault_fails_the_store_and_a_partial_load_names_what_loaded(tmp_path, engine_id):
    buf, view = cpu_view(4)
    buf[: 2 * ROW] = os.urandom(2 * ROW)
    tier = SecondaryTierFactory.create_secondary_tier(tier_dict(tmp_path), view, spec_for(engine_id, tmp_path))
    try:
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, [key(1), key(2)], np.array([0, 1], dtype=np.int32), False, ctx))
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]

        ops = tier.tier.file_ops
        original = ops.write

        # EIO rather than ENOSPC: on ENOSPC the tier also evicts its coldest blocks to make room, which would
        # take away the two blocks the partial load below needs.
        def failing_disk(fd, data):
            raise OSError(5, "Input/output error")

        ops.write = failing_disk
        tier.submit_store(TransferJob(2, [key(3)], np.array([0], dtype=np.int32), False, ctx))
        tier.drain_jobs()
        (failed,) = tier.get_finished_jobs()
        assert (failed.job_id, failed.success) == (2, False)  # vLLM's back-pressure detector sees a failed store
        assert tier.lookup(key(3), ctx) is LookupResult.MISS
        ops.write = original

        flip_one_byte(pathlib.Path(tier.tier.block_path(tier.tier_key(key(2)))), offset_from_end=ROW // 2)
        buf[2 * ROW :] = bytes(2 * ROW)
        tier.submit_load(TransferJob(3, [key(1), key(2)], np.array([2, 3], dtype=np.int32), True, ctx))
        tier.drain_jobs()
        (partial,) = tier.get_finished_jobs()
        assert (partial.job_id, partial.success, tuple(partial.successful_keys)) == (3, False, (key(1),))
        assert buf[2 * ROW : 3 * ROW] == buf[:ROW]
        assert tier.lookup(key(2), ctx) is LookupResult.MISS  # never served again
        stats = tier.get_stats().reduce()
        assert stats[f"{FS_FAILED_CHUNKS.name}:{(str(tmp_path), 'eio')}"] == 1
        assert stats[f"{FS_FAILED_CHUNKS.name}:{(str(tmp_path), 'corrupt')}"] == 1
    finally:
        tier.shutdown()


def test_reset_cache_drains_the_tier_and_keeps_its_blocks(tmp_path, sched_factory):
    """vLLM's reset_cache (sleep, weight update) calls drain_jobs and must find no transfer in flight after it."""
    sched = sched_factory(extra_config(tmp_path, cpu_chunks=8))
    payloads = {key(i): os.urandom(ROW) for i in range(6)}
    ctx = sched.context()
    sched.store(ctx, list(payloads), payloads)  # cascades submitted, not yet collected
    sched.finish(ctx)
    with sched.manager.lock:
        sched.manager.reset_cache()
        assert not sched.manager.has_pending_work()
        sched.manager.on_reset_flushed()
    assert len(sched.tiers[0].tier) == 6
    assert read_back(sched, list(payloads)) == payloads  # the CPU tier is empty: all six come from disk
