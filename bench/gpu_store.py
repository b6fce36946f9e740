"""Device <-> host store/load throughput of the tiered store against raw pinned ``cudaMemcpyAsync``
(``copy_(non_blocking=True)`` between a device tensor and pinned host memory on a side stream), measured in the
same run with CUDA streams and events (target: ratio >= 0.9). Needs a CUDA device; run by bench/gpu_check.sh.

    python bench/gpu_store.py [--blocks 512] [--rounds 5] [--chunk 128]

"store (D2H)" = TieredStore.put of device blocks into a host tier (pinned slab allocated once), "load (H2D)" =
TieredStore.load of those keys into preallocated device outputs. Both are timed wall-clock from submission to
the completed future (the store synchronises its stream before completing). "raw" issues the same copies on a
side stream; it is timed wall-clock (submission to event synchronize) for the ratio and with CUDA events for
the reference column. Rounds alternate raw and store; the ratio is the median of per-round ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import torch  # noqa: E402

from kvtier_runtime.store import TieredStore  # noqa: E402

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # 32 layers x K/V x 16 tokens x 8 KV heads x 128 dims, bf16 = 2 MiB
DTYPE = torch.bfloat16


def raw_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: torch.cuda.Stream) -> tuple[float, float]:
    """(wall seconds, event seconds) of one pass of async copies on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(stream):
        start.record(stream)
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return time.perf_counter() - t, start.elapsed_time(end) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=512, help="blocks per round (2 MiB each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=128, help="blocks per put/load call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_store.py: no CUDA device (torch.cuda.is_available() is False)")
    dev = torch.device("cuda")
    n, c = args.blocks, args.chunk

    src = torch.randn((n, *BLOCK_SHAPE), device=dev, dtype=torch.float32).to(DTYPE)
    dev_blocks = list(src.unbind(0))
    block_bytes = dev_blocks[0].numel() * dev_blocks[0].element_size()
    total = n * block_bytes
    raw_host = torch.empty((n, *BLOCK_SHAPE), dtype=DTYPE, pin_memory=True)
    raw_host_v = list(raw_host.unbind(0))
    outs = list(torch.empty((n, *BLOCK_SHAPE), device=dev, dtype=DTYPE).unbind(0))
    stream = torch.cuda.Stream(dev)
    store = TieredStore(BLOCK_SHAPE, DTYPE, host_capacity_bytes=total, device=dev)
    assert store.tier("host").pinned_memory, "the host tier must be pinned under CUDA"

    res: dict[str, list[float]] = {k: [] for k in ("raw_d2h", "raw_d2h_ev", "put", "raw_h2d", "raw_h2d_ev", "load")}
    for r in range(args.rounds + 1):  # round 0 warms up (allocations, first-touch) and is dropped
        keys = [f"r{r}-b{i}".encode() for i in range(n)]
        d2h, d2h_ev = raw_copy(raw_host_v, dev_blocks, stream)
        torch.cuda.synchronize()
        t = time.perf_counter()
        futs = [store.put(keys[lo:lo + c], dev_blocks[lo:lo + c]) for lo in range(0, n, c)]
        assert all(f.result().success for f in futs)
        put = time.perf_counter() - t
        h2d, h2d_ev = raw_copy(outs, raw_host_v, stream)
        torch.cuda.synchronize()
        t = time.perf_counter()
        futs = [store.load(keys[lo:lo + c], outs[lo:lo + c]) for lo in range(0, n, c)]
        got = [f.result() for f in futs]
        load = time.perf_counter() - t
        assert all(g.hits == len(keys[lo:lo + c]) for g, lo in zip(got, range(0, n, c))), got
        if r:
            for k, v in (("raw_d2h", d2h), ("raw_d2h_ev", d2h_ev), ("put", put), ("raw_h2d", h2d),
                         ("raw_h2d_ev", h2d_ev), ("load", load)):
                res[k].append(v)
    torch.cuda.synchronize()
    assert all(torch.equal(o, s) for o, s in zip(outs, dev_blocks)), "load returned other bytes"
    store.close()

    name = torch.cuda.get_device_name(dev)
    print(f"{name}: {n} x 2 MiB blocks ({total / 2**30:.2f} GiB) per round, {c} blocks per store call, "
          f"median of {args.rounds} rounds")
    print("| direction | raw async copy GB/s (events) | raw GB/s (wall) | store GB/s (wall) | ratio | target |")
    print("|---|---|---|---|---|---|")
    for label, rk, ek, tk in (("store D2H", "raw_d2h", "raw_d2h_ev", "put"),
                              ("load H2D", "raw_h2d", "raw_h2d_ev", "load")):
        ratio = statistics.median(a / b for a, b in zip(res[rk], res[tk]))
        print(f"| {label} | {total / statistics.median(res[ek]) / 1e9:.1f} | "
              f"{total / statistics.median(res[rk]) / 1e9:.1f} | {total / statistics.median(res[tk]) / 1e9:.1f} | "
              f"{ratio:.3f} | {'>= 0.9 ok' if ratio >= 0.9 else '>= 0.9 MISSED'} |")


if __name__ == "__main__":
    main()
