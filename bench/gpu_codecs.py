"""Codec throughput on a CUDA device against the device's own copy bandwidth (target: >= 0.5 of it).

    python bench/gpu_codecs.py              # eager codecs + torch.compile'd fp8/int4 kernels, 2 and 64 MiB blocks
    python bench/gpu_codecs.py --no-compile

Called by bench/gpu_check.sh on a lent GPU; exits 3 with a message when no CUDA device is present. Times are
CUDA-event timings of back-to-back calls (median of 5 runs of ``--iters`` calls); GB/s counts input bytes.
The compiled kernels are a measurement, not the codecs' code path: they show what fusing a chunk's ~15 eager
kernels into one or two would gain, with their compile time printed separately (it stays out of the hot path).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "runtime"))

from kvtier_runtime.codecs import decode, get_codec

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}), "fp8": ("fp8", {}), "fp8_e5m2": ("fp8_e5m2", {}), "int8": ("int8", {}),
    "int4": ("int4", {}), "int4/chan": ("int4", {"scales": "channel"})}
TARGET = 0.5


def cuda_time(fn, iters: int) -> float:
    """Seconds per call, median of 5 runs of ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(runs)


# ---- fused reference kernels (torch.compile) -----------------------------------------------------------------

def fp8_encode_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    xf = x.float().view(scales.shape[0], -1)
    s = (xf.abs().amax(dim=1, keepdim=True) * (1.0 / 448.0)).clamp_min(torch.finfo(torch.float32).tiny)
    codes.copy_((xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(codes.shape))
    scales.copy_(s.view(-1))


def fp8_decode_ref(codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor) -> None:
    v = codes.view(torch.float8_e4m3fn).float().view(scales.shape[0], -1) * scales.view(-1, 1)
    dst.copy_(v.view(dst.shape).to(dst.dtype))


def int4_encode_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    xf = x.float().view(scales.shape[0], -1)
    s = (xf.abs().amax(dim=1, keepdim=True) * (1.0 / 7.0)).clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf / s).round().clamp(-7, 7).to(torch.int16).view(-1, 2)
    codes.copy_(((q[:, 0] & 15) | ((q[:, 1] & 15) << 4)).to(torch.uint8).view(codes.shape))
    scales.copy_(s.view(-1))


def int4_decode_ref(codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor) -> None:
    c = codes.to(torch.int16)
    lo = ((c << 12).to(torch.int16) >> 12).float()
    hi = ((c << 8).to(torch.int16) >> 12).float()
    v = torch.stack([lo, hi], dim=-1).view(scales.shape[0], -1) * scales.view(-1, 1)
    dst.copy_(v.view(dst.shape).to(dst.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-mib", default="2,64")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_codecs: no CUDA device; nothing measured", file=sys.stderr)
        return 3
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {args.dtype}; "
          f"GB/s of input bytes; target codec/copy >= {TARGET}")
    print("| block | codec | enc GB/s | dec GB/s | enc/copy | dec/copy | rt/copy | target |")
    print("|------:|-------|---------:|---------:|---------:|---------:|--------:|-------:|")
    compiled = {}
    if not args.no_compile:
        for name, fn in (("fp8 enc", fp8_encode_ref), ("fp8 dec", fp8_decode_ref),
                         ("int4 enc", int4_encode_ref), ("int4 dec", int4_decode_ref)):
            compiled[name] = torch.compile(fn, dynamic=False)
    for mib in (float(m) for m in args.block_mib.split(",")):
        tokens = max(1, int(mib * 2**20) // (8 * 128 * 2))
        x = torch.randn((tokens, 8, 128), device=dev).to(dtype)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        t_copy = cuda_time(lambda dst=dst, x=x: dst.copy_(x), args.iters)
        copy_rate = nbytes / t_copy / 1e9
        print(f"| {mib:g} MiB | copy_ | {copy_rate:8.1f} | {copy_rate:8.1f} | 1.000 | 1.000 | 0.500 | |")
        for label, (name, opts) in VARIANTS.items():
            codec = get_codec(name, **opts)
            out = torch.empty(codec.max_encoded_nbytes(x.shape, dtype), dtype=torch.uint8, device=dev)
            te = cuda_time(lambda codec=codec, out=out, x=x: codec.encode(x, out), args.iters)
            td = cuda_time(lambda dst=dst, out=out: decode(out, out=dst), args.iters)
            enc, dec = nbytes / te / 1e9, nbytes / td / 1e9
            rt = 1 / (1 / enc + 1 / dec)
            ok = "ok" if min(enc, dec) / copy_rate >= TARGET else "MISS"
            print(f"| {mib:g} MiB | {label} | {enc:8.1f} | {dec:8.1f} | {enc / copy_rate:8.3f} | "
                  f"{dec / copy_rate:8.3f} | {rt / copy_rate:7.3f} | {ok} |", flush=True)
        for kind, group, code_bytes in (("fp8", 128, 1.0), ("int4", 32, 0.5)):
            if args.no_compile:
                break
            n = x.numel()
            codes = torch.empty(int(n * code_bytes), dtype=torch.uint8, device=dev)
            scales = torch.empty(math.ceil(n / group), device=dev)
            enc_fn, dec_fn = compiled[f"{kind} enc"], compiled[f"{kind} dec"]
            t0 = time.perf_counter()
            enc_fn(x, codes, scales)
            dec_fn(codes, scales, dst)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            te = cuda_time(lambda codes=codes, enc_fn=enc_fn, scales=scales, x=x: enc_fn(x, codes, scales), args.iters)
            td = cuda_time(lambda codes=codes, dec_fn=dec_fn, dst=dst, scales=scales: dec_fn(codes, scales, dst), args.iters)
            enc, dec = nbytes / te / 1e9, nbytes / td / 1e9
            rt = 1 / (1 / enc + 1 / dec)
            err = ((dst.float() - x.float()).norm() / x.float().norm()).item()
            ok = "ok" if min(enc, dec) / copy_rate >= TARGET else "MISS"
            print(f"| {mib:g} MiB | {kind} compiled (first call {compile_s:.1f}s, err {err:.4f}) | {enc:8.1f} | "
                  f"{dec:8.1f} | {enc / copy_rate:8.3f} | {dec / copy_rate:8.3f} | {rt / copy_rate:7.3f} | {ok} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
