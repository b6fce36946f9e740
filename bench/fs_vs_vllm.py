"""kvtier's filesystem tier against vLLM 0.33's own ``fs`` tier, both built by vLLM's ``SecondaryTierFactory``
from the tier dicts a deployment renders and driven through the ``SecondaryTierManager`` interface vLLM's
``TieringOffloadingManager`` calls (``submit_store``/``submit_load`` with ``TransferJob``s over the CPU tier's rows,
then ``get_finished_jobs`` polled as the scheduler does each step).

    python bench/fs_vs_vllm.py [--dir DIR] [--chunks-mib 0.25,2,8] [--mib-per-round 256] [--rounds 5]

Run it with the env ``.ci/vllm-env`` builds (it needs vLLM 0.33.0's scheduler-side modules). Per chunk size and
kvtier variant (``crc``: CRC32 only; ``mac``: keyed MAC (GMAC, format 3) as well), each round stores the same chunks to
vLLM's tier and to kvtier's, then loads them back, alternating which goes first, so drift on a shared machine hits
both. GB/s counts chunk bytes (not kvtier's 4 KiB header). Differences that the numbers include: vLLM's tier
neither checksums nor fsyncs (a crash can leave a torn block under its final name, served as a hit); kvtier's
fsyncs every block before it is visible and verifies it before serving.

``compare(...)`` is the reusable entry point (the real-engine tests call it with small sizes).
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
for p in (_ROOT / "runtime", _ROOT / "tests" / "vllm"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
from kvtier_runtime.config import VLLM_ADAPTER_MODULE, VLLM_SECONDARY_TIER_CLASS, FilesystemTierConfig  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_driver import key, offloading_config  # noqa: E402  (the one builder of vLLM's normalized config)


@dataclass(frozen=True)
class Row:
    chunk_bytes: int
    variant: str  # "crc" | "mac"
    op: str  # "write" | "read"
    vllm_gbs: float
    kvtier_gbs: float
    ratio: float  # kvtier / vLLM, median of per-round ratios
    ratio_p25: float
    ratio_p75: float


def _tier_dicts(root: str, variant: str, key_file: str, threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    vllm_fs = {"type": "fs", "root_dir": os.path.join(root, "vllm"), "n_read_threads": threads,
               "n_write_threads": threads}
    cfg = FilesystemTierConfig(root_dir=os.path.join(root, "kvtier"), capacity_bytes=1 << 40, codec="none",
                               eviction_policy="lru", n_read_threads=threads, n_write_threads=threads,
                               mac_key_file=key_file if variant == "mac" else None)
    kvtier = {"type": VLLM_SECONDARY_TIER_CLASS, "module_path": VLLM_ADAPTER_MODULE, **cfg.to_kwargs()}
    return vllm_fs, kvtier


def _run_job(tier: Any, job_id: int, keys: list[bytes], is_promotion: bool, timeout: float = 600.0) -> float:
    job = TransferJob(job_id=job_id, keys=keys, chunk_ids=np.arange(len(keys), dtype=np.int64),
                      is_promotion=is_promotion, req_context=ReqContext(req_id=f"bench-{job_id}"))
    t = time.perf_counter()
    (tier.submit_load if is_promotion else tier.submit_store)(job)
    deadline = time.monotonic() + timeout
    while True:
        done = [r for r in tier.get_finished_jobs() if r.job_id == job_id]
        if done:
            elapsed = time.perf_counter() - t
            if not done[0].success:
                raise RuntimeError(f"{type(tier).__name__}: job {job_id} failed")
            return elapsed
        if time.monotonic() > deadline:
            raise TimeoutError(f"{type(tier).__name__}: job {job_id} did not finish")
        time.sleep(0.0005)  # the scheduler polls every step; 0.5 ms is finer than a step


def compare(
    *, base_dir: str | None = None, chunk_sizes: tuple[int, ...] = (256 << 10, 2 << 20, 8 << 20),
    bytes_per_round: int = 256 << 20, rounds: int = 5, variants: tuple[str, ...] = ("crc", "mac"),
    threads: int = 16, log: Callable[[str], None] = lambda s: None,
) -> list[Row]:
    """Measure both tiers; returns one Row per (chunk size, variant, op). Checks every byte read back."""
    base = tempfile.mkdtemp(prefix="kvtier-vs-vllm-", dir=base_dir)
    rows: list[Row] = []
    try:
        key_file = os.path.join(base, "mac.key")
        with open(key_file, "wb") as fh:
            fh.write(os.urandom(32))
        job_ids = iter(range(1, 1 << 30))
        for chunk in chunk_sizes:
            n = max(4, bytes_per_round // chunk)
            region = mmap.mmap(-1, n * chunk)  # the CPU tier's rows (vLLM's is an mmap too: page-aligned rows)
            view = memoryview(region).cast("B", (n, chunk))
            rows_np = np.frombuffer(region, dtype=np.uint8).reshape(n, chunk)
            rng = np.random.default_rng(chunk)
            for variant in variants:
                root = os.path.join(base, f"{chunk}-{variant}")
                vd, kd = _tier_dicts(root, variant, key_file, threads)
                spec = TieringOffloadingSpec(offloading_config(
                    f"bench-{uuid.uuid4().hex[:8]}", {"cpu_bytes_to_use": n * chunk, "secondary_tiers": [vd, kd]},
                    block_bytes=chunk))
                tiers = {"vllm": SecondaryTierFactory.create_secondary_tier(vd, view, spec),
                         "kvtier": SecondaryTierFactory.create_secondary_tier(kd, view, spec)}
                times: dict[tuple[str, str], list[float]] = {}
                try:
                    for r in range(rounds + 1):  # round 0 warms up and is dropped
                        keys = [key(r * 1_000_000 + i) for i in range(n)]
                        payload = rng.integers(0, 256, size=(n, chunk), dtype=np.uint8)
                        order = ("vllm", "kvtier") if r % 2 else ("kvtier", "vllm")
                        for op in ("write", "read"):
                            for name in order:
                                if op == "write":
                                    rows_np[:] = payload
                                else:
                                    rows_np[:] = 0
                                dt = _run_job(tiers[name], next(job_ids), keys, is_promotion=(op == "read"))
                                if op == "read" and not np.array_equal(rows_np, payload):
                                    raise AssertionError(f"{name} returned other bytes ({chunk} B chunks)")
                                if r:
                                    times.setdefault((name, op), []).append(dt)
                        for k in keys:  # keep one round on disk
                            assert tiers["kvtier"].tier.remove(tiers["kvtier"].tier_key(k))
                            os.unlink(tiers["vllm"].file_mapper.get_file_name(k))
                finally:
                    for t in tiers.values():
                        t.shutdown()
                for op in ("write", "read"):
                    v, k = times[("vllm", op)], times[("kvtier", op)]
                    ratios = [a / b for a, b in zip(v, k)]
                    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                    row = Row(chunk, variant, op, n * chunk / statistics.median(v) / 1e9,
                              n * chunk / statistics.median(k) / 1e9, statistics.median(ratios), q[0], q[2])
                    rows.append(row)
                    log(f"{chunk >> 10} KiB {variant} {op}: vLLM {row.vllm_gbs:.2f} GB/s, kvtier {row.kvtier_gbs:.2f}"
                        f" GB/s, ratio {row.ratio:.2f}")
            del rows_np
            view.release()
            region.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def print_table(rows: list[Row], rounds: int) -> None:
    print(f"kvtier fs tier vs vLLM 0.33 fs tier, through SecondaryTierFactory + the SecondaryTierManager API, "
          f"median of {rounds} rounds (ratio > 1: kvtier faster)")
    print("| chunk | kvtier checks | op | vLLM fs GB/s | kvtier GB/s | ratio | ratio p25-p75 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        size = f"{r.chunk_bytes >> 20} MiB" if r.chunk_bytes >= 1 << 20 else f"{r.chunk_bytes >> 10} KiB"
        checks = "CRC32" if r.variant == "crc" else "CRC32 + GMAC"
        print(f"| {size} | {checks} | {r.op} | {r.vllm_gbs:.2f} | {r.kvtier_gbs:.2f} | {r.ratio:.2f} | "
              f"{r.ratio_p25:.2f}-{r.ratio_p75:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--chunks-mib", default="0.25,2,8")
    ap.add_argument("--mib-per-round", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="crc,mac")
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    sizes = tuple(int(float(x) * (1 << 20)) for x in args.chunks_mib.split(","))
    rows = compare(base_dir=args.dir, chunk_sizes=sizes, bytes_per_round=args.mib_per_round << 20,
                   rounds=args.rounds, variants=tuple(args.variants.split(",")), threads=args.threads,
                   log=lambda s: print(s, file=sys.stderr, flush=True))
    print_table(rows, args.rounds)


if __name__ == "__main__":
    main()
