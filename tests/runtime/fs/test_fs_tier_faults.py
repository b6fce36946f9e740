"""Hostile and failing disks under the filesystem tier (issue #16, runtime part): forged blocks, symlinks planted
at every level of the namespace, FIFOs swapped in for block files, a disk that hangs, EACCES, a read-only
filesystem, files that cannot be deleted, and over-long keys.

Files, symlinks, FIFOs and the read-only mount are real; a disk that hangs or refuses with EACCES/EPERM is
injected through the tier's FileOps seam (the tests run as root, for whom permission bits do not refuse).
"""
from __future__ import annotations

import errno
import os
import random
import struct
import subprocess
import threading
import time

import pytest
import torch
from kvtier_runtime.config import ConfigError, FilesystemTierConfig
from kvtier_runtime.fs import FilesystemTier, KeyState
from kvtier_runtime.fs import format as fmt
from kvtier_runtime.fs.fileio import FileOps
from kvtier_runtime.fs.paths import NAMESPACE, block_relpath
from kvtier_runtime.store import HIT, MISS, RETRY, MemoryTier, OffloadBooks
from plugins.runtime import block_file_bytes, block_for, key_of, metric_value, sentinel
from plugins.tier_sync import load_blocks, store_blocks

SHAPE = (64, 256)


def _errors(kind: str) -> float:
    return metric_value("kvtier_runtime_fs_errors_total", tier="fs", kind=kind)


def _key_file(tmp_path, name="mac.key", nbytes=32) -> str:
    """Binary key material, the same for a name on every run (a key that reads shorter than written can never
    make the test flaky); two names give two keys."""
    path = tmp_path / name
    path.write_bytes(random.Random(f"{name}/{nbytes}").randbytes(nbytes))
    return str(path)


def _forge(path: str, new_payload_byte: int = 0x5A) -> None:
    """What an attacker with write access to the shared directory does: edit the payload, then recompute the
    payload CRC and the header CRC so that every accidental-corruption check passes (the MAC field is kept)."""
    with open(path, "r+b") as fh:
        raw = bytearray(fh.read())
    header = fmt.parse_header(bytes(raw[: fmt.HEADER_BYTES]))
    raw[fmt.HEADER_BYTES + 100] = new_payload_byte
    payload = raw[header.blob_offset : header.blob_offset + header.payload_len]
    struct.pack_into("<I", raw, 128, fmt.checksum(payload))
    struct.pack_into("<I", raw, 12, fmt.header_crc(memoryview(raw), header.version))
    with open(path, "wb") as fh:
        fh.write(raw)


# ---- keyed MAC ----------------------------------------------------------------------------------------------
def test_a_forged_block_is_served_by_crc_alone_but_is_a_counted_miss_with_the_mac(fs_tier_factory, tmp_path) -> None:
    key = key_of(1)
    plain = fs_tier_factory(root=str(tmp_path / "plain"))
    assert store_blocks(plain, [key], [block_for(key)]).success
    _forge(plain.block_path(key))
    out = sentinel()
    assert load_blocks(plain, [key], [out]).success, "CRC32 alone cannot tell a forged block (why the MAC exists)"
    assert not torch.equal(out, block_for(key))

    tier = fs_tier_factory(root=str(tmp_path / "mac"), mac_key_file=_key_file(tmp_path))
    assert store_blocks(tier, [key], [block_for(key)]).success
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))
    _forge(tier.block_path(key))
    f0 = _errors("forged")
    out = sentinel()
    res = load_blocks(tier, [key], [out])
    assert res.errors == {0: "forged"} and torch.equal(out, sentinel()), "a forged block is never served"
    assert _errors("forged") == f0 + 1
    assert tier.state(key) is KeyState.MISS and not os.path.exists(tier.block_path(key))


def test_a_keyed_tier_writes_format_3_and_still_serves_format_2_blocks_of_its_key(fs_tier_factory, tmp_path) -> None:
    # Format 3 changed only the MAC (GMAC under a key per block, for speed): blocks an earlier build wrote as
    # format 2 with HMAC-SHA256 under the same key are still served; a tier without a key writes format 2 as before.
    mac_key_file = _key_file(tmp_path)
    with open(mac_key_file, "rb") as fh:
        mac_key = fh.read()
    keys = [key_of(i) for i in range(2)]
    tier = fs_tier_factory(root=str(tmp_path / "mac"), mac_key_file=mac_key_file)
    assert store_blocks(tier, keys, [block_for(k) for k in keys]).success
    for k in keys:
        with open(tier.block_path(k), "rb") as fh:
            assert fmt.parse_header(fh.read(fmt.HEADER_BYTES)).version == 3
    path = tier.block_path(keys[1])  # rewritten as the earlier build wrote it: format 2, HMAC-SHA256
    with open(path, "r+b") as fh:
        raw = bytearray(fh.read())
        header = fmt.parse_header(bytes(raw[: fmt.HEADER_BYTES]))
        raw[8:10] = (2).to_bytes(2, "little")
        struct.pack_into("<I", raw, 12, fmt.header_crc(memoryview(raw), 2))  # format 2's CRC leaves the version out
        blob = bytes(raw[header.blob_offset : header.blob_offset + header.payload_len])
        raw[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = bytes(fmt.MAC_BYTES)
        raw[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = fmt.block_mac(mac_key, raw, blob)
        fh.seek(0)
        fh.write(raw)
    outs = [sentinel() for _ in keys]
    assert load_blocks(tier, keys, outs).success
    assert all(torch.equal(o, block_for(k)) for o, k in zip(outs, keys))
    plain = fs_tier_factory(root=str(tmp_path / "plain"))
    assert store_blocks(plain, keys[:1], [block_for(keys[0])]).success
    with open(plain.block_path(keys[0]), "rb") as fh:
        assert fmt.parse_header(fh.read(fmt.HEADER_BYTES)).version == 2


def test_blocks_without_the_right_mac_are_refused(fs_tier_factory, tmp_path) -> None:
    root = str(tmp_path / "fs")
    keys = [key_of(i) for i in range(3)]
    with_a = fs_tier_factory(root=root, mac_key_file=_key_file(tmp_path, "a.key"))
    assert store_blocks(with_a, keys[:2], [block_for(k) for k in keys[:2]]).success
    with_a.close()
    unkeyed = fs_tier_factory(root=root)  # a writer without any key (e.g. another pod, misconfigured)
    assert store_blocks(unkeyed, keys[2:], [block_for(k) for k in keys[2:]]).success
    outs = [sentinel() for _ in keys]
    assert load_blocks(unkeyed, keys, outs).success, "a tier without a key still reads MAC'd blocks (CRC-checked)"
    unkeyed.close()
    with_b = fs_tier_factory(root=root, mac_key_file=_key_file(tmp_path, "b.key"))
    assert with_b.rebuild_stats["blocks"] == 3
    outs = [sentinel() for _ in keys]
    res = load_blocks(with_b, keys, outs)
    assert res.errors == {0: "forged", 1: "forged", 2: "forged"}
    assert all(torch.equal(o, sentinel()) for o in outs)


@pytest.mark.parametrize("case", ["missing", "short", "directory"])
def test_an_unusable_mac_key_file_is_a_one_line_error_naming_the_key(fs_tier_factory, tmp_path, case) -> None:
    path = {"missing": str(tmp_path / "nope.key"), "short": _key_file(tmp_path, nbytes=31),
            "directory": str(tmp_path)}[case]
    with pytest.raises(ConfigError) as info:
        fs_tier_factory(mac_key_file=path)
    msg = str(info.value)
    assert msg.startswith("mac_key_file: ") and path in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="mac_key_file: 'key' must be an absolute path"):
        FilesystemTierConfig(root_dir="/x", capacity_bytes=1, mac_key_file="key")


def test_a_long_key_file_with_a_trailing_newline_works(fs_tier_factory, tmp_path) -> None:
    path = tmp_path / "k"
    path.write_bytes(b"A" * 200 + b"\n")  # e.g. base64 text from a Secret, longer than SHA-256's block
    tier = fs_tier_factory(mac_key_file=str(path))
    key = key_of(1)
    assert store_blocks(tier, [key], [block_for(key)]).success
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))


# ---- symlinks at every level ----------------------------------------------------------------------------------
def _victim(tmp_path):
    victim = tmp_path / "victim"
    (victim / "ab" / "cd").mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    (victim / "ab" / "cd" / "00.kvb").write_bytes(b"x" * 10)
    (victim / "ab" / "cd" / "x.kvb.tmp.1.1").write_bytes(b"y")
    return victim


def _victim_intact(victim) -> bool:
    return ((victim / "precious.txt").read_text() == "keep me" and (victim / "ab" / "cd" / "00.kvb").exists()
            and (victim / "ab" / "cd" / "x.kvb.tmp.1.1").exists())


def test_a_symlinked_namespace_is_refused_and_its_target_is_untouched(fs_tier_factory, tmp_path) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(victim, root / NAMESPACE)
    with pytest.raises(ConfigError) as info:
        fs_tier_factory(root=str(root))
    assert "symlink" in str(info.value) and NAMESPACE in str(info.value) and "\n" not in str(info.value)
    assert _victim_intact(victim)


def test_symlinks_in_the_fanout_and_leaves_are_removed_never_followed(fs_tier_factory, tmp_path) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "root"
    tier = fs_tier_factory(root=str(root))
    key = key_of(1)
    assert store_blocks(tier, [key], [block_for(key)]).success
    tier.close()
    ns = root / NAMESPACE
    os.symlink(victim, ns / "ee")  # first fan-out level
    (ns / "ff").mkdir()
    os.symlink(victim / "ab", ns / "ff" / "00")  # second level
    leaf_dir = ns / block_relpath(key_of(2)).rsplit("/", 1)[0]
    leaf_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(victim / "ab" / "cd" / "00.kvb", leaf_dir / block_relpath(key_of(2)).rsplit("/", 1)[1])
    again = fs_tier_factory(root=str(root))
    assert _victim_intact(victim)
    assert not os.path.lexists(ns / "ee") and not os.path.lexists(ns / "ff" / "00")
    assert not os.path.lexists(leaf_dir / block_relpath(key_of(2)).rsplit("/", 1)[1])
    assert again.rebuild_stats["blocks"] == 1 and again.rebuild_stats["foreign"] == 3


# ---- FIFOs and a disk that hangs ------------------------------------------------------------------------------
def test_a_fifo_swapped_in_for_a_block_fails_fast_at_load_and_at_restart(fs_tier_factory, tmp_path) -> None:
    root = str(tmp_path / "fs")
    tier = fs_tier_factory(root=root, io_timeout_s=20)
    key, other = key_of(1), key_of(2)
    assert store_blocks(tier, [key, other], [block_for(key), block_for(other)]).success
    path = tier.block_path(key)
    os.unlink(path)
    os.mkfifo(path)
    t0 = time.monotonic()
    out = sentinel()
    res = load_blocks(tier, [key], [out], timeout=15)
    assert time.monotonic() - t0 < 5 and res.errors == {0: "foreign"} and torch.equal(out, sentinel())
    tier.close()
    os.unlink(path) if os.path.exists(path) else None
    os.makedirs(os.path.dirname(path), exist_ok=True)  # the tier prunes a fan-out directory it emptied
    os.mkfifo(path)
    box: list = []
    t = threading.Thread(target=lambda: box.append(fs_tier_factory(root=root)), daemon=True)
    t.start()
    t.join(15)
    assert box, "start-up blocked on a FIFO"
    assert box[0].rebuild_stats["foreign"] == 1 and box[0].rebuild_stats["blocks"] == 1
    assert not os.path.lexists(path)


class _Hang(FileOps):
    """A disk whose reads or writes hang until ``release`` is set (or 30 s, so a failing test still ends)."""

    def __init__(self) -> None:
        self.reads = threading.Event()
        self.writes = threading.Event()
        self.release = threading.Event()

    def readinto(self, fd, buf, offset):
        if self.reads.is_set():
            self.release.wait(30)
        return super().readinto(fd, buf, offset)

    def write(self, fd, data):
        if self.writes.is_set():
            self.release.wait(30)
        return super().write(fd, data)


def test_a_hung_read_times_out_and_never_writes_the_callers_tensor_later(fs_tier_factory) -> None:
    ops = _Hang()
    tier = fs_tier_factory(file_ops=ops, io_timeout_s=0.5)
    key = key_of(1)
    assert store_blocks(tier, [key], [block_for(key)]).success
    ops.reads.set()
    t0 = time.monotonic()
    out = sentinel()
    job = tier.submit_load([key], [out])
    tier.drain(timeout=None)  # no caller timeout: the tier's own bound applies
    assert time.monotonic() - t0 < 3
    (res,) = [r for r in tier.get_finished() if r.job_id == job]
    assert res.errors == {0: "timeout"}
    ops.release.set()
    tier.drain(timeout=10)
    time.sleep(0.2)
    assert torch.equal(out, sentinel()), "a read finishing after its job expired must not touch the tensor"
    out2 = sentinel()
    assert load_blocks(tier, [key], [out2]).success and torch.equal(out2, block_for(key)), "the block itself is fine"


def test_a_hung_write_times_out_for_polling_callers_and_drain_is_bounded(fs_tier_factory) -> None:
    ops = _Hang()
    tier = fs_tier_factory(file_ops=ops, io_timeout_s=0.5)
    ops.writes.set()
    key = key_of(1)
    job = tier.submit_store([key], [block_for(key)])
    t0 = time.monotonic()
    tier.drain(timeout=None)
    assert time.monotonic() - t0 < 3
    (res,) = [r for r in tier.get_finished() if r.job_id == job]
    assert res.errors == {0: "timeout"}
    ops.release.set()
    deadline = time.monotonic() + 10
    while tier.state(key) is KeyState.PENDING and time.monotonic() < deadline:
        time.sleep(0.02)
    # the write had copied the block before the job expired, so finishing it stores the right bytes
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))


def test_the_engine_path_does_not_hang_on_a_hung_filesystem_tier(tmp_path) -> None:
    # The books answer vLLM's scheduler, which must never block on the disk: a promotion whose read hangs is a
    # "retry" while it runs, and once the tier's io_timeout_s expires it a counted "timeout" and a miss (vLLM
    # recomputes), with the host row never handed out.
    ops = _Hang()
    cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=64 * block_file_bytes(),
                               eviction_policy="lru", n_read_threads=2, n_write_threads=2, io_timeout_s=0.5)
    fs = FilesystemTier(cfg, SHAPE, torch.float32, file_ops=ops)
    host = MemoryTier("host", SHAPE, torch.float32, 2 * 64 * 256 * 4)
    books = OffloadBooks(host, [fs])
    try:
        keys = [key_of(i) for i in range(4)]
        for key in keys:  # two host rows: keys 0 and 1 are evicted and then only on disk
            to_store, slots, _ = books.prepare_store([key])
            host.slab[slots[0]].copy_(block_for(key))
            books.complete_store(to_store)
            books.drain(10)
        assert books.lookup(keys[3]) == HIT
        ops.reads.set()
        t0 = time.monotonic()
        assert books.lookup(keys[0]) == RETRY and time.monotonic() - t0 < 0.2  # queued, not waited for
        while books.has_pending_work() and time.monotonic() - t0 < 5:
            books.poll()  # what the scheduler's end-of-step does; each call returns at once
            assert keys[0] not in host or not host.is_ready(keys[0]), "an unread block is never a hit"
            time.sleep(0.05)
        assert time.monotonic() - t0 < 5 and books.load_failures["timeout"] == 1
        ops.release.set()
        # The request that waited is told miss once (it recomputes); asking again promotes anew, since the file
        # itself is still good. Before, it was "retry" at once: on a disk that stays hung, a request never got its
        # miss and waited for the disk.
        assert books.lookup(keys[0]) == MISS
        assert books.lookup(keys[0]) == RETRY
    finally:
        ops.release.set()
        books.close()


# ---- EACCES, read-only filesystems, undeletable files, long keys ------------------------------------------------
class _Denied(FileOps):
    def __init__(self) -> None:
        self.deny_writes = False

    def open(self, path, flags, mode=0o644):
        if self.deny_writes and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return super().open(path, flags, mode)


def test_eacces_is_its_own_kind_and_triggers_backoff(fs_tier_factory) -> None:
    ops = _Denied()
    tier = fs_tier_factory(file_ops=ops, backoff_after=2)
    ops.deny_writes = True
    e0 = _errors("eacces")
    for i in range(2):
        assert store_blocks(tier, [key_of(i)], [block_for(key_of(i))]).errors == {0: "eacces"}
    assert _errors("eacces") == e0 + 2 and tier.in_backoff
    assert store_blocks(tier, [key_of(9)], [block_for(key_of(9))]).errors == {0: "backoff"}


@pytest.fixture
def ro_tmpfs(tmp_path):
    """A real tmpfs that the test can remount read-only (needs root; skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)

    yield str(mnt), read_only
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_filesystem_degrades_the_tier_instead_of_raising(fs_tier_factory, ro_tmpfs) -> None:
    mnt, read_only = ro_tmpfs
    key = key_of(1)
    tier = fs_tier_factory(root=os.path.join(mnt, "tier"))
    assert store_blocks(tier, [key], [block_for(key)]).success
    tier.close()
    read_only()
    again = fs_tier_factory(root=os.path.join(mnt, "tier"))
    assert again.degraded == "erofs" and again.rebuild_stats["blocks"] == 1
    out = sentinel()
    served = load_blocks(again, [key], [out])
    assert served.success and torch.equal(out, block_for(key)), "what is there is still served"
    assert store_blocks(again, [key_of(2)], [block_for(key_of(2))]).errors == {0: "erofs"}
    fresh = fs_tier_factory(root=os.path.join(mnt, "never-created"))  # the namespace cannot even be made
    assert fresh.degraded == "erofs" and len(fresh) == 0
    assert store_blocks(fresh, [key], [block_for(key)]).errors == {0: "erofs"}


class _Undeletable(FileOps):
    def __init__(self) -> None:
        self.stuck: set[str] = set()

    def unlink(self, path):
        if path in self.stuck:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        super().unlink(path)


def test_an_undeletable_block_stays_counted_until_it_is_really_gone(fs_tier_factory) -> None:
    ops = _Undeletable()
    tier = fs_tier_factory(capacity_blocks=4, file_ops=ops)
    per = block_file_bytes(SHAPE)
    keys = [key_of(i) for i in range(8)]
    for k in keys[:4]:
        assert store_blocks(tier, [k], [block_for(k)]).success
    ops.stuck.add(tier.block_path(keys[0]))  # the coldest: the next store evicts it, and its unlink fails
    assert store_blocks(tier, [keys[4]], [block_for(keys[4])]).success
    assert os.path.exists(tier.block_path(keys[0])) and tier.state(keys[0]) is KeyState.MISS
    on_disk = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(tier.root) for n in ns)
    assert tier.used_bytes == on_disk == 5 * per, "the stuck file's bytes are still counted"
    assert store_blocks(tier, [keys[5]], [block_for(keys[5])]).success
    assert len(tier) == 3 and tier.used_bytes == 4 * per <= tier.capacity_bytes, "the tier shrank around it"
    assert store_blocks(tier, [keys[0]], [block_for(keys[0])]).errors == {0: "busy"}, "never stored over the stuck file"
    ops.stuck.clear()
    time.sleep(1.1)  # stores retry stuck unlinks at most once a second
    # the retry runs in the write task (submit never touches the disk), after this store's own reservation
    assert store_blocks(tier, [keys[6]], [block_for(keys[6])]).success
    assert not os.path.exists(tier.block_path(keys[0]))
    assert tier.used_bytes == 3 * per and len(tier) == 3
    assert store_blocks(tier, [keys[0]], [block_for(keys[0])]).success
    assert tier.used_bytes == 4 * per and len(tier) == 4, "the full capacity is back"


def test_a_key_over_1024_bytes_fails_with_its_own_kind(fs_tier_factory) -> None:
    tier = fs_tier_factory()
    long_key = b"k" * 1025
    r0 = metric_value("kvtier_runtime_stores_rejected_total", tier="fs", reason="key-too-long")
    res = store_blocks(tier, [long_key, key_of(1)], [block_for(long_key), block_for(key_of(1))])
    assert res.errors == {0: "key-too-long"} and res.ok == (False, True)
    assert metric_value("kvtier_runtime_stores_rejected_total", tier="fs", reason="key-too-long") == r0 + 1
    assert store_blocks(tier, [b"k" * 1024], [block_for(b"k")]).success


def test_close_is_bounded_while_a_read_hangs(fs_tier_factory) -> None:
    ops = _Hang()
    tier = fs_tier_factory(file_ops=ops, io_timeout_s=0.5)
    key = key_of(1)
    assert store_blocks(tier, [key], [block_for(key)]).success
    ops.reads.set()
    tier.submit_load([key], [sentinel()])
    time.sleep(0.1)
    t0 = time.monotonic()
    tier.close()
    assert time.monotonic() - t0 < 3
    ops.release.set()
