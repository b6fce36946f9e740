"""The vllm-free parts of kvtier's vLLM offloading spec: the books (host tier + filesystem tiers), the shared host
region, the page copier and the spec's configuration. Real tiers on a temporary directory, real shared memory;
the engine itself is exercised in tests/engine.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from kvtier_runtime.config import ConfigError, FilesystemTierConfig, OffloadSpecConfig, RemoteTierConfig
from kvtier_runtime.engines.host_region import HostRegion, region_path, remove_stale_regions
from kvtier_runtime.engines.page_copy import PageCopier
from kvtier_runtime.fs.format import HEADER_BYTES
from kvtier_runtime.store.books import DISK, HIT, HIT_PENDING, HOST, MISS, RETRY, Found, OffloadBooks
from plugins.runtime import engine_books, seq_key

ROW = 4096


def _books(tmp_path, n_rows: int = 4, fs_capacity: int = 1 << 20, codec: str = "none"):
    cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=fs_capacity, codec=codec,
                               n_read_threads=2, n_write_threads=2)
    return engine_books(tmp_path, n_rows, ROW, [cfg], view_dtype=torch.float32 if codec != "none" else None)


def _store(books: OffloadBooks, region: HostRegion, keys: list[bytes], fill) -> None:
    out = books.prepare_store(keys)
    assert out is not None
    to_store, slots, _ = out
    for key, slot in zip(to_store, slots):
        region.rows[slot].copy_(fill(key))  # what vLLM's worker does between prepare_store and complete_store
    books.complete_store(to_store)
    books.drain()  # write-through pins the rows until the disk has them


def _fill(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:32], "big") % (2**31))
    return torch.randint(0, 255, (ROW,), generator=g, dtype=torch.uint8)


def _settle(books: OffloadBooks, key: bytes, timeout_s: float = 10.0) -> str:
    return _settle_found(books, key, timeout_s).state


def _settle_found(books: OffloadBooks, key: bytes, timeout_s: float = 10.0) -> Found:
    deadline = time.monotonic() + timeout_s
    while True:
        books.drain(timeout_s)
        found = books.find(key)
        if found.state != RETRY or time.monotonic() > deadline:
            return found


def _origin(books: OffloadBooks, found: Found) -> str:
    """Where the counted hit ``found`` was served from (host, disk, remote)."""
    assert found.served is not None, found
    return books.served_by(found.served)[1]


def test_store_then_host_hit_and_write_through(tmp_path) -> None:
    books, region = _books(tmp_path)
    keys = [seq_key(i) for i in range(3)]
    out = books.prepare_store(keys)
    assert out is not None and out[0] == keys and len(set(out[1])) == 3
    assert books.lookup(keys[0]) == HIT_PENDING  # the worker's copy is in flight
    for key, slot in zip(out[0], out[1]):
        region.rows[slot].copy_(_fill(key))
    books.complete_store(keys)
    found = [books.find(k) for k in keys]
    assert [f.state for f in found] == [HIT] * 3 and _origin(books, found[0]) == HOST
    books.drain()
    assert books.counters["fs_stores"] == 3 and len(books.tiers[0]) == 3
    slots = books.prepare_load(keys)
    assert all(torch.equal(region.rows[s], _fill(k)) for s, k in zip(slots, keys))
    # Pinned for the load: a store that needs every slot cannot evict them, and only the whole offer is stored
    # (vLLM's contract: not enough room is None, nothing changes), never the part that fits.
    assert books.prepare_store([seq_key(10 + i) for i in range(4)]) is None
    assert books.lookup(seq_key(10)) == MISS
    out = books.prepare_store([seq_key(10)])
    assert out is not None and out[0] == [seq_key(10)]
    books.complete_load(keys)
    books.close()
    region.close(unlink=True)


def test_evicted_block_is_promoted_from_disk_with_identical_bytes(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2)
    first = seq_key(1)
    _store(books, region, [first], _fill)
    books.drain()
    _store(books, region, [seq_key(2), seq_key(3)], _fill)  # evicts `first` from the 2-row host tier
    assert first not in books.host and books.counters["host_evictions"] >= 1
    assert books.lookup(first) == RETRY  # a promotion from disk started
    found = _settle_found(books, first)
    assert found.state == HIT and _origin(books, found) == DISK
    (slot,) = books.prepare_load([first])
    assert torch.equal(region.rows[slot], _fill(first))
    books.complete_load([first])
    books.close()
    region.close(unlink=True)


def test_reset_host_keeps_the_disk_copy(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=4)
    keys = [seq_key(1), seq_key(2)]
    _store(books, region, keys, _fill)
    books.prepare_load([keys[1]])  # a load in flight keeps its slot (fenced), not its key
    assert books.reset_host() == 1 and keys[0] not in books.host and keys[1] not in books.host
    assert books.fenced_slots == 1
    found = _settle_found(books, keys[0])
    assert found.state == HIT and _origin(books, found) == DISK
    books.complete_load([keys[1]])
    assert books.fenced_slots == 0
    books.close()
    region.close(unlink=True)


def test_corrupt_file_is_a_counted_miss_never_a_hit(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2)
    victim = seq_key(7)
    _store(books, region, [victim], _fill)
    books.drain()
    path = books.tiers[0].block_path(books.fs_key(victim))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 10)  # inside the payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _store(books, region, [seq_key(8), seq_key(9)], _fill)  # evict it from the host tier
    assert books.lookup(victim) == RETRY
    assert _settle(books, victim) == MISS
    assert books.load_failures["corrupt"] == 1 and victim not in books.host
    books.close()
    region.close(unlink=True)


def test_prepare_store_is_none_when_every_slot_is_pinned(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2)
    keys = [seq_key(1), seq_key(2)]
    out = books.prepare_store(keys)
    assert out is not None and out[0] == keys
    assert books.prepare_store([seq_key(3)]) is None  # both slots hold stores in flight
    books.complete_store(keys, success=False)
    assert [books.lookup(k) for k in keys] == [MISS, MISS]
    books.close()
    region.close(unlink=True)


def test_lossy_codec_round_trip_through_promotion(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2, codec="fp8")
    floats = region.rows.view(torch.float32)
    key = seq_key(5)
    out = books.prepare_store([key])
    values = torch.linspace(-2, 2, floats.shape[1])
    floats[out[1][0]].copy_(values)
    books.complete_store([key])
    books.drain()
    _store(books, region, [seq_key(6), seq_key(7)], lambda k: torch.zeros(ROW, dtype=torch.uint8))
    assert _settle(books, key) == HIT
    (slot,) = books.prepare_load([key])
    assert torch.allclose(floats[slot], values, rtol=0.07, atol=0.02)
    books.close()
    region.close(unlink=True)


def test_host_region_is_shared_and_stale_files_are_removed(tmp_path) -> None:
    shm = str(tmp_path)
    a = HostRegion(shm, "eng/1", 3, 64)
    b = HostRegion(shm, "eng/1", 3, 64)
    a.rows[2, 5] = 42
    assert int(b.rows[2, 5]) == 42 and a.path == region_path(shm, "eng/1") and "/" not in os.path.basename(a.path)
    # Held by a and b: not stale even when old.
    assert remove_stale_regions(shm, now=time.time() + 3600) == []
    a.close()
    b.close()
    assert remove_stale_regions(shm, now=time.time() + 3600) == [a.path] and not os.path.exists(a.path)


# An engine process holding its region, killed (SIGKILL: no shutdown) a moment after the front end's exit began.
_HOLDER = """
import os, signal, sys, time
from kvtier_runtime.engines.host_region import HostRegion
region = HostRegion(sys.argv[1], "killed-engine", 2, 64)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_front_end_exiting_removes_a_killed_engines_region_and_keeps_live_ones(tmp_path) -> None:
    import subprocess
    import sys

    from kvtier_runtime.engines.host_region import _remove_dead_regions

    shm = str(tmp_path)
    live = HostRegion(shm, "live-engine", 2, 64)  # another engine sharing the folder, still running
    engine = subprocess.Popen([sys.executable, "-c", _HOLDER, shm, "0.5"], stdout=subprocess.PIPE, text=True)
    # a descendant holding no region (as multiprocessing's resource tracker in vLLM's front end): not waited for
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        removed = _remove_dead_regions(shm, wait_s=10.0)
        waited = time.monotonic() - t0
    finally:
        for proc in (engine, bystander):
            proc.kill()
            proc.wait(10)
    assert removed == [region_path(shm, "killed-engine")]  # removed once its holder was gone ...
    assert 0.2 < waited < 5.0  # ... which the exit waited for, not its whole bound
    assert os.path.exists(live.path)  # (both were seconds old: a region is locked before it has its name)
    assert sorted(os.listdir(shm)) == [os.path.basename(live.path)]  # no private name of the creation left
    live.close(unlink=True)


def test_page_copier_merges_consecutive_blocks_into_runs() -> None:
    assert PageCopier.runs([(4, 0, 0), (5, 1, 0), (6, 2, 0), (9, 3, 0), (10, 9, 0)]) == [
        (4, 0, 0, 3), (9, 3, 0, 1), (10, 9, 0, 1)]
    kv = [torch.arange(20 * 8, dtype=torch.int8).view(20, 8), torch.arange(20 * 4, dtype=torch.int8).view(20, 4)]
    rows = torch.zeros(6, 12, dtype=torch.uint8)
    copier = PageCopier(kv, [8, 4], rows)
    pairs = copier.pairs([4, 5, 6, 9], [1, 2, 3, 0])
    copier.submit(1, pairs, to_host=True)
    for block, row, _ in pairs:
        assert torch.equal(rows[row, :8].view(torch.int8), kv[0][block])
        assert torch.equal(rows[row, 8:].view(torch.int8), kv[1][block])


def test_page_copier_round_trip_with_chunks_and_skip() -> None:
    torch.manual_seed(0)
    kv = [torch.randint(-128, 127, (10, 48), dtype=torch.int8), torch.randint(-128, 127, (10, 32), dtype=torch.int8)]
    rows = torch.zeros(4, 2 * (48 + 32), dtype=torch.uint8)
    copier = PageCopier(kv, [48, 32], rows, blocks_per_chunk=2)
    # Engine blocks 3, 7, 1 -> chunks 2 and 0, entering chunk 2 at its second block.
    pairs = copier.pairs([3, 7, 1], [2, 0], skip=1)
    assert pairs == [(3, 2, 1), (7, 0, 0), (1, 0, 1)]
    copier.submit(11, pairs, to_host=True)
    (done,) = copier.finished()
    assert (done.job_id, done.success, done.nbytes) == (11, True, 3 * 80)
    saved = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    copier.submit(12, copier.pairs([3, 7, 1], [2, 0], skip=1), to_host=False)
    assert [r.job_id for r in copier.finished()] == [12]
    for t, s in zip(kv, saved):
        assert torch.equal(t[[3, 7, 1]], s[[3, 7, 1]])


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("pages", [(48, 32), (40, 13)])  # int64-wide views, and odd pages that stay bytes
def test_page_copier_scattered_blocks_take_the_gather_path_with_identical_bytes(bpc, pages) -> None:
    """Scattered engine blocks (runs of one) were one copy_ per (tensor, block); the gather path moves them in two
    calls per tensor and must put every byte exactly where the per-run path puts it, both ways."""
    torch.manual_seed(1)
    kv = [torch.randint(-128, 127, (40, p), dtype=torch.int8) for p in pages]
    blocks = [31, 3, 17, 9, 25, 5, 38, 12]
    chunks = list(range(len(blocks) // bpc))[::-1]
    out = {}
    for mode in ("runs", "gather"):
        rows = torch.zeros(len(chunks) + 1, bpc * sum(pages), dtype=torch.uint8)
        copier = PageCopier(kv, list(pages), rows, blocks_per_chunk=bpc, scatter=mode)
        pairs = copier.pairs(blocks, chunks)
        gathered: list[int] = []
        real_gather = copier._gather
        copier._gather = lambda *a, gathered=gathered, real_gather=real_gather: gathered.append(1) or real_gather(*a)  # the path taken, not just the bytes
        copier.submit(1, pairs, to_host=True)
        assert bool(gathered) == (mode == "gather")
        (done,) = copier.finished()
        assert done.nbytes == len(blocks) * sum(pages)
        out[mode] = rows.clone()
        back = [torch.zeros_like(t) for t in kv]
        loader = PageCopier(back, list(pages), rows, blocks_per_chunk=bpc, scatter=mode)
        loader.submit(2, pairs, to_host=False)
        for t, b in zip(kv, back):
            assert torch.equal(b[blocks], t[blocks]) and not b[[0, 1, 2]].any()
    assert torch.equal(out["runs"], out["gather"])
    default = PageCopier(kv, list(pages), torch.zeros(8, bpc * sum(pages), dtype=torch.uint8), blocks_per_chunk=bpc)
    assert default.scatter == "runs"  # gather measured slower on CPU (page_copy's docstring)


@pytest.mark.parametrize("bpc", [1, 2])
def test_page_copier_batched_addresses_place_every_page_where_the_per_block_path_does(bpc) -> None:
    """The CUDA batched path hands vLLM's swap_blocks_batch one (src, dst, size) triple per (tensor, block). Its
    address arithmetic is checked here on host memory with a memmove standing in for the device op: the bytes must
    land exactly where the per-block copies put them, for stores and loads, chunks entered mid-way included."""
    import ctypes

    calls = []

    def memmove_batch(src, dst, sizes, is_src_access_order_any=False):
        calls.append(is_src_access_order_any)
        for s_, d_, n_ in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d_, s_, n_)

    torch.manual_seed(2)
    pages = [48, 32]
    kv = [torch.randint(-128, 127, (20, p + 16), dtype=torch.int8) for p in pages]  # padded pages: row stride > page
    blocks = [7, 2, 15, 9]
    chunks = [3, 0, 1, 2][: (len(blocks) + 1 + bpc - 1) // bpc]
    ref = torch.zeros(5, bpc * sum(pages), dtype=torch.uint8)
    got = torch.zeros_like(ref)
    per_block = PageCopier(kv, pages, ref, blocks_per_chunk=bpc, scatter="runs")
    batched = PageCopier(kv, pages, got, blocks_per_chunk=bpc, batch_copy=memmove_batch)
    skip = 1 if bpc == 2 else 0
    per_block.submit(1, per_block.pairs(blocks, chunks, skip), to_host=True)
    nbytes, _ = batched._batched(batched.pairs(blocks, chunks, skip), to_host=True)
    assert nbytes == len(blocks) * sum(pages) and torch.equal(got, ref) and calls == [False]
    back = [torch.zeros_like(t) for t in kv]
    loader = PageCopier(back, pages, got, blocks_per_chunk=bpc, batch_copy=memmove_batch)
    loader._batched(loader.pairs(blocks, chunks, skip), to_host=False)
    assert calls == [False, True]  # host -> engine reads memory no stream writes: any source order
    for t, b, p in zip(kv, back, pages):
        assert torch.equal(b[blocks, :p], t[blocks, :p]) and not b[:, p:].any()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config.cpu_bytes_to_use: required"),
        ({"cpu_bytes_to_use": "4Gi"}, "kv_connector_extra_config.cpu_bytes_to_use: '4Gi' must be a positive integer"),
        ({"cpu_bytes_to_use": 1, "host_shm_dir": "shm"}, "kv_connector_extra_config.host_shm_dir: 'shm' must be an"),
        ({"cpu_bytes_to_use": 1, "fs_tiers": [{"root_dir": "/a", "capacity_bytes": 1, "codec": "zstd"}]},
         "kv_connector_extra_config.fs_tiers[0].codec: 'zstd' is not one of"),
        ({"cpu_bytes_to_use": 1, "fs_tiers": [{"root_dir": "/a", "capacity_bytes": "10G"}]},
         "kv_connector_extra_config.fs_tiers[0].capacity_bytes: '10G' must be a positive integer"),
        ({"cpu_bytes_to_use": 1, "fs_tiers": [{"root_dir": "rel", "capacity_bytes": 1}]},
         "kv_connector_extra_config.fs_tiers[0].root_dir: 'rel' must be an absolute path"),
        ({"cpu_bytes_to_use": 1, "eviction_policy": "mru"}, "kv_connector_extra_config.eviction_policy: 'mru'"),
        ({"cpu_bytes_to_use": 1, "fs_tiers": {"root_dir": "/a"}}, "kv_connector_extra_config.fs_tiers: {'root_dir'"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://h:1"}]},
         "kv_connector_extra_config.remote_tiers[0].capacity_bytes: required"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://u:pw@h:1", "capacity_bytes": 1}]},
         "kv_connector_extra_config.remote_tiers[0].url: must not contain credentials"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://h:1", "capacity_bytes": 1, "scope": "ns",
                                                   "mac_key_file": "/k", "password_file": "p"}]},
         "kv_connector_extra_config.remote_tiers[0].password_file: 'p' must be an absolute path"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://h:1", "capacity_bytes": 1, "mac_key_file": "/k"}]},
         "kv_connector_extra_config.remote_tiers[0].scope: required: the tenant scope"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://h:1", "capacity_bytes": 1, "scope": "a:b",
                                                   "mac_key_file": "/k"}]},
         "kv_connector_extra_config.remote_tiers[0].scope: 'a:b' must be a DNS label"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": [{"url": "redis://h:1", "capacity_bytes": 1, "scope": "ns"}]},
         "kv_connector_extra_config.remote_tiers[0].mac_key_file: required: a remote tier needs remote.macKeySecret"),
        ({"cpu_bytes_to_use": 1, "remote_tiers": ["redis://h:1"]},
         "kv_connector_extra_config.remote_tiers[0]: 'redis://h:1' must be a mapping"),
    ],
)
def test_spec_config_errors_name_the_key(extra, message) -> None:
    with pytest.raises(ConfigError) as err:
        OffloadSpecConfig.from_extra_config(extra)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


REMOTE_KWARGS = {"url": "rediss://[fd00::1]:6380/2", "capacity_bytes": 1 << 34,
                 "password_file": "/etc/kvtier-remote/s/pw", "mac_key_file": "/etc/kvtier-remote/s/mac-key",
                 "scope": "team-a", "future_key": 1}


def test_spec_config_round_trip_keeps_vllms_keys() -> None:
    extra = {"spec_name": "KvtierOffloadingSpec", "block_size": 64, "cpu_bytes_to_use": 1 << 30,
             "eviction_policy": "s3fifo", "host_tier_name": "cpu", "tiers": [
                 {"name": "nvme", "medium": "filesystem",
                  "config": {"root_dir": "/d", "capacity_bytes": 1 << 40, "codec": "fp8"}}]}
    cfg = OffloadSpecConfig.from_extra_config(extra)
    assert cfg.tiers[0].config.codec == "fp8" and cfg.extra == {"spec_name": "KvtierOffloadingSpec", "block_size": 64}
    assert cfg.names == ["cpu", "nvme"]
    assert OffloadSpecConfig.from_extra_config(cfg.to_extra_config()) == cfg


def test_the_tiers_keep_the_policys_order_a_remote_tier_before_a_filesystem_tier() -> None:
    extra = {"cpu_bytes_to_use": 1 << 30, "tiers": [
        {"name": "shared", "medium": "remote", "config": REMOTE_KWARGS},
        {"name": "nvme", "medium": "filesystem", "config": {"root_dir": "/d", "capacity_bytes": 1 << 40}}]}
    cfg = OffloadSpecConfig.from_extra_config(extra)
    assert [(t.name, t.medium, t.config.address) for t in cfg.tiers] == [
        ("shared", "remote", "rediss://[fd00::1]:6380/2"), ("nvme", "filesystem", "/d")]
    assert cfg.names == ["host", "shared", "nvme"]
    assert [t["name"] for t in cfg.to_extra_config()["tiers"]] == ["shared", "nvme"]


def test_a_config_rendered_before_the_ordered_list_loads_as_the_same_tiers() -> None:
    """Two lists by medium (filesystem tiers, then remote tiers) and their names: the same tiers, in that order,
    under those names, as the ordered list renders them; written back in the ordered form."""
    old = {"cpu_bytes_to_use": 1 << 30, "tier_names": ["cpu", "nvme", "shared"],
           "fs_tiers": [{"root_dir": "/d", "capacity_bytes": 1 << 40}], "remote_tiers": [REMOTE_KWARGS]}
    new = {"cpu_bytes_to_use": 1 << 30, "host_tier_name": "cpu", "tiers": [
        {"name": "nvme", "medium": "filesystem", "config": {"root_dir": "/d", "capacity_bytes": 1 << 40}},
        {"name": "shared", "medium": "remote", "config": REMOTE_KWARGS}]}
    cfg = OffloadSpecConfig.from_extra_config(old)
    assert cfg == OffloadSpecConfig.from_extra_config(new)
    assert set(cfg.to_extra_config()) == {"cpu_bytes_to_use", "eviction_policy", "admission", "host_tier_name",
                                          "tiers"}
    # Without names, as the oldest configs: each tier by its address.
    unnamed = OffloadSpecConfig.from_extra_config({k: v for k, v in old.items() if k != "tier_names"})
    assert unnamed.names == ["host", "/d", "rediss://[fd00::1]:6380/2"]
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config.fs_tiers: the tiers are in 'tiers'"):
        OffloadSpecConfig.from_extra_config({**new, "fs_tiers": old["fs_tiers"]})


@pytest.mark.parametrize(("tiers", "message"), [
    ({"name": "x"}, "tiers: {'name': 'x'} must be a list of tiers"),
    ([{"name": "x", "medium": "tape", "config": {}}], "tiers[0].medium: 'tape' is not one of filesystem, remote"),
    ([{"name": "x", "medium": "filesystem"}], "tiers[0].config: required"),
    ([{"name": "", "medium": "filesystem", "config": {"root_dir": "/d", "capacity_bytes": 1}}],
     "tiers[0].name: '' must be a non-empty name"),
    ([{"name": "x", "medium": "filesystem", "config": {"root_dir": "/d", "capacity_bytes": 1}, "size": 1}],
     "tiers[0].size: not a tier key"),
    ([{"name": "x", "medium": "remote", "config": {"url": "redis://h:1"}}], "tiers[0].config.capacity_bytes: required"),
    ([{"name": "host", "medium": "filesystem", "config": {"root_dir": "/d", "capacity_bytes": 1}}],
     "tiers: names ['host', 'host'] (the host tier's first) must be distinct"),
    ([{"name": f"t{i}", "medium": "filesystem", "config": {"root_dir": f"/d{i}", "capacity_bytes": 1}}
      for i in range(17)], "tiers: 17 tiers, at most 16"),
])
def test_ordered_tier_errors_name_the_entry_and_the_key(tiers, message) -> None:
    with pytest.raises(ConfigError) as err:
        OffloadSpecConfig.from_extra_config({"cpu_bytes_to_use": 1, "tiers": tiers})
    assert str(err.value).startswith("kv_connector_extra_config." + message), str(err.value)


def test_remote_tier_config_round_trips_and_keeps_unknown_keys() -> None:
    extra = {"cpu_bytes_to_use": 1 << 30, "tiers": [{"name": "shared", "medium": "remote", "config": REMOTE_KWARGS}]}
    cfg = OffloadSpecConfig.from_extra_config(extra)
    (entry,) = cfg.tiers
    remote = entry.config
    assert isinstance(remote, RemoteTierConfig)
    assert remote.codec == "none" and remote.username is None and remote.extra == {"future_key": 1}
    assert remote.scope == "team-a" and remote.mac_key_file == "/etc/kvtier-remote/s/mac-key"
    assert cfg.to_extra_config()["tiers"] == extra["tiers"]  # defaults are not written out


@pytest.mark.cuda
def test_page_copier_on_cuda_uses_a_side_stream_and_events() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(1)
    kv = [torch.randint(-128, 127, (64, 4096), dtype=torch.int8, device="cuda") for _ in range(4)]
    rows = torch.zeros(64, 4 * 4096, dtype=torch.uint8).pin_memory()
    copier = PageCopier(kv, [4096] * 4, rows)
    assert copier._stream is not None and copier._stream != torch.cuda.current_stream()
    pairs = copier.pairs(list(range(64)), list(range(64)))
    copier.submit(1, pairs, to_host=True)
    copier.wait({1})
    assert [r.job_id for r in copier.finished()] == [1]
    saved = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    copier.submit(2, pairs, to_host=False)
    deadline = time.monotonic() + 10
    done = []
    while not done and time.monotonic() < deadline:  # completion is polled, never waited for
        done = copier.finished()
    assert [r.job_id for r in done] == [2]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(kv, saved))


@pytest.mark.cuda
def test_page_copier_on_cuda_batched_path_round_trips_through_vllms_swap_blocks_batch() -> None:
    """The CUDA batched path with vLLM's real op: one swap_blocks_batch call per job, engine pages -> pinned host
    rows -> engine pages, every byte back in place (needs a CUDA build of vllm; run by bench/gpu_check.sh)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM's CUDA ops are needed for the batched path")
    op = getattr(ops, "swap_blocks_batch", None)
    if op is None:
        pytest.skip("this vLLM has no swap_blocks_batch")
    torch.manual_seed(3)
    pages = [4096, 4096]
    kv = [torch.randint(-128, 127, (64, p), dtype=torch.int8, device="cuda") for p in pages]
    rows = torch.zeros(16, sum(pages), dtype=torch.uint8).pin_memory()
    copier = PageCopier(kv, pages, rows, batch_copy=op)
    blocks = [40, 3, 17, 9, 25, 5, 38, 12]
    pairs = copier.pairs(blocks, list(range(8)))
    copier.submit(1, pairs, to_host=True)
    copier.wait({1})
    assert [r.job_id for r in copier.finished()] == [1]
    for t, off, p in zip(kv, (0, pages[0]), pages):
        assert torch.equal(rows[:8, off:off + p].view(torch.int8), t[blocks].cpu())
    saved = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    copier.submit(2, pairs, to_host=False)
    copier.wait({2})
    copier.finished()
    for t, s in zip(kv, saved):
        assert torch.equal(t[blocks], s[blocks])


def test_settled_lookups_count_hits_per_tier_that_served_them(tmp_path) -> None:
    """What the spec exports as hit_tokens{tier} / lookup_tokens: a lookup counts once settled (hit or miss, not
    the retries and pending answers vLLM asks again after), and a hit counts for the tier that held the bytes --
    the first hit after a promotion for the tier it came from, later ones for the host tier."""
    books, region = _books(tmp_path, n_rows=2)
    host, disk = books.breakers[0].name, books.breakers[1].name
    first = seq_key(1)
    out = books.prepare_store([first])
    assert books.lookup(first) == HIT_PENDING  # not settled: not counted
    assert books.counters["lookup_keys"] == 0
    region.rows[out[1][0]].copy_(_fill(first))
    books.complete_store([first])
    books.drain()
    assert books.lookup(first) == HIT and books.lookup(seq_key(99)) == MISS
    assert books.counters["lookup_keys"] == 2 and books.hit_keys == {host: 1}
    _store(books, region, [seq_key(2), seq_key(3)], _fill)  # evicts `first` from the 2-row host tier
    assert books.lookup(first) == RETRY and books.counters["lookup_keys"] == 2
    found = _settle_found(books, first)
    assert found.state == HIT and _origin(books, found) == DISK
    assert books.hit_keys == {host: 1, disk: 1} and books.counters["lookup_keys"] == 3
    # Already in the host tier: the host tier serves it now, and the served tier the spec reports as vLLM's load
    # source (and records) says so too -- the counters and the load source are one rule.
    again = books.find(first)
    assert again.state == HIT and _origin(books, again) == HOST
    assert books.hit_keys == {host: 2, disk: 1} and books.counters["lookup_keys"] == 4
    assert books.find(first, count=False) == Found(HIT)  # a repeat the caller already counted: no tier named
    books.close()
    region.close(unlink=True)


def test_a_promoted_chunk_evicted_before_its_hit_is_not_counted_for_its_tier_later(tmp_path) -> None:
    books, region = _books(tmp_path, n_rows=2)
    disk = books.breakers[1].name
    first = seq_key(1)
    _store(books, region, [first], _fill)
    _store(books, region, [seq_key(2), seq_key(3)], _fill)
    assert books.lookup(first) == RETRY
    books.drain()
    books.poll()
    assert first in books._promoted_from
    _store(books, region, [seq_key(4), seq_key(5)], _fill)  # evicts the promoted chunk before any hit
    assert first not in books.host and first not in books._promoted_from
    assert books.hit_keys[disk] == 0
    books.close()
    region.close(unlink=True)


@pytest.mark.parametrize("bpc", [1, 2])
def test_page_copier_cpu_runs_go_through_numpy_views_with_the_bytes_of_torch_copies(bpc) -> None:
    """On CPU the per-run copies are numpy slice assignments (a microsecond of overhead against several for torch's
    views and copy_); every byte must land where torch's copy_ path puts it, for stores and loads, with padded
    engine pages (row stride > page), consecutive runs and scattered blocks, chunks entered mid-way."""
    torch.manual_seed(3)
    pages = [48, 40]
    kv = [torch.randint(-128, 127, (24, p + 8), dtype=torch.int8) for p in pages]
    blocks = [4, 5, 6, 19, 2, 11, 12, 7]
    chunks = [0, 1, 2, 7, 3, 5, 6, 4]  # one block per chunk: runs of 3 and 2 blocks, and single blocks
    skip = 1 if bpc == 2 else 0
    stored = {}
    for path in ("numpy", "torch"):
        rows = torch.zeros(8, bpc * sum(pages), dtype=torch.uint8)
        copier = PageCopier(kv, pages, rows, blocks_per_chunk=bpc)
        assert copier._np_views is not None  # numpy is a dependency: CPU copiers get the views
        if path == "torch":
            copier._np_views = None
        pairs = copier.pairs(blocks, chunks, skip)
        assert bpc > 1 or [r[3] for r in copier.runs(pairs)] == [3, 1, 1, 2, 1]
        copier.submit(1, pairs, to_host=True)
        (done,) = copier.finished()
        assert done.nbytes == len(blocks) * sum(pages)
        stored[path] = rows.clone()
        back = [torch.zeros_like(t) for t in kv]
        loader = PageCopier(back, pages, rows, blocks_per_chunk=bpc)
        if path == "torch":
            loader._np_views = None
        loader.submit(2, pairs, to_host=False)
        for t, b, p in zip(kv, back, pages):
            assert torch.equal(b[blocks, :p], t[blocks, :p]) and not b[:, p:].any()
            assert not b[[i for i in range(24) if i not in blocks]].any()
    assert torch.equal(stored["numpy"], stored["torch"]) and stored["numpy"].any()


def test_page_copier_rejects_block_and_row_ids_outside_the_tensors_before_copying() -> None:
    # numpy slices clip an out-of-range id instead of failing: the ids are checked first, and nothing is copied.
    kv = [torch.ones(10, 8, dtype=torch.int8)]
    rows = torch.zeros(4, 8, dtype=torch.uint8)
    copier = PageCopier(kv, [8], rows)
    for pairs, field_name in (([(3, 0, 0), (10, 1, 0)], "engine block ids"), ([(-1, 0, 0)], "engine block ids"),
                              ([(3, 0, 0), (4, 4, 0)], "host row ids")):
        with pytest.raises(ValueError, match=field_name):
            copier.submit(1, pairs, to_host=True)
        assert not rows.any()
