"""Filesystem tier write/read throughput (checksums on) against raw sequential O_DIRECT I/O of the same bytes
to the same disk, measured in the same run (target: ratio >= 0.85).

    python bench/fs_tier.py [--dir DIR] [--blocks 128] [--rounds 5] [--threads 16]

"raw write" writes the exact bytes the tier writes (blocks x file size) with O_DIRECT, 2 MiB + header per
``write``, sequentially into one preallocated-by-writing file, then one fdatasync: the disk's streaming
ceiling. "raw read" reads that file back the same way. The tier writes one file per block (header + CRC32 +
tmp file + fdatasync + rename, on --threads writer threads) and reads them back into preallocated tensors
(O_DIRECT read, CRC check, decode) on --threads reader threads. Rounds alternate raw and tier so drift on a
shared machine hits both; the ratio is the median of per-round ratios. O_DIRECT bypasses the page cache on
both sides, so neither side is served from memory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import torch  # noqa: E402

from kvtier_runtime.codecs import get_codec  # noqa: E402
from kvtier_runtime.config import FilesystemTierConfig  # noqa: E402
from kvtier_runtime.fs import FilesystemTier  # noqa: E402
from kvtier_runtime.fs.fileio import O_DIRECT, AlignedBuffer, probe_o_direct  # noqa: E402
from kvtier_runtime.fs.format import file_bytes_for  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per round (2 MiB each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16, help="tier reader and writer threads (vLLM and config default: 16)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    base = tempfile.mkdtemp(prefix="kvtier-fsbench-", dir=args.dir)
    try:
        direct = probe_o_direct(base)
        n = args.blocks
        blocks = [torch.randn(BLOCK_SHAPE, dtype=torch.float32).to(DTYPE) for _ in range(n)]
        outs = [torch.empty(BLOCK_SHAPE, dtype=DTYPE) for _ in range(n)]
        cfg = FilesystemTierConfig(root_dir=os.path.join(base, "tier"), capacity_bytes=1 << 40, codec="none",
                                   eviction_policy="lru", n_read_threads=args.threads,
                                   n_write_threads=args.threads)
        tier = FilesystemTier(cfg, BLOCK_SHAPE, DTYPE)
        file_bytes = file_bytes_for(get_codec("none").encoded_nbytes(BLOCK_SHAPE, DTYPE))
        total = n * file_bytes
        buf = AlignedBuffer(file_bytes)
        buf.mv[:] = os.urandom(file_bytes)
        raw_path = os.path.join(base, "raw.bin")

        res: dict[str, list[float]] = {k: [] for k in ("raw_w", "tier_w", "raw_r", "tier_r")}
        for r in range(args.rounds + 1):  # round 0 warms up and is dropped
            keys = [f"r{r}-b{i}".encode() for i in range(n)]
            rw = raw_write(raw_path, buf, n, direct)
            t = time.perf_counter()
            out = tier.store(keys, blocks, timeout=600)
            tw = time.perf_counter() - t
            assert out.success, out.errors
            rr = raw_read(raw_path, buf, n, direct)
            t = time.perf_counter()
            got = tier.load(keys, outs, timeout=600)
            tr = time.perf_counter() - t
            assert got.success, got.errors
            assert all(torch.equal(a, b) for a, b in zip(outs, blocks)), "the tier returned other bytes"
            for k in keys:  # keep the disk footprint at one round
                tier.remove(k)
            if r:
                for k, v in (("raw_w", rw), ("tier_w", tw), ("raw_r", rr), ("tier_r", tr)):
                    res[k].append(v)
        tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"filesystem tier, {n} x 2 MiB blocks ({total / 2**20:.0f} MiB on disk incl. 4 KiB headers) per round, "
          f"median of {args.rounds} rounds, O_DIRECT={'on' if direct else 'off (unsupported here)'}, "
          f"CRC32 on, {args.threads} tier threads per pool, raw = 1 sequential stream")
    print("| operation | raw O_DIRECT GB/s | fs tier GB/s | ratio | ratio p25-p75 | target |")
    print("|---|---|---|---|---|---|")
    for name, rk, tk in (("write (store)", "raw_w", "tier_w"), ("read (load)", "raw_r", "tier_r")):
        ratios = [a / b for a, b in zip(res[rk], res[tk])]
        ratio, (q1, _, q3) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
        print(f"| {name} | {total / statistics.median(res[rk]) / 1e9:.2f} | "
              f"{total / statistics.median(res[tk]) / 1e9:.2f} | {ratio:.3f} | {q1:.2f}-{q3:.2f} | "
              f"{'>= 0.85 ok' if ratio >= 0.85 else '>= 0.85 MISSED'} |")


if __name__ == "__main__":
    main()
