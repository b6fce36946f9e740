"""Format 2 of the filesystem tier: the payload starts page-aligned, codec-none blocks move between
the file and page-aligned rows with no staging copy, format-1 files (written by the v1 tier, tests/data/fs-v1)
are still served, and a store survives its fan-out directory being pruned under it more than once.

The direct path needs O_DIRECT; on a filesystem without it (tmpfs) those tests skip, and the staging path they
fall back to is what the rest of tests/runtime/fs/test_fs_tier*.py exercise (their tensors are never page-aligned)."""
from __future__ import annotations

import ctypes
import errno
import os
import pathlib
import shutil
import threading
import time

import pytest
import torch
from kvtier_runtime.codecs import HEADER_NBYTES, decode
from kvtier_runtime.fs import KeyState
from kvtier_runtime.fs import format as fmt
from kvtier_runtime.fs.fileio import AlignedBuffer, FileOps, probe_o_direct
from plugins.runtime import block_for, key_of, metric_value, sentinel
from plugins.tier_sync import load_blocks, store_blocks

SHAPE = (64, 256)  # 64 KiB of float32: whole pages
V1_DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "fs-v1"
V1_SHAPE = (16, 64)


def aligned(shape=SHAPE, fill: torch.Tensor | None = None) -> torch.Tensor:
    """A page-aligned float32 tensor (as vLLM's CPU-tier rows and kvtier's host slab are)."""
    n = 1
    for d in shape:
        n *= d
    buf = AlignedBuffer(fmt.align_up(n * 4))
    t = torch.frombuffer(buf.mv, dtype=torch.float32)[:n].view(shape)
    t._kvtier_keep = buf  # keep the mapping alive as long as the tensor
    t.copy_(fill if fill is not None else torch.full(shape, 12345.0))
    assert t.data_ptr() % fmt.ALIGN == 0
    return t


def unaligned(shape=SHAPE, fill: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor that is never page-aligned (one float past a page boundary)."""
    n = 1
    for d in shape:
        n *= d
    t = aligned((n + 1,))[1:].view(shape)
    t.copy_(fill if fill is not None else torch.full(shape, 12345.0))
    return t


def address_of(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class Recording(FileOps):
    """Records the buffers of every data call: (kind, [(address, length), ...])."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[int, int]]]] = []

    def _note(self, kind, data):
        bufs = [data] if isinstance(data, memoryview) else list(data)
        self.calls.append((kind, [(address_of(b) if not b.readonly else 0, len(b)) for b in bufs]))

    def write(self, fd, data):
        self._note("write", data)
        return super().write(fd, data)

    def readinto(self, fd, buf, offset):
        self._note("read", buf)
        return super().readinto(fd, buf, offset)


@pytest.fixture
def direct_dir(tmp_path) -> str:
    if not probe_o_direct(str(tmp_path)):
        pytest.skip("the filesystem of tmp_path does not support O_DIRECT")
    return str(tmp_path / "fs")


def _count_staging(tier) -> list[int]:
    calls = [0]
    original = tier.io.staging

    def counted():
        calls[0] += 1
        return original()

    tier.io.staging = counted
    return calls


# ---- layout ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_the_payload_starts_page_aligned_after_the_blob_header(fs_tier_factory, codec: str) -> None:
    # Every codec's blob header ends the header page, so its payload starts at 4096 (the defect: a payload 96
    # bytes past the page boundary cannot move with O_DIRECT without a staging copy).
    tier = fs_tier_factory(codec=codec)
    key = key_of(1)
    assert store_blocks(tier, [key], [block_for(key)]).success
    raw = pathlib.Path(tier.block_path(key)).read_bytes()
    header = fmt.parse_header(raw[: fmt.HEADER_BYTES])
    assert header.version == 2 and header.blob_offset == fmt.HEADER_BYTES - HEADER_NBYTES
    assert raw[fmt.HEADER_BYTES - HEADER_NBYTES : fmt.HEADER_BYTES - HEADER_NBYTES + 4] == b"KVTC"
    assert len(raw) == header.file_bytes and len(raw) % fmt.ALIGN == 0
    blob = torch.frombuffer(bytearray(raw[header.blob_offset : header.blob_offset + header.payload_len]),
                            dtype=torch.uint8)
    out = decode(blob)
    if codec == "none":  # the payload is the row byte for byte, from the page boundary on
        assert raw[fmt.HEADER_BYTES : fmt.HEADER_BYTES + 64 * 256 * 4] == block_for(key).numpy().tobytes()
        assert torch.equal(out, block_for(key))
    assert not any(raw[header.blob_offset + header.payload_len :]), "padding is zeros"


# ---- the direct path: no staging copy ---------------------------------------------------------------------------
@pytest.mark.parametrize("mac", [False, True])
def test_aligned_rows_move_in_one_call_straight_from_and_into_the_row(fs_tier_factory, direct_dir, tmp_path,
                                                                      mac: bool) -> None:
    # The defect class: a staging copy on the uncompressed path (a memcpy per block on each side). Here the
    # row's own address must be a segment of the one write and the one read of each block, and the staging
    # buffer is never asked for.
    opts = {}
    if mac:
        (tmp_path / "k").write_bytes(b"v2-test-mac-key-" * 3)  # no trailing newline to drop
        opts["mac_key_file"] = str(tmp_path / "k")
    ops = Recording()
    tier = fs_tier_factory(root=direct_dir, file_ops=ops, **opts)
    assert tier.direct_io
    staged = _count_staging(tier)
    keys = [key_of(i) for i in range(3)]
    src = [aligned(fill=block_for(k)) for k in keys]
    ops.calls.clear()
    assert store_blocks(tier, keys, src).success
    writes = [c for k, c in ops.calls if k == "write"]
    assert len(writes) == 3 and all(len(segs) == 2 for segs in writes)  # header page + the row's pages
    assert sorted(segs[1] for segs in writes) == sorted((t.data_ptr(), t.numel() * 4) for t in src)
    outs = [aligned() for _ in keys]
    ops.calls.clear()
    assert load_blocks(tier, keys, outs).success
    reads = [c for k, c in ops.calls if k == "read"]
    assert len(reads) == 3 and sorted(segs[1] for segs in reads) == sorted((t.data_ptr(), t.numel() * 4) for t in outs)
    assert staged == [0], "the staging buffer was used on the aligned, uncompressed path"
    for k, out in zip(keys, outs):
        assert torch.equal(out, block_for(k))


@pytest.mark.parametrize("refused", ["write", "read"])
def test_o_direct_refusing_the_rows_alignment_mid_run_falls_back_to_staging(fs_tier_factory, direct_dir,
                                                                            refused: str) -> None:
    # The open probe passed, but the filesystem answers EINVAL to a transfer straight from (or into) the row:
    # the block still moves, through the staging buffer, and so does every later one; other errors still fail.
    class Refusing(FileOps):
        def write(self, fd, data):
            if refused == "write" and not isinstance(data, memoryview):  # vectored: the direct path
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().write(fd, data)

        def readinto(self, fd, buf, offset):
            if refused == "read" and not isinstance(buf, memoryview):
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().readinto(fd, buf, offset)

    tier = fs_tier_factory(root=direct_dir, file_ops=Refusing())
    assert tier.direct_io
    staged = _count_staging(tier)
    keys = [key_of(i) for i in range(3)]
    assert store_blocks(tier, keys, [aligned(fill=block_for(k)) for k in keys]).success
    outs = [aligned() for _ in keys]
    assert load_blocks(tier, keys, outs).success
    assert all(torch.equal(out, block_for(k)) for k, out in zip(keys, outs))
    assert staged[0] >= 3 and tier.io.direct is False


def test_a_row_that_is_not_whole_pages_moves_its_tail_through_one_page(fs_tier_factory, direct_dir) -> None:
    shape = (3, 1000)  # 12,000 bytes: two whole pages and a 3,808-byte tail
    tier = fs_tier_factory(root=direct_dir, shape=shape)
    staged = _count_staging(tier)
    key = key_of(7)
    assert store_blocks(tier, [key], [aligned(shape, block_for(key, shape))]).success
    assert os.path.getsize(tier.block_path(key)) == fmt.HEADER_BYTES + fmt.align_up(12000)
    out = aligned(shape)
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key, shape))
    assert staged == [0]


def test_unaligned_rows_and_compressed_codecs_take_the_staging_path_correctly(fs_tier_factory, direct_dir) -> None:
    ops = Recording()
    tier = fs_tier_factory(root=direct_dir, file_ops=ops)
    key = key_of(1)
    src = unaligned(fill=block_for(key))
    assert store_blocks(tier, [key], [src]).success
    out = unaligned()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))
    assert all(len(segs) == 1 for _, segs in ops.calls if _ in ("write", "read")), "one whole-file buffer each"
    # A block written from an aligned row reads into an unaligned one, and the other way round.
    k2 = key_of(2)
    assert store_blocks(tier, [k2], [aligned(fill=block_for(k2))]).success
    out2 = unaligned()
    assert load_blocks(tier, [k2], [out2]).success and torch.equal(out2, block_for(k2))
    out3 = aligned()
    assert load_blocks(tier, [key], [out3]).success and torch.equal(out3, block_for(key))
    fp8 = fs_tier_factory(root=direct_dir + "-fp8", codec="fp8")
    assert store_blocks(fp8, [key], [aligned(fill=block_for(key))]).success
    back = aligned()
    assert load_blocks(fp8, [key], [back]).success
    assert (back - block_for(key)).norm() / block_for(key).norm() < 0.1


def test_without_o_direct_aligned_rows_still_round_trip(fs_tier_factory) -> None:
    tier = fs_tier_factory(direct_io=False)
    staged = _count_staging(tier)
    key = key_of(1)
    assert store_blocks(tier, [key], [aligned(fill=block_for(key))]).success
    out = aligned()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))
    assert staged[0] == 2, "without O_DIRECT every block goes through the staging buffer"


# ---- corrupt, torn, foreign on the direct path: misses, never loads ---------------------------------------------
@pytest.mark.parametrize(("where", "kind"), [
    ("payload", "corrupt"), ("tail-of-payload", "corrupt"), ("blob-header", "corrupt"), ("fs-header", "corrupt"),
    ("truncated", "truncated"), ("longer", "corrupt"), ("other-key", "mismatch"),
])
@pytest.mark.parametrize("mac", [False, True])
def test_a_bad_v2_file_read_straight_into_a_row_is_a_counted_miss(fs_tier_factory, direct_dir, tmp_path,
                                                                  where: str, kind: str, mac: bool) -> None:
    # Reading into the row before checking it must not make a bad block a hit: every check runs over the row
    # after the read, and a failed one fails the key (the row's contents are then unspecified) and deletes it.
    opts = {}
    if mac:
        (tmp_path / "k").write_bytes(b"v2-test-mac-key-" * 3)  # no trailing newline to drop
        opts["mac_key_file"] = str(tmp_path / "k")
    tier = fs_tier_factory(root=direct_dir, **opts)
    key, other = key_of(1), key_of(2)
    assert store_blocks(tier, [key, other], [aligned(fill=block_for(key)), aligned(fill=block_for(other))]).success
    path = tier.block_path(key)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if where in ("payload", "tail-of-payload", "blob-header", "fs-header"):
            pos = {"payload": fmt.HEADER_BYTES + 5000, "tail-of-payload": size - 1,
                   "blob-header": fmt.HEADER_BYTES - HEADER_NBYTES + 20, "fs-header": 60}[where]
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x40]))
        elif where == "truncated":
            f.truncate(size - fmt.ALIGN)
        elif where == "longer":
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * fmt.ALIGN)
    if where == "other-key":
        os.replace(tier.block_path(other), path)
    before = metric_value("kvtier_runtime_fs_errors_total", tier="fs", kind="forged" if mac and kind == "corrupt"
                          and where != "fs-header" and where != "longer" else kind)
    res = load_blocks(tier, [key], [aligned()])
    expected = "forged" if mac and kind == "corrupt" and where not in ("fs-header", "longer") else kind
    assert res.ok == (False,) and res.errors == {0: expected}
    assert metric_value("kvtier_runtime_fs_errors_total", tier="fs", kind=expected) == before + 1
    assert tier.state(key) is KeyState.MISS and not os.path.exists(path)


def test_a_torn_v2_write_is_removed_at_restart(fs_tier_factory, direct_dir) -> None:
    tier = fs_tier_factory(root=direct_dir)
    key = key_of(1)
    assert store_blocks(tier, [key], [aligned(fill=block_for(key))]).success
    tier.close()
    path = tier.block_path(key)
    torn = path + ".tmp.999.1"
    shutil.copy(path, torn)
    os.truncate(torn, fmt.HEADER_BYTES + 100)  # a kill -9 inside the write leaves this .tmp
    with open(path, "r+b") as f:  # and a block whose length disagrees with its header
        f.truncate(os.path.getsize(path) - fmt.ALIGN)
    again = fs_tier_factory(root=direct_dir)
    assert again.rebuild_stats["tmp"] == 1 and again.rebuild_stats["truncated"] == 1
    assert again.rebuild_stats["blocks"] == 0 and not os.path.exists(torn) and not os.path.exists(path)


# ---- a hung direct read -------------------------------------------------------------------------------------------
class _HangReads(FileOps):
    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def readinto(self, fd, buf, offset):
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().readinto(fd, buf, offset)


def test_a_direct_read_past_its_deadline_holds_the_job_until_it_returns(fs_tier_factory, direct_dir) -> None:
    # The io_timeout_s promise: once a job is reported finished, nothing writes the caller's memory. A read that
    # DMAs straight into the row cannot be called back, so its job must not be reported (as a timeout) while the
    # read is in the kernel; the defect class is a late read landing in a row the engine has reused.
    ops = _HangReads()
    tier = fs_tier_factory(root=direct_dir, file_ops=ops, io_timeout_s=0.5)
    key = key_of(1)
    assert store_blocks(tier, [key], [aligned(fill=block_for(key))]).success
    ops.armed.set()
    out = aligned()
    job = tier.submit_load([key], [out])
    assert ops.entered.wait(5)
    time.sleep(1.0)  # twice the deadline
    assert [r for r in tier.get_finished() if r.job_id == job] == [], "reported while the row is lent to a read"
    ops.armed.clear()
    # Meanwhile, a load into another row takes the staging path (so it would time out cleanly on a hung disk).
    staged = _count_staging(tier)
    other = aligned()
    assert load_blocks(tier, [key], [other]).success and torch.equal(other, block_for(key)) and staged == [1]
    ops.release.set()
    deadline = time.monotonic() + 10
    results = []
    while not results and time.monotonic() < deadline:
        results = [r for r in tier.get_finished() if r.job_id == job]
        time.sleep(0.02)
    (res,) = results
    assert res.success and torch.equal(out, block_for(key)), "the read returned good data: the key loads"


def test_a_direct_read_that_never_started_before_the_deadline_times_out_as_before(fs_tier_factory,
                                                                                 direct_dir) -> None:
    ops = _HangReads()
    tier = fs_tier_factory(root=direct_dir, file_ops=ops, io_timeout_s=0.5, n_read_threads=1)
    keys = [key_of(1), key_of(2)]
    assert store_blocks(tier, keys, [aligned(fill=block_for(k)) for k in keys]).success
    ops.armed.set()
    first = tier.submit_load([keys[0]], [aligned()])
    assert ops.entered.wait(5)
    out = aligned()
    t0 = time.monotonic()
    job = tier.submit_load([keys[1]], [out])  # queued behind the hung read on the only thread
    # Polled as the books poll each step (drain would also wait for the first job, held open by its read): the
    # poll expires the job at its io_timeout_s.
    results: list = []
    while not results and time.monotonic() - t0 < 10:
        results = [r for r in tier.get_finished() if r.job_id == job]
        time.sleep(0.01)
    assert time.monotonic() - t0 < 3
    (res,) = results
    assert res.errors == {0: "timeout"}
    ops.release.set()
    tier.drain(timeout=10)
    time.sleep(0.2)
    assert torch.equal(out, torch.full(SHAPE, 12345.0)), "a timed-out job's row is never written"
    assert [r.success for r in tier.get_finished() if r.job_id == first] == [True]


# ---- format-1 files (written by the v1 tier) ----------------------------------------------------------------------
def _v1_root(tmp_path, name: str) -> str:
    root = tmp_path / name
    shutil.copytree(V1_DATA / name, root)
    return str(root)


@pytest.mark.parametrize("destination", ["aligned", "unaligned"])
def test_v1_files_are_kept_at_restart_and_served(fs_tier_factory, tmp_path, destination: str) -> None:
    # An upgrade keeps the cache: v1 blocks are indexed at start-up and read through the staging path (their
    # payload is not page-aligned), whatever the destination; new stores write v2 next to them.
    make = aligned if destination == "aligned" else unaligned
    plain = fs_tier_factory(root=_v1_root(tmp_path, "plain"), shape=V1_SHAPE)
    assert plain.rebuild_stats["blocks"] == 2 and plain.rebuild_stats["version"] == 0
    for i in (1, 2):
        key = key_of(i)
        raw = pathlib.Path(plain.block_path(key)).read_bytes()
        assert fmt.parse_header(raw[: fmt.HEADER_BYTES]).version == 1
        out = make(V1_SHAPE)
        assert load_blocks(plain, [key], [out]).success and torch.equal(out, block_for(key, V1_SHAPE))
    new = key_of(9)
    assert store_blocks(plain, [new], [make(V1_SHAPE, block_for(new, V1_SHAPE))]).success
    assert fmt.parse_header(pathlib.Path(plain.block_path(new)).read_bytes()[: fmt.HEADER_BYTES]).version == 2
    out = make(V1_SHAPE)
    assert load_blocks(plain, [new], [out]).success and torch.equal(out, block_for(new, V1_SHAPE))

    fp8 = fs_tier_factory(root=_v1_root(tmp_path, "fp8"), shape=V1_SHAPE, codec="fp8")
    out = make(V1_SHAPE)
    want = block_for(key_of(3), V1_SHAPE)
    assert load_blocks(fp8, [key_of(3)], [out]).success and (out - want).norm() / want.norm() < 0.1

    mac = fs_tier_factory(root=_v1_root(tmp_path, "mac"), shape=V1_SHAPE,
                          mac_key_file=str(V1_DATA / "mac.key"))
    out = make(V1_SHAPE)
    assert load_blocks(mac, [key_of(4)], [out]).success and torch.equal(out, block_for(key_of(4), V1_SHAPE))


def _flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_tampered_v1_file_is_still_a_miss(fs_tier_factory, tmp_path) -> None:
    root = _v1_root(tmp_path, "mac")
    tier = fs_tier_factory(root=root, shape=V1_SHAPE, mac_key_file=str(V1_DATA / "mac.key"))
    path = tier.block_path(key_of(4))
    _flip(path, fmt.HEADER_BYTES + HEADER_NBYTES + 10)
    res = load_blocks(tier, [key_of(4)], [unaligned(V1_SHAPE)])
    assert res.errors == {0: "forged"} and not os.path.exists(path)
    plain = fs_tier_factory(root=_v1_root(tmp_path, "plain"), shape=V1_SHAPE)
    path = plain.block_path(key_of(1))
    _flip(path, fmt.HEADER_BYTES + HEADER_NBYTES + 10)
    assert load_blocks(plain, [key_of(1)], [aligned(V1_SHAPE)]).errors == {0: "corrupt"} and not os.path.exists(path)


def _write_v1(tier, key: bytes, block: torch.Tensor) -> None:
    """A format-1 file as the v1 tier wrote it: header page, then the codec blob at 4096, padded."""
    from kvtier_runtime.codecs import get_codec

    blob = torch.empty(get_codec("none").encoded_nbytes(block.shape, block.dtype), dtype=torch.uint8)
    n = get_codec("none").encode(block.contiguous(), blob)
    data = blob[:n].numpy().tobytes()
    header = fmt.pack_header(codec="none", dtype="float32", shape=tuple(block.shape), payload_len=n,
                             payload_crc=fmt.checksum(data), key=key, version=1)
    raw = header + data
    raw += b"\0" * (fmt.align_up(len(raw)) - len(raw))
    path = tier.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pathlib.Path(path).write_bytes(raw)


def test_a_v1_file_as_long_as_a_v2_one_falls_back_from_the_direct_read(fs_tier_factory, direct_dir) -> None:
    # 8,000-byte rows: a v1 file (4096 + 96 + 8000, padded) is exactly as long as a v2 one, so only the header
    # read straight into the row tells them apart; the block must then be read again the v1 way, never served
    # from a row that holds the v1 layout (96 bytes shifted).
    shape = (2, 1000)
    first = fs_tier_factory(root=direct_dir, shape=shape)
    key = key_of(5)
    _write_v1(first, key, block_for(key, shape))
    first.close()
    tier = fs_tier_factory(root=direct_dir, shape=shape)
    assert tier.rebuild_stats["blocks"] == 1
    assert os.path.getsize(tier.block_path(key)) == fmt.HEADER_BYTES + fmt.align_up(8000)  # = the v2 length
    out = aligned(shape)
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key, shape))


# ---- the fan-out directory pruned under a store ---------------------------------------------------------------
class _Pruner(FileOps):
    """Removes the block's fan-out directories just before each of the first ``times`` tmp-file creations: what
    another store's unlink + prune does when it lands between our mkdir and our open."""

    def __init__(self, times: int) -> None:
        self.times = times

    def open(self, path, flags, mode=0o644):
        if flags & os.O_CREAT and ".tmp." in path and self.times > 0:
            self.times -= 1
            shutil.rmtree(os.path.dirname(os.path.dirname(path)), ignore_errors=True)
        return super().open(path, flags, mode)


@pytest.mark.parametrize("times", [1, 2, 5])
def test_a_store_survives_its_fanout_directory_pruned_repeatedly(fs_tier_factory, times: int) -> None:
    # The defect class: recreating the directory a bounded small number of times (once) when a concurrent prune
    # can remove it again each time; the bound must be above what a racing prune can do in practice.
    tier = fs_tier_factory(file_ops=_Pruner(times))
    key = key_of(1)
    res = store_blocks(tier, [key], [block_for(key)])
    assert res.success, res.errors
    out = sentinel()
    assert load_blocks(tier, [key], [out]).success and torch.equal(out, block_for(key))


# ---- a job's blocks still move in parallel ------------------------------------------------------------------------
def test_the_blocks_of_one_job_are_hashed_and_read_concurrently(fs_tier_factory, direct_dir, monkeypatch) -> None:
    # The defect class: guarding the caller's memory with the job's one lock across per-block CPU or I/O work,
    # which serialises every block of a job (a vLLM job is many chunks) on its pool. Two blocks of one job must be
    # inside the row hash (stores) and inside the read (loads) at the same time.
    from kvtier_runtime.fs import io as fsio

    both = threading.Barrier(2, timeout=5)
    real = fsio.checksum

    def meeting_checksum(data, value=0):
        if len(data) > fmt.ALIGN:  # a row, not the 96-byte codec header
            both.wait()
        return real(data, value)

    class MeetingReads(FileOps):
        armed = False

        def readinto(self, fd, buf, offset):
            if self.armed and not isinstance(buf, memoryview):
                both.wait()
            return super().readinto(fd, buf, offset)

    ops = MeetingReads()
    tier = fs_tier_factory(root=direct_dir, file_ops=ops, n_write_threads=2, n_read_threads=2)
    keys = [key_of(1), key_of(2)]
    monkeypatch.setattr(fsio, "checksum", meeting_checksum)
    res = store_blocks(tier, keys, [aligned(fill=block_for(k)) for k in keys])
    monkeypatch.setattr(fsio, "checksum", real)
    assert res.success, res.errors
    both.reset()
    ops.armed = True
    outs = [aligned(), aligned()]
    assert load_blocks(tier, keys, outs).success
    assert all(torch.equal(o, block_for(k)) for o, k in zip(outs, keys))


def test_the_direct_path_counts_blocks_in_the_codec_metrics_as_an_encode_would(fs_tier_factory, direct_dir) -> None:
    from kvtier_runtime.codecs import STATS

    def none_blocks() -> float:
        return STATS.snapshot()["kvtier_runtime_codec_blocks_total"].get("none", 0)

    tier = fs_tier_factory(root=direct_dir)
    before = none_blocks()
    assert store_blocks(tier, [key_of(1)], [aligned(fill=block_for(key_of(1)))]).success
    assert store_blocks(tier, [key_of(2)], [unaligned(fill=block_for(key_of(2)))]).success
    assert none_blocks() == before + 2


def test_the_engine_path_rows_are_aligned_so_promotions_and_write_through_never_stage(direct_dir, tmp_path) -> None:
    # The premise of format 2's direct path, checked on the real memory: kvtier's offloading spec hands the disk
    # tier rows of its shared host region, which must be page-aligned for a row to move without a copy.
    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.store.books import HIT, RETRY
    from plugins.runtime import engine_books, seq_key

    row = 64 * 1024
    cfg = FilesystemTierConfig(root_dir=direct_dir, capacity_bytes=1 << 22, n_read_threads=2, n_write_threads=2)
    books, region = engine_books(tmp_path, 2, row, [cfg])  # rows seen as float16, as the spec does
    try:
        tier = books.tiers[0]
        staged = _count_staging(tier)
        fill = {seq_key(i): torch.randint(0, 255, (row,), dtype=torch.uint8) for i in range(3)}
        for key in fill:  # two host rows: the first key ends up only on disk
            to_store, slots, _ = books.prepare_store([key])
            region.rows[slots[0]].copy_(fill[key])
            books.complete_store(to_store)
            books.drain(10)
        assert books.lookup(seq_key(0)) == RETRY
        deadline = time.monotonic() + 10
        while books.lookup(seq_key(0)) == RETRY and time.monotonic() < deadline:
            books.drain(10)
        assert books.lookup(seq_key(0)) == HIT
        assert torch.equal(region.rows[books.host.slot_of(seq_key(0))], fill[seq_key(0)])
        assert staged == [0], "a row of the host region went through the staging buffer"
    finally:
        books.close()
        region.close(unlink=True)


def test_a_promotion_whose_direct_read_hangs_is_a_miss_at_the_deadline_and_its_slot_stays_reserved(direct_dir,
                                                                                                    tmp_path) -> None:
    # The engine side of the lent-read rule: the tier holds the job open while the read is in the kernel, but the
    # request must not wait for it (io_timeout_s: a hung disk slows the engine, never stops a request). The books
    # answer miss at the deadline (vLLM recomputes) and keep the host slot out of use until the read lands, so the
    # late bytes cannot overwrite a row given to another chunk.
    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.store.books import MISS, RETRY
    from plugins.runtime import engine_books, seq_key

    row = 64 * 1024
    ops = _HangReads()
    cfg = FilesystemTierConfig(root_dir=direct_dir, capacity_bytes=1 << 22, n_read_threads=2, n_write_threads=2,
                               io_timeout_s=0.5)
    books, region = engine_books(tmp_path, 2, row, [(cfg, {"file_ops": ops})])
    try:
        fill = {seq_key(i): torch.randint(0, 255, (row,), dtype=torch.uint8) for i in range(3)}
        for key in fill:  # two host rows: the first key ends up only on disk
            to_store, slots, _ = books.prepare_store([key])
            region.rows[slots[0]].copy_(fill[key])
            books.complete_store(to_store)
            books.drain(10)
        ops.armed.set()
        assert books.lookup(seq_key(0)) == RETRY
        assert ops.entered.wait(5)
        reserved = books.fenced_slots
        deadline = time.monotonic() + 5
        while books.fenced_slots == reserved and time.monotonic() < deadline:
            time.sleep(0.05)
            books.poll()
        assert books.fenced_slots == reserved + 1, "the slot under the hung read was not kept out of use"
        assert books.load_failures["timeout"] == 1
        # The request is not held: asked again until the deadline passes, it is told miss (vLLM recomputes).
        answers = []
        deadline = time.monotonic() + 5
        while MISS not in answers and time.monotonic() < deadline:
            answers.append(books.lookup(seq_key(0)))
            time.sleep(0.05)
        assert MISS in answers, answers[-5:]
        ops.armed.clear()
        ops.release.set()
        deadline = time.monotonic() + 10
        while books.fenced_slots > reserved and time.monotonic() < deadline:
            time.sleep(0.05)
            books.poll()
        assert books.fenced_slots == reserved, "the slot was not freed once the late read returned"
    finally:
        ops.release.set()
        books.close()
        region.close(unlink=True)
