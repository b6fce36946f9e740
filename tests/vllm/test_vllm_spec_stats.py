"""kvtier's offloading spec under vLLM 0.33's manager contract: tier work that finishes while the engine is idle
reaches vLLM's stats. The class of defect: counters (disk or remote stores, promotions, misses) that lag behind
until the next request, because the last poll ran in ``has_pending_work`` -- which then told vLLM to stop stepping
-- and no step called ``get_stats`` after it."""
from __future__ import annotations

import os

import pytest
from upstream import ADAPTER, import_upstream

pytestmark = pytest.mark.vllm

import_upstream("tests.v1.kv_offload.conftest")
from kvtier_runtime.engines.metric_defs import FS_STORES  # noqa: E402
from tests.v1.kv_offload.conftest import make_offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402


def _reported(stats, metric: str) -> float:
    return (stats._values.get(metric) or {}).get((), 0) if stats is not None else 0


def test_an_idle_engine_steps_until_finished_write_throughs_reach_its_stats(tmp_path) -> None:
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"),
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"stats-{os.getpid()}",
                                    extra_config=extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        ctx = ReqContext(req_id="r1")
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        manager.complete_store(keys, ctx)  # the worker's copy is done: write-through to disk starts
        reported = _reported(manager.get_stats(), FS_STORES.name)  # the step that completed the store
        manager.books.tiers[0].drain(timeout=30)  # the disk writes finish while nothing else happens
        steps = 0
        while manager.has_pending_work():  # what vLLM's engine loop asks before each idle step
            steps += 1
            assert steps < 10, "the engine was kept stepping for nothing"
            manager.on_schedule_end()
            reported += _reported(manager.get_stats(), FS_STORES.name)
        assert reported == 2, f"{reported} of 2 disk stores reached vLLM's stats after {steps} idle steps"
    finally:
        manager.shutdown()


def test_a_tier_the_control_file_disables_is_reported_bypassed_and_its_skipped_lookups_counted(tmp_path) -> None:
    from kvtier_runtime.engines.metric_defs import TIER_BYPASSED, TIER_MISSES

    control = tmp_path / "control.json"
    control.write_text('{"disabledTiers": ["nvme"], "generation": 7}')
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "control_file": str(control),
             "tier_names": ["cpu", "nvme"],
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"bypass-{os.getpid()}",
                                    extra_config=extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        ctx = ReqContext(req_id="r1")
        manager.lookup(make_offload_key(b"\x07" * 32, 0), ctx)  # not in the host tier: reaches the disabled tier
        stats = manager.get_stats()
        gauges = stats._values[TIER_BYPASSED.name]
        assert gauges[("nvme", "disabled")] == 1 and gauges[("nvme", "slow")] == 0
        assert gauges[("cpu", "disabled")] == 0
        assert stats._values[TIER_MISSES.name][("nvme", "bypassed")] == 1
    finally:
        manager.shutdown()


def test_hit_and_lookup_tokens_are_reported_per_tier_by_name(tmp_path) -> None:
    from kvtier_runtime.engines.metric_defs import HIT_TOKENS, LOOKUP_TOKENS

    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "tier_names": ["cpu", "nvme"],
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"hits-{os.getpid()}",
                                    extra_config=extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        ctx = ReqContext(req_id="r1")
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
        manager.prepare_store(keys, ctx)
        manager.complete_store(keys, ctx)
        for _ in range(2):  # two host hits and a miss, asked twice (as after a retry): counted once
            for key in keys + [make_offload_key(b"\x09" * 32, 0)]:
                manager.lookup(key, ctx)
        stats = manager.get_stats()
        tokens = manager.spec.tokens_per_chunk
        assert tokens == 16
        assert stats._values[HIT_TOKENS.name] == {("cpu",): 2 * tokens}
        assert stats._values[LOOKUP_TOKENS.name] == {(): 3 * tokens}
        manager.on_request_finished(ctx)
        manager.lookup(keys[0], ReqContext(req_id="r2"))  # another request: counted again
        stats = manager.get_stats()
        assert stats._values[HIT_TOKENS.name] == {("cpu",): tokens}
        assert stats._values[LOOKUP_TOKENS.name] == {(): tokens}
    finally:
        manager.shutdown()


def test_trace_dir_records_each_request_once_with_its_prompt_chunks_in_order(tmp_path) -> None:
    import json

    from kvtier_runtime.replay.trace import load_meta, load_trace

    trace_dir = tmp_path / "trace"
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "tier_names": ["cpu", "nvme"],
             "trace_dir": str(trace_dir),
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"trace-{os.getpid()}",
                                    extra_config=extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
    try:
        for req, chunks in (("a", keys[:3]), ("b", keys[:2] + keys[3:])):
            ctx = ReqContext(req_id=req)
            for n, key in enumerate(chunks, start=1):  # what vLLM's scheduler does before its first lookup
                ctx.set_offload_key_position(key, n * 16)
            for key in chunks:  # vLLM asks chunk by chunk, and again on later steps: recorded once
                manager.lookup(key, ctx)
                manager.lookup(key, ctx)
            manager.on_request_finished(ctx)
    finally:
        manager.shutdown()  # writes what is queued and the final sidecar
    trace = load_trace(trace_dir / "trace-000.jsonl")
    assert trace.requests == [[0, 1, 2], [0, 1, 3]] and trace.input_lengths == [48, 48]
    meta = json.loads((trace_dir / "trace-meta.json").read_text())
    assert [(t["name"], t["medium"], t["eviction_policy"]) for t in meta["tiers"]] == [
        ("cpu", "cpu", "adaptive"), ("nvme", "disk", "adaptive")]
    assert meta["tiers"][0]["capacity_blocks"] == 4 and meta["tiers"][1]["capacity_blocks"] > 4
    assert meta["tokens_per_block"] == 16 and meta["device_blocks"] is None
    # A chunk's bytes over every rank (8 per block, one block per chunk, one rank): what replay recommend sizes with.
    assert meta["block_bytes"] == 8 and load_meta(trace_dir / "trace-meta.json").block_bytes == 8
    assert load_meta(trace_dir / "trace-meta.json").capacities[0] == 4


class _Request:
    """What vLLM's scheduler holds when it announces a request to the manager (its prompt's length)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens


def _announce(manager, ctx: ReqContext, request: _Request) -> None:
    """vLLM's connector's on_new_request: the manager hears of ``ctx`` while its caller holds ``request``."""
    manager.on_new_request(ctx)


def _settled(manager, key, ctx: ReqContext):
    for _ in range(500):
        with manager.lock:
            found = manager.lookup(key, ctx)
        if found is not LookupResult.RETRY:
            return found
        manager.books.drain()
    raise AssertionError("the promotion never settled")


def test_load_source_recording_and_hit_tokens_name_the_same_tier_for_every_chunk(tmp_path) -> None:
    """One truth about which tier served a chunk: the first load after a promotion from disk is a disk hit in
    ``hit_tokens{tier}``, in vLLM's load source (``prompt_tokens_cached_by_source``) and in the recording; a later
    request's load of the same chunk, now in the host tier, is a host hit in all three. The recording writes the
    prompt length vLLM announced (not rounded down to whole chunks)."""
    import json

    from kvtier_runtime.engines.metric_defs import HIT_TOKENS
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    trace_dir = tmp_path / "trace"
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "tier_names": ["cpu", "nvme"],
             "trace_dir": str(trace_dir),
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=2 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"truth-{os.getpid()}",
                                    extra_config=extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    tokens = manager.spec.tokens_per_chunk
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    sources = {}
    try:
        writer = ReqContext(req_id="w")
        for key in keys:  # one at a time into a 2-row host tier: keys[0] ends up on disk only
            with manager.lock:
                manager.prepare_store([key], writer)
                manager.complete_store([key], writer)
            manager.books.drain()
        manager.on_request_finished(writer)
        for req in ("r1", "r2"):
            ctx = ReqContext(req_id=req)
            _announce(manager, ctx, _Request(tokens + 5))  # a whole chunk and a partial tail
            ctx.set_offload_key_position(keys[0], tokens)
            assert _settled(manager, keys[0], ctx) is LookupResult.HIT
            sources[req] = manager.get_load_source(keys[0], ctx)
            with manager.lock:
                manager.prepare_load([keys[0]], ctx)
                manager.complete_load([keys[0]], ctx)
            manager.on_request_finished(ctx)
        stats = manager.get_stats()
    finally:
        manager.shutdown()
    assert sources == {"r1": CacheHitSource.DISK, "r2": CacheHitSource.HOST}
    assert stats._values[HIT_TOKENS.name] == {("nvme",): tokens, ("cpu",): tokens}
    lines = [json.loads(line) for line in (trace_dir / "trace-000.jsonl").read_text().splitlines()]
    # (The writer never set its keys' positions: vLLM's scheduler would have; nothing to record for it.)
    assert [(d["input_length"], d["hit_tokens"]) for d in lines] == [
        (tokens + 5, {"nvme": tokens}), (tokens + 5, {"cpu": tokens})]


def test_an_unwritable_trace_dir_fails_start_up_naming_the_key(tmp_path) -> None:
    from kvtier_runtime.config import ConfigError

    (tmp_path / "file").write_text("")
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"),
             "trace_dir": str(tmp_path / "file" / "trace")}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"notrace-{os.getpid()}",
                                    extra_config=extra)
    with pytest.raises(ConfigError) as err:
        OffloadingSpecFactory.create_spec(config).get_manager()
    assert str(err.value).startswith("kv_connector_extra_config.trace_dir: cannot record into")
    assert not list((tmp_path / "shm").iterdir())  # the host region was removed again


def test_a_remote_tier_before_a_filesystem_tier_is_looked_up_stored_and_reported_in_that_order_by_name(
        tmp_path, redis_server) -> None:
    """The policy's tier order is the engine's: a remote tier declared before a filesystem tier is the books' first
    slot and its breaker's, each tier's gauges carry its policy name (and its address), and replay's model of the
    engine lists them in that order."""
    from kvtier_runtime.engines.metric_defs import REMOTE_UP, TIER_CAPACITY_BYTES
    from kvtier_runtime.engines.vllm.offloading import trace_meta
    from plugins.redis_server import tenant_key_file
    from plugins.tier_sync import connected

    fs = str(tmp_path / "fs")
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "host_tier_name": "cpu", "tiers": [
        {"name": "shared", "medium": "remote",
         "config": {"url": redis_server.url, "capacity_bytes": 1 << 20, "scope": "team-a",
                    "mac_key_file": tenant_key_file("team-a")}},
        {"name": "nvme", "medium": "filesystem",
         "config": {"root_dir": fs, "capacity_bytes": 1 << 20, "n_read_threads": 1, "n_write_threads": 1}}]}
    config = make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8,
                                    worker_kv_bytes_per_block=8, engine_id=f"order-{os.getpid()}",
                                    extra_config=extra)
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    try:
        books = manager.books
        assert [(s.name, s.tier.medium, s.tier.address) for s in books.slots] == [
            ("shared", "remote", redis_server.url), ("nvme", "filesystem", fs)]
        assert books.breakers.names == ["cpu", "shared", "nvme"]
        assert connected(books.slots[0].tier)
        ctx = ReqContext(req_id="r1")
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
        manager.prepare_store(keys, ctx)
        manager.complete_store(keys, ctx)  # written through to both tiers, in their order
        books.drain()
        stats = manager.get_stats()
        assert stats._values[TIER_CAPACITY_BYTES.name] == {("shared", redis_server.url): 1 << 20,
                                                           ("nvme", fs): 1 << 20}
        assert stats._values[REMOTE_UP.name] == {("shared", redis_server.url): 1}
        assert [(t["name"], t["medium"]) for t in trace_meta(spec, manager)["tiers"]] == [
            ("cpu", "cpu"), ("shared", "remote"), ("nvme", "disk")]
        assert all(s.tier.used_bytes > 0 for s in books.slots)
    finally:
        manager.shutdown()
