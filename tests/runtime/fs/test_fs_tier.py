"""The filesystem tier: round trips, restart recovery, fault injection, bounds, concurrency, non-blocking API.

Faults are real where they can be (bytes flipped and files truncated on disk, a real full tmpfs, a writer
process killed with SIGKILL); ENOSPC/EIO on a healthy disk are injected through the tier's FileOps seam.
"""
from __future__ import annotations

import errno
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.fs import FilesystemTier, KeyState
from kvtier_runtime.fs.fileio import FileOps
from kvtier_runtime.fs.format import HEADER_BYTES
from kvtier_runtime.fs.paths import NAMESPACE
from kvtier_runtime.tiers.queued import QueuedTier
from plugins.runtime import block_file_bytes, block_for, key_of, metric_value, run_in_threads, sentinel
from plugins.tier_sync import load_blocks, store_blocks, wait_job

SHAPE = (64, 256)


def _store(tier, keys):
    return store_blocks(tier, keys, [block_for(k) for k in keys])


def _files(tier):
    out = []
    for d, _, names in os.walk(tier.root):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def _errors(kind: str) -> float:
    return metric_value("kvtier_runtime_fs_errors_total", tier="fs", kind=kind)


def test_round_trip_and_restart_recovery(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    keys = [key_of(i) for i in range(6)]
    assert _store(tier, keys).success
    assert tier.lookup(keys).hits == 6 and len(tier) == 6
    assert tier.used_bytes == 6 * block_file_bytes(SHAPE) == sum(os.path.getsize(f) for f in _files(tier))
    tier.close()

    again = fs_tier_factory()
    assert again.rebuild_stats["blocks"] == 6
    assert again.used_bytes == 6 * block_file_bytes(SHAPE)
    outs = [sentinel() for _ in keys]
    assert load_blocks(again, keys, outs).success
    for k, out in zip(keys, outs):
        assert torch.equal(out, block_for(k))


def test_lookup_is_a_prefix_run(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    keys = [key_of(i) for i in range(4)]
    _store(tier, [keys[0], keys[1], keys[3]])
    run = tier.lookup(keys)
    assert (run.hits, run.pending) == (2, False)
    assert tier.state(keys[2]) is KeyState.MISS and tier.state(keys[3]) is KeyState.HIT


@pytest.mark.parametrize("where", ["payload", "header", "padding-length"])
def test_flipped_byte_is_a_counted_miss_and_deleted(fs_tier_factory, where: str) -> None:
    tier = fs_tier_factory()
    key = key_of(1)
    _store(tier, [key])
    path = tier.block_path(key)
    with open(path, "r+b") as f:
        if where == "payload":
            f.seek(HEADER_BYTES + 5000)
        elif where == "header":
            f.seek(200)
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 4096)  # a longer file than its header says
            f.seek(HEADER_BYTES + 1)
            b = f.read(1)
            f.seek(HEADER_BYTES + 1)
            f.write(b)
        if where != "padding-length":
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    before = _errors("corrupt")
    out = sentinel()
    res = load_blocks(tier, [key], [out])
    assert not res.success and res.errors == {0: "corrupt"}
    assert torch.equal(out, sentinel()), "never wrong data: the destination is untouched"
    assert _errors("corrupt") == before + 1
    assert not os.path.exists(path) and tier.state(key) is KeyState.MISS and tier.used_bytes == 0


def test_truncated_and_deleted_files_are_misses(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    a, b = key_of(1), key_of(2)
    _store(tier, [a, b])
    os.truncate(tier.block_path(a), HEADER_BYTES + 100)
    os.unlink(tier.block_path(b))
    t0, m0 = _errors("truncated"), _errors("missing")
    res = load_blocks(tier, [a, b], [sentinel(), sentinel()])
    assert res.ok == (False, False) and res.errors == {0: "truncated", 1: "missing"}
    assert (_errors("truncated"), _errors("missing")) == (t0 + 1, m0 + 1)
    assert tier.lookup([a]).hits == 0 and tier.lookup([b]).hits == 0 and tier.used_bytes == 0
    assert _files(tier) == []


def test_a_file_holding_another_key_is_a_mismatch(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    a, b = key_of(1), key_of(2)
    _store(tier, [a, b])
    os.replace(tier.block_path(b), tier.block_path(a))  # a's name now holds b's block
    out = sentinel()
    res = load_blocks(tier, [a], [out])
    assert res.errors == {0: "mismatch"} and torch.equal(out, sentinel())


def test_restart_removes_torn_foreign_and_corrupt_files_only_in_its_namespace(fs_tier_factory, tmp_path) -> None:
    tier = fs_tier_factory()
    keys = [key_of(i) for i in range(4)]
    _store(tier, keys)
    tier.close()
    root = tmp_path / "fs"
    ns = root / NAMESPACE
    good = tier.block_path(keys[0])
    torn = good + ".tmp.999.1"
    with open(torn, "wb") as f:
        f.write(b"half a block")
    foreign = os.path.join(os.path.dirname(good), "notes.txt")
    with open(foreign, "w") as f:
        f.write("x")
    os.truncate(tier.block_path(keys[1]), 5000)
    with open(tier.block_path(keys[2]), "r+b") as f:
        f.write(b"NOTMAGIC")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    os.symlink(outside, ns / "zz")  # a fan-out entry pointing outside the root
    user_file = root / "user-file"
    user_file.write_text("not ours")

    t0 = _errors("torn")
    again = fs_tier_factory()
    st = again.rebuild_stats
    assert (st["blocks"], st["tmp"], st["truncated"], st["foreign"]) == (2, 1, 1, 3)
    assert again.keys() and set(again.keys()) == {keys[0], keys[3]}
    assert not os.path.exists(torn) and not os.path.exists(foreign) and not os.path.lexists(ns / "zz")
    assert (outside / "precious").read_text() == "keep" and user_file.read_text() == "not ours"
    assert _errors("torn") == t0 + 1


def test_restart_with_another_block_shape_drops_mismatched_blocks(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    _store(tier, [key_of(1)])
    tier.close()
    other = fs_tier_factory(shape=(32, 256))
    assert other.rebuild_stats["mismatch"] == 1 and len(other) == 0


def test_capacity_is_a_byte_bound_with_eviction(fs_tier_factory) -> None:
    tier = fs_tier_factory(capacity_blocks=3)
    keys = [key_of(i) for i in range(8)]
    for k in keys:
        assert _store(tier, [k]).success
    assert len(tier) == 3 and tier.used_bytes <= tier.capacity_bytes
    assert set(tier.keys()) == set(keys[-3:])  # LRU
    assert len(_files(tier)) == 3


def test_pinned_blocks_are_not_evicted_and_a_full_pinned_tier_refuses(fs_tier_factory) -> None:
    tier = fs_tier_factory(capacity_blocks=2)
    a, b, c = key_of(1), key_of(2), key_of(3)
    _store(tier, [a, b])
    assert tier.pin(a) and tier.pin(b)
    res = _store(tier, [c])
    assert res.errors == {0: "no-room"}
    tier.unpin(b)
    assert _store(tier, [c]).success and set(tier.keys()) == {a, c}


def test_bad_input_is_rejected_with_the_field_named(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    with pytest.raises(ValueError, match="blocks: 1 blocks for 2 keys"):
        tier.submit_store([key_of(1), key_of(2)], [block_for(key_of(1))])
    with pytest.raises(ValueError, match="key"):
        tier.submit_store([b""], [block_for(b"x")])
    res = store_blocks(tier, [key_of(1)], [torch.zeros(3, 3)])
    assert res.errors == {0: "mismatch"}


def test_constructed_from_the_vllm_tier_kwargs(tmp_path) -> None:
    kwargs = {"root_dir": str(tmp_path), "capacity_bytes": 1 << 30, "codec": "none", "eviction_policy": "s3fifo",
              "n_read_threads": 2, "n_write_threads": 2, "locality": "node"}
    with FilesystemTier.from_kwargs(kwargs, SHAPE, torch.float32) as tier:
        assert tier.config.extra == {"locality": "node"} and tier.capacity_bytes == 1 << 30
        assert _store(tier, [key_of(1)]).success


class _Faulty(FileOps):
    """Fails writes or reads with a chosen errno while ``fail`` is set; counts calls."""

    def __init__(self) -> None:
        self.fail_write: int | None = None
        self.fail_read: int | None = None
        self.writes = 0

    def write(self, fd, data):
        self.writes += 1
        if self.fail_write is not None:
            raise OSError(self.fail_write, os.strerror(self.fail_write))
        return super().write(fd, data)

    def readinto(self, fd, buf, offset):
        if self.fail_read is not None:
            raise OSError(self.fail_read, os.strerror(self.fail_read))
        return super().readinto(fd, buf, offset)


def test_enospc_fails_stores_then_backs_off_then_recovers(fs_tier_factory) -> None:
    ops = _Faulty()
    now = [1000.0]
    tier = fs_tier_factory(file_ops=ops, clock=lambda: now[0], backoff_after=3, backoff_base_s=5.0)
    e0 = _errors("enospc")
    ops.fail_write = errno.ENOSPC
    for i in range(3):
        res = _store(tier, [key_of(i)])
        assert res.errors == {0: "enospc"}
    assert _errors("enospc") == e0 + 3
    assert tier.in_backoff and metric_value("kvtier_runtime_fs_backoff", tier="fs") == 1
    assert tier.used_bytes == 0 and _files(tier) == [], "failed stores leave neither files nor reservations"
    writes = ops.writes
    rej = metric_value("kvtier_runtime_stores_rejected_total", tier="fs", reason="backoff")
    assert _store(tier, [key_of(9)]).errors == {0: "backoff"}
    assert ops.writes == writes, "no I/O is attempted while backing off"
    assert metric_value("kvtier_runtime_stores_rejected_total", tier="fs", reason="backoff") == rej + 1
    ops.fail_write = None
    now[0] += 6.0
    assert _store(tier, [key_of(9)]).success
    assert not tier.in_backoff and metric_value("kvtier_runtime_fs_backoff", tier="fs") == 0


def test_eio_on_write_and_read(fs_tier_factory) -> None:
    ops = _Faulty()
    tier = fs_tier_factory(file_ops=ops)
    a, b = key_of(1), key_of(2)
    assert _store(tier, [a]).success
    ops.fail_write = errno.EIO
    assert _store(tier, [b]).errors == {0: "eio"}
    ops.fail_write = None
    ops.fail_read = errno.EIO
    e0 = _errors("eio")
    out = sentinel()
    assert load_blocks(tier, [a], [out]).errors == {0: "eio"} and torch.equal(out, sentinel())
    assert _errors("eio") == e0 + 1 and tier.state(a) is KeyState.MISS


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs, so ENOSPC comes from the kernel (needs root; skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_disk_full_on_tmpfs(fs_tier_factory, small_tmpfs) -> None:
    # The tier's capacity says 64 blocks of 68 KiB, the disk holds 1 MiB: the kernel's ENOSPC must surface as
    # failed stores, never as an exception, leave no partial files, and make the tier evict its own coldest
    # blocks so that it keeps working at the disk's real size.
    tier = fs_tier_factory(capacity_blocks=64, root=small_tmpfs, backoff_after=1000)
    keys = [key_of(i) for i in range(40)]
    res = _store(tier, keys)
    assert 0 < sum(res.ok) < len(keys) and set(res.errors.values()) == {"enospc"}
    assert not any(".tmp." in f for f in _files(tier))
    assert tier.used_bytes == sum(os.path.getsize(f) for f in _files(tier))
    later = [key_of(100 + i) for i in range(5)]
    for k in later:  # a store that hits ENOSPC frees two blocks of the tier's own, so a retry fits
        assert _store(tier, [k]).success or _store(tier, [k]).success
    held = tier.keys()
    assert set(later) <= set(held)
    outs = [sentinel() for _ in held]
    assert load_blocks(tier, held, outs).success
    assert all(torch.equal(o, block_for(k)) for o, k in zip(outs, held))


_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.fs import FilesystemTier
    from kvtier_runtime.fs.fileio import FileOps
    from plugins.runtime import block_for, key_of
    from plugins.tier_sync import store_blocks

    class Slow(FileOps):  # writes 4 KiB at a time so the kill lands inside a write
        def write(self, fd, data):
            time.sleep(0.002)
            return super().write(fd, data[:4096])

    cfg = FilesystemTierConfig(root_dir=sys.argv[1], capacity_bytes=1 << 30, eviction_policy="lru",
                               n_write_threads=2)
    tier = FilesystemTier(cfg, (64, 256), torch.float32, file_ops=Slow())
    for i in range(1000):
        store_blocks(tier, [key_of(i)], [block_for(key_of(i))])
""")


@pytest.mark.slow
def test_kill_9_writer_mid_write_then_restart(fs_tier_factory, tmp_path) -> None:
    root = str(tmp_path / "fs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, root], env=env, cwd=pathlib.Path(__file__).resolve().parents[2])  # tests/: the writer imports plugins
    ns = os.path.join(root, NAMESPACE)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            names = [n for _, _, ns_names in os.walk(ns) for n in ns_names] if os.path.isdir(ns) else []
            if sum(n.endswith(".kvb") for n in names) >= 3 and any(".tmp." in n for n in names):
                break
            time.sleep(0.005)
        else:
            pytest.fail("the writer never had a block in flight")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tier = fs_tier_factory(root=root)
    assert tier.rebuild_stats["tmp"] >= 1 and tier.rebuild_stats["blocks"] >= 3
    keys = tier.keys()
    outs = [sentinel() for _ in keys]
    assert load_blocks(tier, keys, outs).success
    assert all(torch.equal(o, block_for(k)) for o, k in zip(outs, keys))
    assert not any(".tmp." in f for f in _files(tier))


def test_concurrent_stores_and_loads_never_return_wrong_bytes(fs_tier_factory) -> None:
    tier = fs_tier_factory(capacity_blocks=12)
    keys = [key_of(i) for i in range(40)]
    served = [0]

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(60):
            batch = rnd.sample(keys, 3)
            if rnd.random() < 0.5:
                store_blocks(tier, batch, [block_for(k) for k in batch])
            else:
                outs = [sentinel() for _ in batch]
                res = load_blocks(tier, batch, outs)
                for k, ok, o in zip(batch, res.ok, outs):
                    if ok:
                        assert torch.equal(o, block_for(k))
                        served[0] += 1
                    else:
                        assert torch.equal(o, sentinel())

    run_in_threads(worker)
    assert served[0] > 0
    tier.drain()
    files = _files(tier)
    assert len(files) == len(tier) <= 12
    assert tier.used_bytes == sum(os.path.getsize(f) for f in files)


def test_non_blocking_api_reports_pending_and_completes_by_polling(fs_tier_factory) -> None:
    gate, armed = threading.Event(), threading.Event()

    class Gated(FileOps):  # a disk that hangs until the test lets it go
        def write(self, fd, data):
            if armed.is_set():
                gate.wait(10)
            return super().write(fd, data)

    done: list = []
    tier = fs_tier_factory(file_ops=Gated(), on_complete=done.append)
    armed.set()
    key = key_of(1)
    t0 = time.perf_counter()
    job = tier.submit_store([key], [block_for(key)])
    assert time.perf_counter() - t0 < 0.5, "submit must not wait for the disk"
    assert tier.state(key) is KeyState.PENDING
    assert tier.lookup([key]) == type(tier.lookup([key]))(0, True)
    res = load_blocks(tier, [key], [sentinel()])
    assert res.errors == {0: "miss"}, "a block is not served before it is durable"
    # (one call: a second get_finished() would return [] and pass whatever the first one held)
    assert all(r.job_id != job for r in tier.get_finished()), "a job is not finished while its write hangs"
    gate.set()
    deadline = time.monotonic() + 10
    finished = []
    while not finished and time.monotonic() < deadline:
        finished = [r for r in tier.get_finished() if r.job_id == job]
        time.sleep(0.01)
    assert finished and finished[0].success and done and any(r.job_id == job for r in done)
    assert tier.state(key) is KeyState.HIT


def test_storing_a_present_key_is_a_noop(fs_tier_factory) -> None:
    ops = _Faulty()
    tier = fs_tier_factory(file_ops=ops)
    _store(tier, [key_of(1)])
    n = ops.writes
    assert _store(tier, [key_of(1)]).success and ops.writes == n


def test_doorkeeper_admission_stores_on_the_second_offer(fs_tier_factory) -> None:
    tier = fs_tier_factory(admission="doorkeeper")
    key = key_of(1)
    first = _store(tier, [key])
    assert first.errors == {0: "not-admitted"} and tier.state(key) is KeyState.MISS
    assert _store(tier, [key]).success


def test_buffered_fallback_when_o_direct_is_refused(fs_tier_factory) -> None:
    class NoDirect(FileOps):  # what a filesystem without O_DIRECT answers
        def open(self, path, flags, mode=0o644):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().open(path, flags, mode)

    tier = fs_tier_factory(file_ops=NoDirect())
    assert tier.direct_io is False
    keys = [key_of(i) for i in range(3)]
    assert _store(tier, keys).success
    outs = [sentinel() for _ in keys]
    assert load_blocks(tier, keys, outs).success and all(torch.equal(o, block_for(k)) for o, k in zip(outs, keys))


def test_a_lossy_codec_stores_smaller_files_within_its_error_budget(fs_tier_factory) -> None:
    tier = fs_tier_factory(codec="int8")
    key = key_of(1)
    assert _store(tier, [key]).success
    assert os.path.getsize(tier.block_path(key)) < block_file_bytes(SHAPE, "none") / 2
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success
    ref = block_for(key)
    assert (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item() <= 0.03


def test_codec_fallback_to_a_wider_encoding_is_accounted_at_its_real_size(fs_tier_factory) -> None:
    from kvtier_runtime.codecs import get_codec

    strict = get_codec("int8", fallback=True, error_budget=1e-9)  # every block falls back to "none"
    tier = fs_tier_factory(capacity_blocks=3, codec="int8", codec_obj=strict)
    keys = [key_of(i) for i in range(5)]
    for k in keys:
        assert _store(tier, [k]).success
    files = _files(tier)
    assert all(os.path.getsize(f) == block_file_bytes(SHAPE, "none") for f in files)
    assert tier.used_bytes == sum(os.path.getsize(f) for f in files) <= tier.capacity_bytes
    outs = [sentinel() for _ in range(len(tier.keys()))]
    assert load_blocks(tier, tier.keys(), outs).success
    assert all(torch.equal(o, block_for(k)) for o, k in zip(outs, tier.keys()))


def test_lookups_do_not_reorder_eviction_but_loads_do(fs_tier_factory) -> None:
    tier = fs_tier_factory(capacity_blocks=2)  # LRU
    a, b, c, d = (key_of(i) for i in range(4))
    _store(tier, [a, b])
    for _ in range(5):
        assert tier.lookup([a]).hits == 1
    _store(tier, [c])
    assert set(tier.keys()) == {b, c}, "a waiting request's repeated lookups are not accesses"
    assert load_blocks(tier, [b], [sentinel()]).success
    _store(tier, [d])
    assert set(tier.keys()) == {b, d}, "a load is an access"


def test_a_fanout_directory_removed_behind_the_tier_is_recreated(fs_tier_factory) -> None:
    import shutil

    tier = fs_tier_factory()
    a = key_of(1)
    _store(tier, [a])
    shutil.rmtree(os.path.dirname(os.path.dirname(tier.block_path(a))))
    tier.remove(a)  # the file is already gone; forgetting it must not fail either
    assert _store(tier, [a]).success and os.path.exists(tier.block_path(a))


def test_evictions_count_only_blocks_the_policy_chose(fs_tier_factory) -> None:
    # vLLM's "evicted chunks" metric is derived from this counter: a corrupt file dropped on read or an
    # explicit remove is not an eviction.
    tier = fs_tier_factory(capacity_blocks=2)
    a, b, c = key_of(1), key_of(2), key_of(3)
    e0 = metric_value("kvtier_runtime_evictions_total", tier="fs")
    _store(tier, [a, b])
    assert tier.remove(a)
    os.truncate(tier.block_path(b), HEADER_BYTES + 10)
    assert not load_blocks(tier, [b], [sentinel()]).success
    assert metric_value("kvtier_runtime_evictions_total", tier="fs") == e0
    for k in (a, b, c):  # three blocks into room for two: one eviction
        assert _store(tier, [k]).success
    assert metric_value("kvtier_runtime_evictions_total", tier="fs") == e0 + 1


def test_an_unusable_destination_fails_the_key_and_keeps_the_block(fs_tier_factory) -> None:
    # A destination the codec cannot decode into is the caller's fault, not the file's: the block must not be
    # classed as corrupt and deleted.
    tier = fs_tier_factory()
    key = key_of(1)
    _store(tier, [key])
    strided = torch.empty(SHAPE[1], SHAPE[0]).t()  # the tier's shape, not contiguous
    assert load_blocks(tier, [key], [strided]).errors == {0: "mismatch"}
    assert tier.state(key) is KeyState.HIT and os.path.exists(tier.block_path(key))
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))


def test_jobs_after_close_are_refused_before_anything_is_reserved(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    tier.close()
    key = key_of(1)
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_store([key], [block_for(key)])
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_load([key], [sentinel()])
    assert tier.state(key) is KeyState.MISS and tier.used_bytes == 0


def test_a_block_being_written_cannot_be_pinned_so_a_failed_write_still_settles(fs_tier_factory) -> None:
    # A pin taken during the write used to make the failed write's cleanup raise PinnedEntryError in the pool
    # thread: the job never finished and a waiter without a timeout hung for ever.
    gate, armed = threading.Event(), threading.Event()

    class FailsLate(FileOps):
        def write(self, fd, data):
            if not armed.is_set():  # the O_DIRECT probe at construction
                return super().write(fd, data)
            gate.wait(10)
            raise OSError(errno.EIO, "injected")

    tier = fs_tier_factory(file_ops=FailsLate())
    armed.set()
    key = key_of(1)
    job = tier.submit_store([key], [block_for(key)])
    assert tier.state(key) is KeyState.PENDING
    assert not tier.pin(key), "only a ready block can be pinned; the write holds its own pin"
    gate.set()
    assert wait_job(tier, job, timeout=10).errors == {0: "eio"}
    assert tier.state(key) is KeyState.MISS and tier.used_bytes == 0


def test_the_tier_is_built_from_helpers_that_share_no_mutable_state(fs_tier_factory) -> None:
    """The index, the block I/O and the tier itself each keep their own dicts, sets and lists: what they share
    is only the objects passed to both on purpose (the fan-out directories, the file operations, the job lock),
    so one helper can change without reaching into another's state. A mixin over one shared index breaks this."""
    tier = fs_tier_factory()
    # The tier is composed, not assembled from mixins: its one base is the job plumbing every tier serves from its
    # own job queue (tier.jobs), which holds no state of its own.
    assert FilesystemTier.__bases__ == (QueuedTier,)
    assert QueuedTier.__bases__ == (object,) and "__init__" not in vars(QueuedTier)
    assert all(callable(v) for k, v in vars(QueuedTier).items() if not k.startswith("__")), "only methods"
    _store(tier, [key_of(1)])
    containers = (dict, set, list, bytearray, threading.local)  # threading.local: the staging buffers

    def owned(obj) -> dict[int, str]:
        return {id(v): k for k, v in vars(obj).items() if isinstance(v, containers)}

    index, io, own = owned(tier.index), owned(tier.io), owned(tier)
    assert index and io, "each helper holds state of its own"
    assert set(index) & set(io) == set() and set(index) & set(own) == set() and set(io) & set(own) == set()
    # What both helpers hold on purpose, and nothing else of each other's.
    assert vars(tier.index)["_dirs"] is vars(tier.io)["_dirs"] and tier.index.lock is tier.jobs.lock
    assert not any(v is tier.io for v in vars(tier.index).values())
    assert not any(v is tier.index for v in vars(tier.io).values())


def test_an_unexpected_fault_in_an_io_task_still_finishes_the_job(fs_tier_factory, monkeypatch) -> None:
    tier = fs_tier_factory()
    real = tier._update_occupancy

    def broken() -> None:  # a bug after the I/O, in a pool thread only
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("injected")
        real()

    monkeypatch.setattr(tier, "_update_occupancy", broken)
    res = _store(tier, [key_of(1)])
    assert res.errors == {0: "other"}, "the job finishes (failed) instead of hanging its waiter"


def _du_bytes(root: str) -> int:
    """Disk usage as the kubelet measures an emptyDir: every file and directory under root, in allocated blocks."""
    total = os.lstat(root).st_blocks * 512
    for d, dirs, names in os.walk(root):
        total += sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for n in dirs + names)
    return total


def test_a_full_tier_stays_within_its_capacity_directories_included(tmp_path) -> None:
    # A volume limit (an emptyDir's sizeLimit) counts the fan-out directories too: once, a 32 MiB tier of 36 KiB
    # files used 50.5 MB, because its directories were neither counted nor removed, and the kubelet evicted the pod.
    from kvtier_runtime.fs.tier import FilesystemTier

    volume = tmp_path / "volume"
    volume.mkdir()
    capacity = 4 << 20
    tier = FilesystemTier(FilesystemTierConfig(root_dir=str(volume), capacity_bytes=capacity, n_read_threads=2,
                                               n_write_threads=2), SHAPE, torch.float32)
    try:
        for round_ in range(20):  # ~15x the tier's worth of blocks: it fills, then evicts, as an engine's does
            keys = [os.urandom(16) for _ in range(50)]
            # A store that loses the race with pruning of its fan-out directory twice is a failed store (a miss,
            # nothing served wrong): not what this test is about, so only the disk usage is asserted.
            store_blocks(tier, keys, [block_for(k) for k in keys])
            tier.drain(timeout=30)
            assert _du_bytes(str(volume)) <= capacity, f"round {round_}: {_du_bytes(str(volume))} > {capacity}"
        leaves = [d for d, dirs, names in os.walk(tier.root) if d.count(os.sep) - tier.root.count(os.sep) == 2]
        assert len(leaves) <= len(tier), "emptied fan-out directories are removed"
    finally:
        tier.close()
