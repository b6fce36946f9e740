"""vLLM's CUDA page layouts, checked against the indexing of vLLM's own reshape-and-cache op.

The layout-aware codecs quantise K per channel and V per token, so they must know where each (layer, K/V, head,
token, channel) sits in a chunk's bytes. For the GPU backends that order is fixed by how vLLM 0.33 allocates a
layer's cache and how ``reshape_and_cache_flash`` writes a token into it. Both are re-implemented here in pure
torch (the CUDA op cannot run on this machine), line by line from vLLM 0.33's sources:

1. ``vllm/v1/kv_cache_layout.py`` L18-28: the logical per-layer cache is ``[B, H, N, C]`` (RFC #42082,
   ``[L, B, H, N, C]`` without L); ``LBHNC = (0, 1, 2, 3, 4)`` keeps it, ``LBNHC = (0, 1, 3, 2, 4)`` stores
   ``[B, N, H, C]``; ``layer_view_order`` (L35-37) drops L: ``(0, 1, 2, 3)`` / ``(0, 2, 1, 3)``. The cache is
   allocated in the physical order and permuted back to the logical view, as ``create_kv_caches_with_random_flash``
   (``vllm/utils/torch_utils.py`` L613-642) does.
2. ``vllm/v1/attention/backends/flash_attn.py`` L1448 (and L1257): ``key_cache, value_cache =
   kv_cache.transpose(1, 2).split(self.head_size, dim=-1)``: C is K's D channels then V's, views ``[B, N, H, D]``.
   FlashInfer (``flashinfer.py`` L2316-2349) permutes by the same ``layer_view_order`` and splits C by
   ``head_size`` likewise: NHD is LBNHC, HND is LBHNC.
3. ``reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, ...)`` writes token ``i`` to
   ``key_cache[slot // block_size, slot % block_size, :, :] = key[i]`` (and V alike): the reference its own test
   holds the CUDA and Triton kernels to (vLLM's ``tests/kernels/attention/test_cache.py`` L421-426, NHD view;
   the kernel indexes through the views' strides, so the same assignment on these views is what it writes).
4. kvtier copies a layer's block ``b`` as the bytes of the physical cache's ``[b]`` (B is outermost in both
   layouts), layer after layer (``engines/page_copy.py``).

A layout the codec describes wrongly would read K as V or mix heads; each case below would fail then.
"""
from __future__ import annotations

import pytest
import torch
from kvtier_runtime.codecs import CodecError, KVChunkCodec, KVLayout
from kvtier_runtime.codecs.kv import canonical, to_stage
from kvtier_runtime.codecs.layout import VLLM_PAGE_ORDERS
from plugins.kv_accuracy import attention_cosine

# vllm/v1/kv_cache_layout.py L23-24, and layer_view_order (L35-37) of each
LAYER_VIEW_ORDER = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3)}
BACKENDS = sorted({b for b, _ in VLLM_PAGE_ORDERS})


def _engine_caches(layout_name: str, layers: int, blocks: int, heads: int, bs: int, d: int, dtype):
    """Per layer: (the physical tensor kvtier copies pages from, the logical [B, H, N, 2D] view) (step 1)."""
    order = LAYER_VIEW_ORDER[layout_name]
    logical = (blocks, heads, bs, 2 * d)
    inverse = [order.index(i) for i in range(4)]
    out = []
    for _ in range(layers):
        phys = torch.full(tuple(logical[i] for i in order), float("nan"), dtype=dtype)
        out.append((phys, phys.permute(*inverse)))
    return out


def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, block_size):
    """Step 3: vLLM's reference for the op (the CPU loop its kernel test compares against)."""
    for i, slot in enumerate(slot_mapping.tolist()):
        key_cache[slot // block_size, slot % block_size, :, :] = key[i]
        value_cache[slot // block_size, slot % block_size, :, :] = value[i]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_page_orders_match_vllm_reshape_and_cache(backend, layout_name, dtype):
    layers, heads, bs, d, pages, blocks = 3, 4, 16, 64, 2, 5
    gen = torch.Generator().manual_seed(7)
    caches = _engine_caches(layout_name, layers, blocks, heads, bs, d, dtype)
    # a request's 2 blocks, 3 and 1 (not adjacent, not in order), filled token by token through the op
    block_ids = [3, 1]
    slots = torch.tensor([b * bs + t for b in block_ids for t in range(bs)])
    k = torch.randn((layers, len(slots), heads, d), generator=gen).to(dtype)
    v = torch.randn((layers, len(slots), heads, d), generator=gen).to(dtype)
    k[..., :2] *= 20.0   # outlier channels, as real keys have
    for layer, (_, view) in enumerate(caches):
        key_cache, value_cache = view.transpose(1, 2).split(d, dim=-1)   # step 2
        _reshape_and_cache_flash(k[layer], v[layer], key_cache, value_cache, slots, bs)
    # step 4: the host row kvtier's worker fills for this chunk
    row = torch.cat([phys[b].reshape(-1) for phys, _ in caches for b in block_ids])
    lay = KVLayout.from_vllm(
        type("Spec", (), dict(block_size=bs, num_kv_heads=heads, head_size=d, head_size_v=d, dtype=dtype))(),
        num_layers=layers, backend=backend, kv_cache_layout=f"KVCacheLayout.{layout_name}", pages=pages)
    assert lay.nbytes == row.numel() * row.element_size()
    c = canonical(lay.stage_layout, to_stage(lay, row), layers)      # [L, 2, H, P, T, D]
    want_k = k.view(layers, pages, bs, heads, d).permute(0, 3, 1, 2, 4)
    want_v = v.view(layers, pages, bs, heads, d).permute(0, 3, 1, 2, 4)
    assert torch.equal(c[:, 0], want_k) and torch.equal(c[:, 1], want_v)
    # and what the codec keeps of that row is attention-accurate (outlier keys), in the engine's own byte order
    codec = KVChunkCodec("int4", lay)
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
    n = codec.encode(row, out)
    back = torch.full_like(row, float("nan"))
    codec.decode(out[:n], back)
    assert attention_cosine(lay, row, back) >= 0.99


def test_layouts_not_checked_against_vllm_are_refused():
    spec = type("Spec", (), dict(block_size=16, num_kv_heads=4, head_size=64, head_size_v=64, dtype="bfloat16"))()
    for layout_name in ("LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        with pytest.raises(CodecError, match="no known page order"):
            KVLayout.from_vllm(spec, num_layers=2, backend="FLASH_ATTN", kv_cache_layout=layout_name)
