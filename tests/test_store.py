"""The tiered store: placement, write-through/write-back, promotion, pins, the cost model, faults, concurrency.

The device tier runs on CPU tensors here (no GPU on this machine); the same code paths on CUDA are exercised by
the `cuda`-marked tests and bench/gpu_store.py on a GPU machine.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.fs import FilesystemTier
from kvtier_runtime.store import CostModel, MemoryTier, TieredStore
from plugins.runtime import block_file_bytes, block_for, key_of, metric_value, run_in_threads

SHAPE = (64, 256)
NB = 64 * 256 * 4  # bytes of one float32 block


@pytest.fixture
def make_store(tmp_path):
    made: list = []

    def make(device=2, host=4, fs_blocks: int | None = 64, **kw) -> TieredStore:
        fs = None
        if fs_blocks is not None:
            cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=fs_blocks * block_file_bytes(),
                                       eviction_policy="lru", n_read_threads=2, n_write_threads=2)
            fs = FilesystemTier(cfg, SHAPE, torch.float32)
            made.append(fs)
        store = TieredStore(SHAPE, torch.float32, device="cpu",
                            device_capacity_bytes=None if device is None else device * NB,
                            host_capacity_bytes=None if host is None else host * NB, fs=fs, **kw)
        made.insert(0, store)
        return store

    yield make
    for obj in made:
        obj.close()


def _put(store, keys):
    return store.put(keys, [block_for(k) for k in keys]).result(timeout=60)


def _load(store, keys):
    outs = [torch.full(SHAPE, -1.0) for _ in keys]
    res = store.load(keys, outs).result(timeout=60)
    for k, o in zip(keys[: res.hits], outs):
        assert torch.equal(o, block_for(k)), "a hit must deliver exactly the stored bytes"
    return res, outs


# ---- cost model (pure) ----------------------------------------------------------------------------------
def test_cost_model_compares_transfer_with_recompute() -> None:
    cm = CostModel({"fs": 1e9, "host": 50e9}, recompute_s_per_token=1e-4, tokens_per_block=16,
                   latency_s={"fs": 1e-4})
    nbytes = 2 << 20
    assert cm.promotion_seconds(["host"], nbytes) == pytest.approx(nbytes / 50e9)
    assert cm.promotion_seconds(["fs", "host"], nbytes) == pytest.approx(nbytes / 1e9 + 1e-4 + nbytes / 50e9)
    assert cm.recompute_seconds() == pytest.approx(1.6e-3)
    assert not cm.worth_promoting(["fs", "host"], nbytes)  # 2.24 ms to move vs 1.6 ms to recompute
    assert cm.worth_promoting(["host"], nbytes)  # 0.04 ms
    fast = CostModel({"fs": 5e9, "host": 50e9}, recompute_s_per_token=1e-4, tokens_per_block=16)
    assert fast.worth_promoting(["fs", "host"], nbytes)  # 0.46 ms
    assert CostModel({}, 0.0, 16).worth_promoting(["fs"], nbytes)  # unknown links are not a reason to skip


def test_cost_model_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"link_bytes_per_s\['fs'\]"):
        CostModel({"fs": 0}, 1e-4, 16)
    with pytest.raises(ValueError, match="tokens_per_block"):
        CostModel({}, 1e-4, 0)
    with pytest.raises(ValueError, match="recompute_s_per_token"):
        CostModel({}, -1.0, 16)
    with pytest.raises(ValueError, match=r"latency_s\['fs'\]"):
        CostModel({}, 1e-4, 16, latency_s={"fs": -1})


# ---- memory tier ----------------------------------------------------------------------------------------
def test_memory_tier_allocates_once_and_reuses_slots() -> None:
    tier = MemoryTier("host", SHAPE, torch.float32, 3 * NB + 100)
    assert tier.n_slots == 3 and tier.capacity_bytes == 3 * NB
    ptr = tier.slab.data_ptr()
    slots = set()
    for i in range(10):
        slot, victims = tier.reserve(key_of(i))
        slots.add(slot)
        assert len(victims) == (1 if i >= 3 else 0)
    assert slots == {0, 1, 2} and tier.slab.data_ptr() == ptr and len(tier) == 3
    with pytest.raises(ValueError, match="host.capacity_bytes"):
        MemoryTier("host", SHAPE, torch.float32, NB - 1)


# ---- store ----------------------------------------------------------------------------------------------
def test_put_then_load_from_the_top_tier(make_store) -> None:
    store = make_store()
    keys = [key_of(i) for i in range(2)]
    assert _put(store, keys).success
    assert store.lookup(keys) == {"device": 2, "host": 0, "fs": 0, "any": 2}
    res, _ = _load(store, keys)
    assert (res.hits, res.sources, res.stopped) == (2, ("device", "device"), None)


def test_write_back_demotes_evicted_blocks_down_the_tiers(make_store) -> None:
    store = make_store(device=2, host=3)
    keys = [key_of(i) for i in range(12)]
    for k in keys:  # one at a time, so each put evicts the oldest block
        assert _put(store, [k]).success
    device, host, fs = store.tier("device"), store.tier("host"), store.tier("fs")
    assert set(device.keys()) == set(keys[-2:])
    assert set(host.keys()) == set(keys[-5:-2])
    assert set(fs.keys()) == set(keys[:7])  # write-back: only blocks evicted from host reached the disk
    assert store.lookup(keys)["any"] == 12
    res, _ = _load(store, keys)
    assert res.hits == 12 and res.sources[0] == "fs" and res.sources[-1] == "device"


def test_write_through_writes_every_tier_at_put_time(make_store) -> None:
    store = make_store(device=2, host=4, write={"host": "through", "fs": "through"})
    keys = [key_of(i) for i in range(3)]
    assert _put(store, keys).success
    assert store.lookup(keys) == {"device": 0, "host": 3, "fs": 3, "any": 3}
    assert set(store.tier("device").keys()) == set(keys[1:])
    assert store.write_mode("fs") == "through"


def test_promotion_goes_fs_to_host_to_device_and_is_counted(make_store) -> None:
    store = make_store(device=2, host=2)
    keys = [key_of(i) for i in range(6)]
    for k in keys:
        _put(store, [k])
    assert store.lookup(keys[:1])["fs"] == 1
    p_fh = metric_value("kvtier_runtime_promotions_total", src="fs", dst="host")
    p_hd = metric_value("kvtier_runtime_promotions_total", src="host", dst="device")
    res, _ = _load(store, keys[:1])
    assert res.sources == ("fs",)
    assert metric_value("kvtier_runtime_promotions_total", src="fs", dst="host") == p_fh + 1
    assert metric_value("kvtier_runtime_promotions_total", src="host", dst="device") == p_hd + 1
    assert keys[0] in store.tier("device") and keys[0] in store.tier("host")
    assert metric_value("kvtier_runtime_occupancy_bytes", tier="device") == 2 * NB


def test_lookup_is_the_leading_run_per_tier(make_store) -> None:
    store = make_store(device=4)
    a, b, c = key_of(1), key_of(2), key_of(3)
    _put(store, [a, c])
    assert store.lookup([a, b, c]) == {"device": 1, "host": 0, "fs": 0, "any": 1}


def test_pinned_blocks_stay_put(make_store) -> None:
    store = make_store(device=2, host=2)
    keep = key_of(0)
    _put(store, [keep])
    store.pin([keep])
    for i in range(1, 8):
        _put(store, [key_of(i)])
    assert keep in store.tier("device")
    store.unpin([keep])
    for i in range(8, 12):
        _put(store, [key_of(i)])
    assert keep not in store.tier("device")
    with pytest.raises(ValueError, match="keys: .* is not pinned"):
        store.unpin([keep])


def test_cost_model_skips_slow_promotions_and_counts_them(make_store) -> None:
    slow_fs = CostModel({"fs": 1e6, "host": 50e9}, recompute_s_per_token=1e-6, tokens_per_block=16)
    store = make_store(device=2, host=2, cost_model=slow_fs)
    keys = [key_of(i) for i in range(6)]
    for k in keys:
        _put(store, [k])
    skipped = metric_value("kvtier_runtime_promotions_skipped_total", src="fs")
    res, outs = _load(store, keys)
    assert (res.hits, res.stopped) == (0, "skipped")
    assert metric_value("kvtier_runtime_promotions_skipped_total", src="fs") == skipped + 1
    assert torch.equal(outs[0], torch.full(SHAPE, -1.0))
    res, _ = _load(store, keys[2:])  # host and device hits are never skipped
    assert res.hits == 4 and res.stopped is None


def test_a_corrupt_file_ends_the_run_and_never_reaches_upper_tiers(make_store) -> None:
    store = make_store(device=2, host=2)
    keys = [key_of(i) for i in range(6)]
    for k in keys:
        _put(store, [k])
    fs = store.tier("fs")
    assert keys[1] in fs.keys()
    with open(fs.block_path(keys[1]), "r+b") as f:
        f.seek(8000)
        b = f.read(1)
        f.seek(8000)
        f.write(bytes([b[0] ^ 1]))
    res, outs = _load(store, keys)
    assert (res.hits, res.stopped) == (1, "corrupt")
    assert torch.equal(outs[1], torch.full(SHAPE, -1.0))
    assert keys[1] not in store.tier("host") and keys[1] not in store.tier("device")
    assert store.lookup(keys)["any"] == 1


def test_without_a_device_tier_host_is_the_top(make_store) -> None:
    store = make_store(device=None, host=2)
    keys = [key_of(i) for i in range(5)]
    assert _put(store, keys).success
    assert store.tier_names == ("host", "fs")
    res, _ = _load(store, keys)
    assert res.hits == 5


def test_bad_configuration_names_the_field(make_store, tmp_path) -> None:
    with pytest.raises(ValueError, match="write.fs"):
        make_store(write={"fs": "sometimes"})
    with pytest.raises(ValueError, match="write: 'device'"):
        make_store(write={"device": "through"})
    with pytest.raises(ValueError, match="tiers"):
        TieredStore(SHAPE, torch.float32)
    store = make_store()
    with pytest.raises(ValueError, match="blocks: a torch.float32\\[3\\] block"):
        store.put([key_of(1)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="outs: 1 tensors for 2 keys"):
        store.load([key_of(1), key_of(2)], [torch.zeros(SHAPE)])


def test_concurrent_puts_and_loads_are_consistent(make_store) -> None:
    store = make_store(device=3, host=5, fs_blocks=30)
    keys = [key_of(i) for i in range(30)]

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(40):
            batch = rnd.sample(keys, 3)
            op = rnd.random()
            if op < 0.25:
                _put(store, batch)
            elif op < 0.5:  # plans run in this thread, concurrently with the worker's
                store.put_sync(batch, [block_for(k) for k in batch])
            elif op < 0.75:
                _load(store, batch)  # asserts every hit is exact
            else:
                outs = [torch.full(SHAPE, -1.0) for _ in batch]
                res = store.load_sync(batch, outs)
                assert all(torch.equal(o, block_for(k)) for o, k in zip(outs[: res.hits], batch))

    run_in_threads(worker)
    for name in ("device", "host"):
        tier = store.tier(name)
        assert tier.used_bytes == len(tier) * NB <= tier.capacity_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tier_on_cuda_round_trips(tmp_path) -> None:
    cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=64 * block_file_bytes(),
                               eviction_policy="lru")
    with FilesystemTier(cfg, SHAPE, torch.float32) as fs, TieredStore(
            SHAPE, torch.float32, device="cuda", device_capacity_bytes=2 * NB, host_capacity_bytes=4 * NB,
            fs=fs) as store:
        assert store.tier("host").pinned_memory and store.tier("device").slab.is_cuda
        keys = [key_of(i) for i in range(8)]
        blocks = [block_for(k).cuda() for k in keys]
        assert store.put(keys, blocks).result(60).success
        assert set(fs.keys()) == set(keys[:2])  # device -> host (D2H) -> fs demotions happened
        for batch in (keys[:2], keys[6:], keys[2:4]):  # from fs (via host), from device, from host
            outs = [torch.empty(SHAPE, device="cuda") for _ in batch]
            res = store.load(batch, outs).result(60)
            assert res.hits == len(batch), res
            assert all(torch.equal(o.cpu(), block_for(k)) for o, k in zip(outs, batch))


def test_metrics_are_all_named_kvtier_runtime(make_store) -> None:
    from prometheus_client import REGISTRY, generate_latest

    store = make_store(device=2, host=2)
    keys = [key_of(i) for i in range(6)]
    for k in keys:
        _put(store, [k])
    _load(store, keys[:2])
    store.lookup(keys)
    text = generate_latest(REGISTRY).decode()
    ours = {line.split()[2].removesuffix("_total") for line in text.splitlines()
            if line.startswith("# TYPE kvtier_runtime")}
    expected = {"kvtier_runtime_lookups", "kvtier_runtime_hits", "kvtier_runtime_promotions",
                "kvtier_runtime_demotions", "kvtier_runtime_bytes_moved", "kvtier_runtime_transfer_seconds",
                "kvtier_runtime_occupancy_bytes", "kvtier_runtime_capacity_bytes", "kvtier_runtime_evictions",
                "kvtier_runtime_promotions_skipped", "kvtier_runtime_fs_errors", "kvtier_runtime_fs_backoff",
                "kvtier_runtime_stores_rejected"}
    assert expected <= ours
    from kvtier_runtime import metrics

    for obj in vars(metrics).values():
        if hasattr(obj, "_name") and hasattr(obj, "_type"):
            assert obj._name.startswith("kvtier_runtime_"), obj._name
    assert metric_value("kvtier_runtime_demotions_total", src="host", dst="fs") >= 1
    assert metric_value("kvtier_runtime_bytes_moved_total", src="device", dst="host") >= NB


def test_runtime_imports_neither_kopf_nor_kubernetes() -> None:
    import subprocess
    import sys

    # Every runtime module but the vLLM adapter (it needs vllm; tests/vllm imports it) and the __main__ entry
    # points (importing runs them), so a new module that pulls in the operator's dependencies fails here.
    code = ("import importlib, pkgutil, sys, kvtier_runtime\n"
            "names = [m.name for m in pkgutil.walk_packages(kvtier_runtime.__path__, 'kvtier_runtime.')\n"
            "         if m.name != 'kvtier_runtime.engines.vllm_adapter' and not m.name.endswith('.__main__')]\n"
            "for name in names: importlib.import_module(name)\n"
            "assert len(names) > 30, names\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes')]\n"
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    light = subprocess.run([sys.executable, "-c", "import sys, kvtier_runtime, kvtier_runtime.config, "
                            "kvtier_runtime.fs, kvtier_runtime.fs.format; print('torch' in sys.modules)"],
                           capture_output=True, text=True, env=env, check=True)
    assert light.stdout.strip() == "False", "the package, its config and the fs format must not import torch"
