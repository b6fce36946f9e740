"""Does verified int4 pay on K with outlier channels? Per held-out set: the share of chunks stored as int4, the
stored bytes against raw, and the attention cosine (min and median over chunks of the worst over layers and
heads, 64 random queries: ``plugins.kv_accuracy.attention_cosine``), for int4 schemes 1 (no sparse K channels),
2 (sparse K channels) and 3 (the default since it was judged on a trained model's KV: docs/compression.md).

    python bench/kv_int4.py                     # 8 chunks per set, 1 thread, deterministic (seeded)
    python bench/kv_int4.py --chunks 2 --sets "outlier x20"
    python bench/kv_int4.py --why               # why plain int4 falls back: the check's error, K's and V's shares

The chunks are held out: seeds 5000 and up, which the sparse-K design (ratio, counts) was not tuned on. Sets:
normal K and V; K with 4 (or 16) channels scaled x5..x50, the same channels in every layer, head and token (the
``bench/codecs.py --kv-proxy`` kinds); K with 4 channels offset by +20 (a large constant with unit variation, the
shape real K caches' outlier channels mostly have); "mixed per head": each layer and head its own 1 to 6 outlier
channels, each scaled x5..x50 or offset by +5..+50 (drawn per channel); each in pages of 256 tokens, and the x20
set also in 16-token pages (16 pages per chunk, vLLM's default block size).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench.tables

from kvtier_runtime.accuracy.chunks import stored_as
from kvtier_runtime.codecs import KVLayout, get_kv_codec
from kvtier_runtime.codecs.kv import canonical
from kvtier_runtime.codecs.registry import peek_header
from plugins.kv_accuracy import attention_cosine, chunk_error

from bench.tables import SMOKE_HELP, require_rows

BASE: dict[str, Any] = dict(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_order="HKTD")
PAGES_256: dict[str, Any] = dict(block_tokens=256, pages=1)
PAGES_16: dict[str, Any] = dict(block_tokens=16, pages=16)
# name -> (pages, outlier scale, outlier channels, offset instead of scale); scale -1: "mixed per head"
SETS: dict[str, tuple[dict[str, Any], float, int, bool]] = {
    "normal": (PAGES_256, 0.0, 0, False),
    "outlier x5": (PAGES_256, 5.0, 4, False),
    "outlier x10": (PAGES_256, 10.0, 4, False),
    "outlier x20": (PAGES_256, 20.0, 4, False),
    "outlier x50": (PAGES_256, 50.0, 4, False),
    "outlier x20 16ch": (PAGES_256, 20.0, 16, False),
    "offset +20": (PAGES_256, 20.0, 4, True),
    "mixed per head": (PAGES_256, -1.0, 6, False),
    "outlier x20 16-token pages": (PAGES_16, 20.0, 4, False),
}


# the int4 variants compared: scheme 1 (the first layout-aware int4), scheme 2 (1 with K's outlier channels kept
# apart), scheme 3 (the default: per-channel K ranges at 5/6 bits, rotated V, sinks exact; 2 when 3 is over budget)
VARIANTS: dict[str, dict[str, Any]] = {"scheme 1": dict(int4_scheme=1, sparse_k=False),
                                       "scheme 2": dict(int4_scheme=1), "scheme 3": dict()}


def chunk(lay: KVLayout, seed: int, scale: float, n_out: int, offset: bool) -> torch.Tensor:
    """A chunk in ``lay``'s (HKTD) order: normal K and V, ``n_out`` K channels scaled by (or offset by) ``scale``,
    the same channels in every layer, head and token."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, lay.num_kv_heads, lay.tokens, lay.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if scale < 0:   # mixed: per layer and head, 1..n_out channels, each its own scale or offset
        for layer in range(lay.num_layers):
            for head in range(lay.num_kv_heads):
                count = int(torch.randint(1, n_out + 1, (1,), generator=gen))
                for c in torch.randperm(lay.head_dim, generator=gen)[:count].tolist():
                    size = 5.0 + 45.0 * float(torch.rand((), generator=gen))
                    if float(torch.rand((), generator=gen)) < 0.5:
                        k[layer, head, :, c] += size
                    else:
                        k[layer, head, :, c] *= size
    elif n_out:
        ch = torch.randperm(lay.head_dim, generator=gen)[:n_out]
        if offset:
            k[..., ch] += scale
        else:
            k[..., ch] *= scale
    canon = torch.stack([k, v], dim=1).view(lay.num_layers, 2, lay.num_kv_heads, lay.pages, lay.block_tokens,
                                            lay.head_dim)
    out = torch.empty(lay.chunk_shape, dtype=getattr(torch, lay.dtype))
    out.permute(lay.canonical_permutation()).copy_(canon)
    return out.reshape(-1)


def why(names: list[str], n_chunks: int) -> None:
    """Plain int4 (no check) on each set: the check's error (``chunk_error``: the probe-query attention error the
    verified encode compares with the budget, 0.14) of the decoded chunk, of the chunk with only K decoded (V
    original), with only V decoded, and with K decoded but its n largest channels per (layer, head, page) exact."""
    print("# plain int4 (scheme 1, unverified); check error = probe-query attention error, budget 0.14 (0.133 for "
          "the sampled check); max over the set's chunks")
    print("| set | int4 | K only | V only | K, top 4 channels exact | K, top 16 channels exact |")
    print("|-----|-----:|-------:|-------:|------------------------:|-------------------------:|")
    for name in names:
        pages, scale, n_out, offset = SETS[name]
        lay = KVLayout(**BASE, **pages)
        codec = get_kv_codec("int4", lay, verify=False, int4_scheme=1)
        out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
        errs: list[list[float]] = [[] for _ in range(5)]
        for i in range(n_chunks):
            x = chunk(lay, 5000 + i, scale, n_out, offset)
            n = codec.encode(x, out)
            y = torch.empty_like(x)
            codec.decode(out[:n], y)
            cx, cy = canonical(lay, x, lay.num_layers), canonical(lay, y, lay.num_layers)
            k_only, v_only = x.clone(), x.clone()
            canonical(lay, k_only, lay.num_layers)[:, 0].copy_(cy[:, 0])
            canonical(lay, v_only, lay.num_layers)[:, 1].copy_(cy[:, 1])
            variants = [y, k_only, v_only]
            for keep in (4, 16):
                z = y.clone()
                kx, kz = cx[:, 0], canonical(lay, z, lay.num_layers)[:, 0]     # [L, H, P, T, D]
                top = kx.float().abs().amax(dim=3).topk(keep, dim=3).indices
                idx = top.unsqueeze(3).expand(*top.shape[:3], lay.block_tokens, keep)
                kz.scatter_(4, idx, kx.gather(4, idx))
                variants.append(z)
            for e, v in zip(errs, variants):
                e.append(chunk_error(lay, x, v))
        print(f"| {name} | " + " | ".join(f"{max(e):.3f}" for e in errs) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=8, help="chunks per set (default 8)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sets", default=",".join(SETS), help="comma-separated set names (default: all)")
    p.add_argument("--why", action="store_true", help="why plain int4 falls back (check error by K and V)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.chunks, args.sets = 1, "normal"
    names = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETS]
    if unknown or args.chunks < 1:
        p.error(f"--sets: unknown {unknown}; known: {', '.join(SETS)}" if unknown else "--chunks must be >= 1")
    torch.set_num_threads(args.threads)
    if args.why:
        why(names, args.chunks)
        return
    print(f"# {args.chunks} held-out chunks per set (seeds 5000+), 2 layers x 8 heads x 256 tokens x 128, bf16, HKTD; "
          "verified int4 (the default check and fallback chain); cos: attention cosine, worst over layers and "
          "heads, 64 random queries; int4 share: chunks stored as int4 (not fallen back); encode: median ms per "
          "verified encode")
    print("| set | int4 | int4 share | stored/raw (mean) | cos min | cos median | encode ms | stored as |")
    print("|-----|----------|-----------:|------------------:|--------:|-----------:|----------:|-----------|")
    rows = 0
    for name in names:
        pages, scale, n_out, offset = SETS[name]
        lay = KVLayout(**BASE, **pages)
        for variant, kwargs in VARIANTS.items():
            codec = get_kv_codec("int4", lay, **kwargs)
            out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
            cos, ratio, stored, ms = [], [], [], []
            for i in range(args.chunks):
                x = chunk(lay, 5000 + i, scale, n_out, offset)
                t0 = time.perf_counter()
                n = codec.encode(x, out)
                ms.append(1e3 * (time.perf_counter() - t0))
                y = torch.empty_like(x)
                codec.decode(out[:n], y)
                header = peek_header(out[:n])
                stored.append(stored_as(header.codec, header.scheme))
                cos.append(attention_cosine(lay, x, y, seed=900 + i))
                ratio.append(n / lay.nbytes)
            share = sum(s.startswith("int4") for s in stored) / len(stored)
            kinds = ", ".join(f"{s} {stored.count(s)}" for s in sorted(set(stored)))
            print(f"| {name} | {variant} | {share:.2f} | {statistics.mean(ratio):.3f} | "
                  f"{min(cos):.4f} | {statistics.median(cos):.4f} | {statistics.median(ms):.1f} | {kinds} |", flush=True)
            rows += 1
    require_rows(rows, "verified int4 per set")


if __name__ == "__main__":
    main()
