"""Filesystem tier write/read throughput (checksums on) against raw sequential O_DIRECT I/O of the same bytes
to the same disk, measured in the same run (target: ratio >= 0.85).

    python bench/fs_tier.py [--dir DIR] [--blocks 128] [--rounds 5] [--threads 16] [--mac] [--breakdown]
                            [--unaligned]

"raw write" writes the exact bytes the tier writes (blocks x file size) with O_DIRECT, 2 MiB + header per
``write``, sequentially into one preallocated-by-writing file, then one fdatasync: the disk's streaming
ceiling. "raw read" reads that file back the same way. The tier writes one file per block (header + CRC32 +
tmp file + fdatasync + rename, on --threads writer threads) and reads them back into preallocated tensors
(O_DIRECT read, CRC check) on --threads reader threads. The tier's rows are page-aligned slices of one slab,
as vLLM's CPU-tier rows and kvtier's host region are, so format 2 moves them with no staging copy;
``--unaligned`` shifts the slab by 64 bytes to measure the staging path (copy in/out) instead. Rounds alternate raw and tier so drift on a
shared machine hits both; the ratio is the median of per-round ratios. O_DIRECT bypasses the page cache on
both sides, so neither side is served from memory. ``--mac`` adds the keyed MAC (GMAC, format 3) (``mac_key_file``).
``--breakdown`` then times every phase of the tier's per-block work (each system call through the FileOps
seam, the CRC/MAC, the copy in and out) in a last, separate round and prints thread-time per block.

``--codec fp8`` (or int8, int4, fp8_e5m2) asks whether the compressed store path keeps up with the disk: the
blocks are then 2 MiB bf16 KV chunks (2 layers x 8 heads x 256 tokens x 128, ``HKTD``, random normal: the
chunk of ``bench/codecs.py --kv``) stored through the engine path's layout-aware codec (``get_kv_codec``,
attention check on, as the engine runs it with ``codec_fallback``; ``--no-verify`` turns it off), so a write is
encode + CRC + write of the *compressed* file, while "raw write" stays the O_DIRECT write of the *uncompressed*
bytes: a write ratio >= 1 means encoding costs less than the bytes it saves. Reads are decode against raw reads
of the uncompressed bytes. Run it with ``--threads 2`` on the 2-core machine (one encoder per core; torch runs
one thread per encode).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.tables

import torch
from kvtier_runtime.codecs import KVLayout, get_codec, get_kv_codec
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.fs import FilesystemTier

# The block I/O module: where the tier's tasks look up the per-block steps the breakdown times.
from kvtier_runtime.fs import io as tier_module
from kvtier_runtime.fs.fileio import O_DIRECT, AlignedBuffer, FileOps, probe_o_direct
from kvtier_runtime.fs.format import ALIGN, file_bytes_for
from plugins.tier_sync import load_blocks, store_blocks

from bench.tables import SMOKE_HELP, require_rows

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # 32 layers x K/V x 16 tokens x 8 KV heads x 128 dims, bf16 = 2 MiB
DTYPE = torch.bfloat16


def raw_write(path: str, buf: AlignedBuffer, n: int, direct: bool) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0), 0o644)
    try:
        for _ in range(n):
            done = 0
            while done < buf.nbytes:
                done += os.write(fd, buf.mv[done:])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def raw_read(path: str, buf: AlignedBuffer, n: int, direct: bool) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        for i in range(n):
            done = 0
            while done < buf.nbytes:
                got = os.preadv(fd, [buf.mv[done:]], i * buf.nbytes + done)
                if got <= 0:
                    raise OSError("short read")
                done += got
    finally:
        os.close(fd)
    return time.perf_counter() - t


def rows(n: int, unaligned: bool, shape: tuple[int, ...] = BLOCK_SHAPE) -> tuple[list[torch.Tensor], AlignedBuffer]:
    """``n`` block rows in one page-aligned slab (each row 2 MiB, so each page-aligned), or 64 bytes off."""
    row = 1
    for d in shape:
        row *= d
    row *= DTYPE.itemsize
    shift = 64 if unaligned else 0
    slab = AlignedBuffer(n * row + ALIGN)
    flat = torch.frombuffer(slab.mv, dtype=torch.uint8)[shift : shift + n * row].view(DTYPE)
    view = flat.view(n, *shape)
    return [view[i] for i in range(n)], slab


# --codec: the KV chunk of bench/codecs.py --kv (2 MiB bf16: 2 layers x 8 heads x 256 tokens x 128), stored through the engine path's codec
KV_LAYOUT = KVLayout(num_layers=2, block_tokens=256, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                     page_order="HKTD")


class PhaseTimer:
    """Thread-time per phase: every FileOps call and the tier's CPU steps, wrapped where the tier looks them up."""

    OPS = ("open", "write", "readinto", "fsync", "close", "rename", "unlink", "fstat")
    STEPS = ("checksum", "block_mac", "verify_mac", "verify_payload", "verify_crc", "verify_length", "decode",
             "pack_header", "parse_header")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: dict[str, object] = {}

    def _timed(self, name: str, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                with self._lock:
                    self.seconds[name] += dt
                    self.calls[name] += 1
        return run

    def file_ops(self) -> FileOps:
        timer = self

        class Timed(FileOps):
            pass

        for op in self.OPS:
            setattr(Timed, op, (lambda base, name: lambda self_, *a, **k: timer._timed(name, base)(self_, *a, **k))(
                getattr(FileOps, op), op))
        return Timed()

    def install(self, tier: FilesystemTier) -> None:
        for name in self.STEPS:
            self._saved[name] = getattr(tier_module, name)
            setattr(tier_module, name, self._timed(name, self._saved[name]))
        setattr(tier.codec, "encode", self._timed("encode (copy in)", tier.codec.encode))  # noqa: B010 -- a method

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(tier_module, name, fn)

    def reset(self) -> dict[str, tuple[float, int]]:
        with self._lock:
            out = {k: (v, self.calls[k]) for k, v in self.seconds.items()}
            self.seconds.clear()
            self.calls.clear()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per round (2 MiB each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16, help="tier reader and writer threads (vLLM and config default: 16)")
    ap.add_argument("--mac", action="store_true", help="verify a keyed MAC (GMAC, format 3) too (mac_key_file)")
    ap.add_argument("--breakdown", action="store_true", help="time each phase per block in an extra round")
    ap.add_argument("--unaligned", action="store_true",
                    help="rows 64 bytes off page alignment: the staging path (a copy per block each way)")
    ap.add_argument("--codec", default="none", choices=["none", "fp8", "fp8_e5m2", "int8", "int4"],
                    help="store KV chunks through the engine path's codec (raw stays the uncompressed bytes)")
    ap.add_argument("--no-verify", action="store_true", help="with --codec: no attention check (no fallback)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.rounds, args.threads = 2, 2, 2
    torch.set_num_threads(1)

    base = tempfile.mkdtemp(prefix="kvtier-fsbench-", dir=args.dir)
    try:
        direct = probe_o_direct(base)
        n = args.blocks
        shape = BLOCK_SHAPE if args.codec == "none" else KV_LAYOUT.chunk_shape
        blocks, src_slab = rows(n, args.unaligned, shape)
        outs, dst_slab = rows(n, args.unaligned, shape)
        for b in blocks:
            b.copy_(torch.randn(shape, dtype=torch.float32))
        key_file = os.path.join(base, "mac.key")
        with open(key_file, "wb") as fh:
            fh.write(os.urandom(32))
        cfg = FilesystemTierConfig(root_dir=os.path.join(base, "tier"), capacity_bytes=1 << 40, codec="none",
                                   eviction_policy="lru", n_read_threads=args.threads,
                                   n_write_threads=args.threads, mac_key_file=key_file if args.mac else None)
        timer = PhaseTimer() if args.breakdown else None
        codec = None if args.codec == "none" else get_kv_codec(args.codec, KV_LAYOUT, verify=not args.no_verify)
        tier = FilesystemTier(cfg, shape, DTYPE, file_ops=timer.file_ops() if timer else None, codec=codec)
        # raw = the uncompressed bytes, whatever the tier stores
        file_bytes = file_bytes_for(get_codec("none").encoded_nbytes(shape, DTYPE))
        total = n * file_bytes
        stored_bytes = n * file_bytes_for(codec.encoded_nbytes(shape, DTYPE)) if codec else total
        buf = AlignedBuffer(file_bytes)
        buf.mv[:] = os.urandom(file_bytes)
        raw_path = os.path.join(base, "raw.bin")

        res: dict[str, list[float]] = {k: [] for k in ("raw_w", "tier_w", "raw_r", "tier_r")}
        for r in range(args.rounds + 1):  # round 0 warms up and is dropped
            keys = [f"r{r}-b{i}".encode() for i in range(n)]
            rw = raw_write(raw_path, buf, n, direct)
            t = time.perf_counter()
            out = store_blocks(tier, keys, blocks, timeout=600)
            tw = time.perf_counter() - t
            assert out.success, out.errors
            rr = raw_read(raw_path, buf, n, direct)
            t = time.perf_counter()
            got = load_blocks(tier, keys, outs, timeout=600)
            tr = time.perf_counter() - t
            assert got.success, got.errors
            if codec is None:
                assert all(torch.equal(a, b) for a, b in zip(outs, blocks)), "the tier returned other bytes"
            else:   # lossy: the decoded chunks must be near the originals (rel. error of int4 is ~0.1)
                assert all(float((a.float() - b.float()).norm() / b.float().norm()) < 0.2 for a, b in zip(outs, blocks))
            for k in keys:  # keep the disk footprint at one round
                tier.remove(k)
            if r:
                for col, v in (("raw_w", rw), ("tier_w", tw), ("raw_r", rr), ("tier_r", tr)):
                    res[col].append(v)
        phases = {}
        if timer is not None:  # a separate round: the wrappers' own cost stays out of the ratios above
            timer.install(tier)
            keys = [f"profile-b{i}".encode() for i in range(n)]
            timer.reset()
            t = time.perf_counter()
            assert store_blocks(tier, keys, blocks, timeout=600).success
            phases["write"] = (time.perf_counter() - t, timer.reset())
            t = time.perf_counter()
            assert load_blocks(tier, keys, outs, timeout=600).success
            phases["read"] = (time.perf_counter() - t, timer.reset())
            timer.uninstall()
        tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"filesystem tier, {n} x 2 MiB blocks ({total / 2**20:.0f} MiB on disk incl. 4 KiB header pages) per round, "
          f"median of {args.rounds} rounds, O_DIRECT={'on' if direct else 'off (unsupported here)'}, "
          f"CRC32 on{', keyed MAC (GMAC, format 3) on' if args.mac else ''}, {args.threads} tier threads per pool, "
          f"rows {'64 bytes off page alignment (staging path)' if args.unaligned else 'page-aligned'}, "
          "raw = 1 sequential stream")
    if codec is not None:
        print(f"codec {args.codec} through the engine path ({KV_LAYOUT.page_order} chunks {KV_LAYOUT.chunk_shape}, "
              f"attention check {'off' if args.no_verify else 'on'}): the tier writes {stored_bytes / 2**20:.0f} MiB "
              f"(nominal) where raw writes the uncompressed {total / 2**20:.0f} MiB; GB/s below are of uncompressed "
              "bytes")
    print("| operation | raw O_DIRECT GB/s | fs tier GB/s | ratio | ratio p25-p75 | target |")
    print("|---|---|---|---|---|---|")
    operations = (("write (store)", "raw_w", "tier_w"), ("read (load)", "raw_r", "tier_r"))
    measured = [(name, rk, tk) for name, rk, tk in operations if res[rk] and res[tk]]
    require_rows(len(measured), "filesystem tier throughput")
    for name, rk, tk in measured:
        ratios = [a / b for a, b in zip(res[rk], res[tk])]
        ratio, (q1, _, q3) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
        # with a codec the write target is keeping up with the disk (>= 1: encode + write of the compressed
        # bytes no slower than writing the raw ones); reads get no target there
        goal = 0.85 if codec is None else (1.0 if rk == "raw_w" else None)
        verdict = "-" if goal is None else f">= {goal} {'ok' if ratio >= goal else 'MISSED'}"
        print(f"| {name} | {total / statistics.median(res[rk]) / 1e9:.2f} | "
              f"{total / statistics.median(res[tk]) / 1e9:.2f} | {ratio:.3f} | {q1:.2f}-{q3:.2f} | {verdict} |")
    for op, (wall, table) in phases.items():
        print(f"\n{op}: {wall * 1e3 / n:.2f} ms wall per block; thread-time per block by phase "
              f"({args.threads} threads overlap, so the sum exceeds the wall time):")
        print("| phase | ms per block | calls per block |")
        print("|---|---|---|")
        for name, (sec, calls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            print(f"| {name} | {sec * 1e3 / n:.3f} | {calls / n:.1f} |")


if __name__ == "__main__":
    main()
