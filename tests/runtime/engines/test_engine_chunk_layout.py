"""The engine path's choice of codec: which layout vLLM's facts describe (``engines.chunk_layout``) and what a
filesystem tier behind kvtier's host tier then stores. Real tiers on a temporary directory, real shared memory;
vLLM itself is exercised in tests/engine (these run without it: the facts are what the adapter gathers there).
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from kvtier_runtime.codecs import STATS, KVChunkCodec, KVLayout, peek_header
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.engines.chunk_layout import (
    FLAT_REASONS,
    ChunkFacts,
    check_worker_pages,
    chunk_layout,
    tier_codec,
)
from kvtier_runtime.engines.host_region import HostRegion
from kvtier_runtime.fs.format import HEADER_BYTES, parse_header
from kvtier_runtime.store.books import HIT, RETRY, OffloadBooks
from plugins.kv_accuracy import attention_cosine
from plugins.runtime import engine_books

from tests.runtime.codecs.test_codecs_kv import make_chunk

# vLLM 0.32 on CPU with the e2e model's shape class: 4 layers, 4 KV heads of 64, float32, 16-token blocks, 2 blocks
# per chunk; the bytes per block are what vLLM computes (2 x heads x tokens x head size x 4 bytes x layers).
CPU = ChunkFacts(num_layers=4, block_tokens=16, blocks_per_chunk=2, kv_dtype="float32",
                 worker_kv_bytes_per_block=4 * 2 * 4 * 16 * 64 * 4, num_kv_heads=4, head_dim=64,
                 backend="CPU_ATTN", kv_cache_layout="LBHNC", cpu_attn_isa="vec")


def _blob_offset(path) -> int:
    """Where the codec blob starts in a block file (its header says which format)."""
    return parse_header(path.read_bytes()[:HEADER_BYTES]).blob_offset


def test_cpu_facts_give_the_cpu_vec_layout_of_a_host_row():
    d = chunk_layout(CPU)
    assert not d.flat and d.reason == ""
    lay = d.layout
    assert (lay.num_layers, lay.block_tokens, lay.num_kv_heads, lay.head_dim, lay.dtype) == (4, 16, 4, 64, "float32")
    # one host row = every layer's blocks_per_chunk pages, layer-major (how PageCopier fills it)
    assert (lay.page_order, lay.pages, lay.outer) == ("CPU_VEC", 2, "LP")
    assert lay.nbytes == CPU.worker_kv_bytes_per_block * CPU.blocks_per_chunk
    # vLLM 0.32's CPU config reports no layout: its backend has only LBHNC
    assert chunk_layout(dataclasses.replace(CPU, kv_cache_layout=None)).layout == lay
    # GPU backends whose page order is known
    gpu = dataclasses.replace(CPU, backend="FLASH_ATTN", kv_cache_layout="LBNHC", cpu_attn_isa=None,
                              kv_dtype="torch.bfloat16", worker_kv_bytes_per_block=CPU.worker_kv_bytes_per_block // 2)
    assert chunk_layout(gpu).layout.page_order == "THKD"


@pytest.mark.parametrize("change, reason, words", [
    (dict(num_groups=2), "kv_groups", "2 KV cache groups"),
    # two workers whose bytes per block are not every layer of their heads: pipeline stages, not TP shares
    (dict(world_size=2, worker_kv_bytes_per_block=CPU.worker_kv_bytes_per_block // 2), "tensor_parallel",
     "2 workers"),
    (dict(use_mla=True), "mla", "latent"),
    (dict(kv_dtype="fp8_e4m3"), "kv_dtype", "fp8_e4m3"),
    (dict(num_kv_heads=None), "shape_unknown", "heads"),
    (dict(head_dim=None), "shape_unknown", "head size"),
    (dict(backend=None), "backend_unknown", "backend"),
    (dict(cpu_attn_isa="amx"), "unsupported_layout", "amx"),
    (dict(cpu_attn_isa="vec16"), "unsupported_layout", "vec16"),
    (dict(cpu_attn_isa=None), "unsupported_layout", "isa"),
    (dict(backend="FLEX_ATTENTION"), "unsupported_layout", "FLEX_ATTENTION"),
    (dict(backend="FLASH_ATTN", kv_cache_layout=None), "unsupported_layout", "did not report"),
    # heads and head size from the model config that do not add up to vLLM's bytes per block
    (dict(num_kv_heads=8), "size_mismatch", "vLLM reports"),
    (dict(head_dim=128), "size_mismatch", "vLLM reports"),
])
def test_facts_that_do_not_describe_the_chunk_keep_the_flat_codec_and_say_why(change, reason, words):
    d = chunk_layout(dataclasses.replace(CPU, **change))
    assert d.flat and d.reason == reason and reason in FLAT_REASONS
    assert words.lower() in d.detail.lower(), d.detail


def test_size_check_cannot_catch_a_swapped_head_split_so_the_worker_checks_its_pages():
    """8 heads of 32 has the bytes of 4 heads of 64: the scheduler cannot tell; the worker's tensors can."""
    lay = chunk_layout(CPU).layout
    assert check_worker_pages(lay, (lay.page_nbytes,) * 4) is None
    assert "3 tensors" in check_worker_pages(lay, (lay.page_nbytes,) * 3)
    # one cross-layer tensor (vLLM's BLHNC): one page per block holding every layer -> would be read layer-major
    assert "expects 4 of" in check_worker_pages(lay, (lay.page_nbytes * 4,))


def _tier_cfg(tmp_path, codec: str, **kw) -> FilesystemTierConfig:
    return FilesystemTierConfig(root_dir=str(tmp_path / f"fs-{codec}-{time.monotonic_ns()}"), capacity_bytes=64 << 20,
                                codec=codec, n_read_threads=2, n_write_threads=2, **kw)


def test_tier_codec_is_layout_aware_only_for_a_lossy_tier_with_a_layout(tmp_path):
    ok, flat = chunk_layout(CPU), chunk_layout(dataclasses.replace(CPU, backend=None))
    codec = tier_codec(_tier_cfg(tmp_path, "int4"), ok)
    assert isinstance(codec, KVChunkCodec) and codec.declared == ok.layout and codec.verify
    assert codec.chain[0] == "int4" and codec.chain[-1] == "none"
    assert tier_codec(_tier_cfg(tmp_path, "int8", codec_fallback=False), ok).verify is False
    assert tier_codec(_tier_cfg(tmp_path, "none"), ok) is None
    assert tier_codec(_tier_cfg(tmp_path, "fp8"), flat) is None


def _books(tmp_path, lay: KVLayout, codec_name: str, layout_aware: bool, n_rows: int = 4):
    """OffloadBooks over a host region of ``lay``-sized rows and one filesystem tier, built as the spec's manager
    builds them (``tier_codec`` with the layout, or the flat codec)."""
    cfg = _tier_cfg(tmp_path, codec_name)
    decision = chunk_layout(CPU) if layout_aware else chunk_layout(dataclasses.replace(CPU, backend=None))
    assert decision.layout in (None, lay)
    books, region = engine_books(tmp_path, n_rows, lay.nbytes, [(cfg, {"codec": tier_codec(cfg, decision)})],
                                 view_dtype=getattr(torch, lay.dtype))
    return books, region, books.tiers[0]


def _reload(books: OffloadBooks, region: HostRegion, key: bytes, chunk: torch.Tensor) -> torch.Tensor:
    """Store ``chunk`` as vLLM's worker would, drop the host copy, read it back from disk into a host row."""
    to_store, slots, _ = books.prepare_store([key])
    region.rows[slots[0]].view(chunk.dtype).copy_(chunk)
    books.complete_store(to_store)
    books.drain()
    assert books.reset_host() == 1
    assert books.lookup(key) == RETRY
    books.drain()
    assert books.lookup(key) == HIT
    return region.rows[books.prepare_load([key])[0]].view(chunk.dtype).clone()


@pytest.mark.parametrize("codec_name", ["fp8", "int8", "int4"])
def test_compressed_tier_reloads_outlier_keys_within_attention_budget(tmp_path, codec_name):
    """The issue's failure case (K channels 20x the rest) through the books: with the layout the reload keeps
    attention cosine >= 0.99 for every codec; the stored block is a KV block (layout-aware header)."""
    lay = chunk_layout(CPU).layout
    chunk = make_chunk(lay, seed=3, outlier=20.0)
    books, region, tier = _books(tmp_path, lay, codec_name, layout_aware=True)
    try:
        back = _reload(books, region, b"k" * 36, chunk)
        assert attention_cosine(lay, chunk, back) >= 0.99
        files = [p for p in (tmp_path).rglob("*") if p.is_file() and "fs-" in str(p) and ".tmp." not in p.name]
        assert len(files) == 1
        blob = torch.frombuffer(bytearray(files[0].read_bytes()), dtype=torch.uint8)
        header = peek_header(blob[_blob_offset(files[0]):])
        assert header.kv_layout and header.layout_code == lay.code  # a layout-aware block, in the row's order
        assert files[0].stat().st_size < lay.nbytes  # and compressed
    finally:
        books.close()
        region.close(unlink=True)


@pytest.mark.parametrize("codec_name", ["fp8", "int8", "int4"])
def test_a_tier_without_a_layout_never_stores_unchecked_int4(tmp_path, codec_name):
    """The path a GPU engine's tier takes (the scheduler does not know the attention backend, so no layout): every
    codec a policy can choose reloads held-out outlier-K data at attention cosine >= 0.99. Flat int4 could not
    (0.898, its relative-L2 fallback silent), so it is refused: the tier stores int8, counted by reason."""
    lay = chunk_layout(CPU).layout
    chunk = make_chunk(lay, seed=5, outlier=20.0)

    def refusals() -> int:
        counts = STATS.snapshot()["kvtier_runtime_codec_refusals_total"]
        return counts.get(("int4", "int8", "backend_unknown"), 0)

    before = refusals()
    books, region, _ = _books(tmp_path, lay, codec_name, layout_aware=False)
    try:
        back = _reload(books, region, b"q" * 36, chunk)
        files = [p for p in tmp_path.rglob("*") if p.is_file() and "fs-" in str(p) and ".tmp." not in p.name]
        assert len(files) == 1
        header = peek_header(torch.frombuffer(bytearray(files[0].read_bytes()), dtype=torch.uint8)[_blob_offset(files[0]):])
        assert not header.kv_layout and header.codec == ("int8" if codec_name == "int4" else codec_name)
        assert attention_cosine(lay, chunk, back) >= 0.99
    finally:
        books.close()
        region.close(unlink=True)
    assert refusals() - before == (1 if codec_name == "int4" else 0)


def test_tensor_parallel_row_is_every_workers_heads_as_layers_of_its_own():
    """Under TP each worker's share of a host row is its own KV heads of every layer, at rank x its chunk bytes
    (the worker's rank_offset): the row's layout is W x L layers of the per-worker page, so no scale spans two
    workers' heads, and a layout-aware int4 tier keeps attention on outlier-K data."""
    world, lay1 = 2, chunk_layout(CPU).layout
    tp = dataclasses.replace(CPU, world_size=world)
    lay = chunk_layout(tp).layout
    assert lay.num_layers == world * CPU.num_layers and lay.num_kv_heads == CPU.num_kv_heads
    assert lay.nbytes == world * CPU.worker_kv_bytes_per_block * CPU.blocks_per_chunk
    # the whole model: L layers of W * H heads, K with outlier channels; worker r holds heads r*H..(r+1)*H
    gen = torch.Generator().manual_seed(11)
    h = CPU.num_kv_heads
    shape = (CPU.num_layers, world * h, lay.tokens, lay.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k[..., :3] *= 20.0
    row = torch.cat([make_chunk(lay1, k=k[:, r * h:(r + 1) * h], v=v[:, r * h:(r + 1) * h]) for r in range(world)])
    from kvtier_runtime.codecs.kv import canonical, to_stage
    c = canonical(lay.stage_layout, to_stage(lay, row), lay.num_layers)  # [W*L, 2, H, P, T, D]
    for r in range(world):
        for layer in range(CPU.num_layers):
            got = c[r * CPU.num_layers + layer].flatten(2, 3)   # [2, H, tokens, D]
            assert torch.equal(got[0], k[layer, r * h:(r + 1) * h]) and torch.equal(got[1], v[layer, r * h:(r + 1) * h])
    # the worker checks its own tensors: L pages per worker, not W * L
    assert check_worker_pages(lay, (lay.page_nbytes,) * CPU.num_layers, world) is None
    assert check_worker_pages(lay, (lay.page_nbytes,) * CPU.num_layers) is not None
    codec = KVChunkCodec("int4", lay)
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
    n = codec.encode(row, out)
    back = torch.empty_like(row)
    codec.decode(out[:n], back)
    assert attention_cosine(lay, row, back) >= 0.99


def test_a_chunk_over_budget_is_stored_wider_and_counted(tmp_path):
    """Keys the int4 budget cannot meet (a few huge tokens per channel group) fall back along the chain; the
    reload is still within budget and the fallback is counted in the codec metric."""
    lay = chunk_layout(CPU).layout
    gen = torch.Generator().manual_seed(9)
    shape = (lay.num_layers, lay.num_kv_heads, lay.tokens, lay.head_dim)
    k = torch.randn(shape, generator=gen)
    k[:, :, ::7] *= 300.0  # token outliers inside every K group: per-channel scales cannot serve the rest
    chunk = make_chunk(lay, k=k, v=torch.randn(shape, generator=gen))

    def fallbacks() -> int:
        counts = STATS.snapshot()["kvtier_runtime_codec_fallbacks_total"]
        return sum(n for (requested, _), n in counts.items() if requested == "int4")

    before = fallbacks()
    books, region, _ = _books(tmp_path, lay, "int4", layout_aware=True)
    try:
        back = _reload(books, region, b"f" * 36, chunk)
    finally:
        books.close()
        region.close(unlink=True)
    assert attention_cosine(lay, chunk, back) >= 0.99
    assert fallbacks() > before
