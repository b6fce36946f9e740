"""Where K and V sit in a KV chunk's bytes: the descriptor the layout-aware codecs (``kv.py``) quantise by.

A *chunk* is what the engine hands a tier for some tokens: every layer's KV page(s) for those tokens, laid end to
end. Each page holds ``block_tokens`` tokens of one layer, K and V, every KV head, in the byte order of the
engine's attention backend. This module imports no torch: the scheduler side and config code can build and
compare descriptors; only encoding needs torch.

Page orders are strings over ``K`` (the K/V axis, size 2, K first), ``H`` (KV heads), ``T`` (tokens of the page)
and ``D`` (head dim, always innermost), outermost first. vLLM 0.32 (checked in its source):

- CPU backend (``CPU_ATTN``, layout ``LBHNC`` only): a page ``[num_kv_heads, block_size, 2 * head_size]`` that
  the backend re-views as ``[H, 2 * T, D]`` and chunks on dim 1, so each head holds its K block, then its V
  block. What is *inside* those blocks depends on the ISA its kernels were picked for (``layer.isa``, from
  ``cpu_attn._get_attn_isa``), checked by writing known keys with ``cpu_attn_reshape_and_cache``
  (``bench/vllm_cpu_layout_check.py``): with ``"vec"`` (fp32, fp16, bf16 without AMX) K is channel-major
  ``[D][T]`` and V token-major ``[T][D]``: ``"CPU_VEC"``. With ``"amx"`` (bf16 on AMX machines) both are
  tiled further and no order here describes them: such caches are refused.
- FlashAttention / Triton / FlashInfer with layout ``LBNHC`` (``[B, N, H, C]``, FlashInfer's NHD; C = K then V of
  one head and token, split with ``split(head_size, -1)``): ``"THKD"``; with ``LBHNC`` (FlashInfer's HND):
  ``"HTKD"``. Unchanged in vLLM 0.33, and checked there against the indexing of ``reshape_and_cache_flash``
  (``tests/runtime/codecs/test_codecs_vllm_layouts.py``, which cites the lines). Other ``KVCacheLayout`` members (cross-layer
  ``BL..``, ``LHBNC``) are not described: refused.
- MLA caches one latent vector per token (no K/V heads): no page order here describes it; refused.
- Tensor parallelism: each worker's pages hold its own KV heads only, so a host row of W workers' chunks end to
  end is W x ``num_layers`` layers of the worker's layout (``engines.chunk_layout``).
- vLLM before the RFC #42082 layouts (``(2, num_blocks, block_size, num_kv_heads, head_size)`` per layer, K and V
  in separate pages): an engine that copies the K page then the V page of each layer gives ``"KTHD"``.

``pages`` > 1 means a chunk holds several engine blocks per layer; ``outer`` says whether the chunk is layer-major
(``"LP"``: layer 0's pages, then layer 1's...) or page-major (``"PL"``, e.g. vLLM's cross-layer ``BLHNC``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

from .errors import CodecError

PAGE_ORDERS: tuple[str, ...] = ("HKTD", "THKD", "HTKD", "KTHD", "KHTD", "TKHD", "CPU_VEC")
# Orders whose K or V is not [T][D] inside the page: the codec gathers them into "HKTD" first.
STAGED_ORDERS: dict[str, str] = {"CPU_VEC": "HKTD"}
_CODE_SLOTS = 16   # page orders per outer order in a layout code: room to append without renumbering
OUTER_ORDERS: tuple[str, ...] = ("LP", "PL")
DTYPE_NAMES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}

# vLLM 0.32: (attention backend name, KVCacheLayout name) -> page order. Backends that split the content dim C
# into K then V per (head, token) share one row; the CPU backend re-views its page (see the module docstring).
VLLM_PAGE_ORDERS: dict[tuple[str, str], str] = {
    ("FLASH_ATTN", "LBNHC"): "THKD",
    ("FLASH_ATTN", "LBHNC"): "HTKD",
    ("TRITON_ATTN", "LBNHC"): "THKD",
    ("TRITON_ATTN", "LBHNC"): "HTKD",
    ("FLASHINFER", "LBNHC"): "THKD",
    ("FLASHINFER", "LBHNC"): "HTKD",
}


def _positive_int(name: str, value: object, limit: int = 1 << 20) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        raise CodecError(f"layout.{name}: {value!r} must be an integer in 1..{limit}")


@dataclass(frozen=True)
class KVLayout:
    """One chunk's shape and byte order. Construct with plain values (no torch); every field is validated."""

    num_layers: int
    block_tokens: int          # tokens per page (vLLM: the KV cache spec's block_size)
    num_kv_heads: int
    head_dim: int
    dtype: str                 # "float16" | "bfloat16" | "float32"
    page_order: str = "HKTD"   # see PAGE_ORDERS and the module docstring
    pages: int = 1             # pages per layer in one chunk
    outer: str = "LP"          # "LP" layer-major, "PL" page-major

    def __post_init__(self) -> None:
        _positive_int("num_layers", self.num_layers, 4096)
        # groups of tokens and channels travel in 16 bits of the header
        _positive_int("block_tokens", self.block_tokens, 65535)
        _positive_int("num_kv_heads", self.num_kv_heads, 4096)
        _positive_int("head_dim", self.head_dim, 65534)
        _positive_int("pages", self.pages, 65536)
        if self.dtype not in DTYPE_NAMES:
            raise CodecError(f"layout.dtype: {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if self.page_order not in PAGE_ORDERS:
            raise CodecError(f"layout.page_order: {self.page_order!r} is not one of {', '.join(PAGE_ORDERS)}")
        if self.outer not in OUTER_ORDERS:
            raise CodecError(f"layout.outer: {self.outer!r} is not one of {', '.join(OUTER_ORDERS)}")
        if self.head_dim % 2:
            raise CodecError(f"layout.head_dim: {self.head_dim} must be even (int4 packs two codes per byte)")

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens per layer in one chunk."""
        return self.pages * self.block_tokens

    @property
    def page_shape(self) -> tuple[int, ...]:
        sizes = {"K": 2, "H": self.num_kv_heads, "T": self.block_tokens, "D": self.head_dim}
        return tuple(sizes[c] for c in STAGED_ORDERS.get(self.page_order, self.page_order))

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The chunk as a tensor shape: the outer dims (layers and pages, in ``outer`` order), then the page."""
        outer = (self.num_layers, self.pages) if self.outer == "LP" else (self.pages, self.num_layers)
        return outer + self.page_shape

    @property
    def dim_names(self) -> str:
        return self.outer + STAGED_ORDERS.get(self.page_order, self.page_order)

    @property
    def staged(self) -> bool:
        """True when K or V is not [T][D] inside a page: the codec works on a copy gathered into ``stage_layout``."""
        return self.page_order in STAGED_ORDERS

    @property
    def stage_layout(self) -> KVLayout:
        return replace(self, page_order=STAGED_ORDERS.get(self.page_order, self.page_order))

    @property
    def page_numel(self) -> int:
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim

    @property
    def numel(self) -> int:
        return self.num_layers * self.pages * self.page_numel

    @property
    def itemsize(self) -> int:
        return DTYPE_NAMES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        return self.page_numel * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def canonical_permutation(self) -> tuple[int, ...]:
        """Permutes ``chunk_shape`` into the canonical ``[L, K, H, P, T, D]`` (K/V axis: K first)."""
        names = self.dim_names
        return tuple(names.index(c) for c in "LKHPTD")

    # ---- wire form (the block header) ------------------------------------------------------------------------
    @property
    def code(self) -> int:
        """One byte naming page order and outer order in a block header (never renumbered: append only)."""
        return 1 + PAGE_ORDERS.index(self.page_order) + _CODE_SLOTS * OUTER_ORDERS.index(self.outer)

    @classmethod
    def from_code(cls, code: int, chunk_shape: tuple[int, ...], dtype: str) -> KVLayout:
        """The layout a header describes (``code`` and the chunk shape it records)."""
        outer_i, order_i = divmod(code - 1, _CODE_SLOTS)
        if code < 1 or outer_i >= len(OUTER_ORDERS) or order_i >= len(PAGE_ORDERS):
            raise CodecError(f"header.layout: code {code} is unknown")
        outer, order = OUTER_ORDERS[outer_i], PAGE_ORDERS[order_i]
        if len(chunk_shape) != 6:
            raise CodecError(f"header.shape: {chunk_shape} is not a 6-dim chunk shape")
        size = dict(zip(outer + STAGED_ORDERS.get(order, order), chunk_shape))
        if size["K"] != 2:
            raise CodecError(f"header.shape: {chunk_shape}: the K/V axis of order {order!r} must be 2")
        return cls(num_layers=size["L"], block_tokens=size["T"], num_kv_heads=size["H"], head_dim=size["D"],
                   dtype=dtype, page_order=order, pages=size["P"], outer=outer)

    # ---- construction from vLLM ------------------------------------------------------------------------------
    @classmethod
    def from_vllm(cls, kv_cache_spec: object, *, num_layers: int, backend: str, kv_cache_layout: str = "LBHNC",
                  cpu_attn_isa: str | None = None, pages: int = 1, outer: str = "LP") -> KVLayout:
        """From a vLLM ``AttentionSpec`` (duck-typed: ``block_size``, ``num_kv_heads``, ``head_size``,
        ``head_size_v``, ``dtype``), the attention backend's name (``AttentionBackend.get_name()``, e.g.
        ``"CPU_ATTN"``), the resolved ``KVCacheLayout`` name and, for the CPU backend, the ISA its attention
        kernels use (``layer.isa``; only ``"vec"`` is supported). Refuses what it cannot describe (MLA, K and V
        of different head sizes, quantised KV caches) with a ``CodecError`` naming the field."""
        head_size = getattr(kv_cache_spec, "head_size", None)
        head_size_v = getattr(kv_cache_spec, "head_size_v", None) or head_size
        if head_size_v != head_size:
            raise CodecError(f"kv_cache_spec.head_size_v: {head_size_v} differs from head_size {head_size}; "
                             "only K and V of one head size are supported")
        key = (str(backend).upper(), str(kv_cache_layout).rsplit(".", 1)[-1].upper())
        if key[0] == "CPU_ATTN":
            if cpu_attn_isa != "vec":
                raise CodecError(f"cpu_attn_isa: {cpu_attn_isa!r}; only 'vec' has a checked page order (pass the "
                                 "attention layer's isa; 'amx' tiles K and V in an order not described here)")
            if key[1] != "LBHNC":
                raise CodecError(f"kv_cache_layout: {key[1]!r}; the CPU backend uses LBHNC")
            page_order = "CPU_VEC"
        elif key not in VLLM_PAGE_ORDERS:
            raise CodecError(f"backend/kv_cache_layout: {key} has no known page order "
                             f"(known: {', '.join('/'.join(k) for k in VLLM_PAGE_ORDERS)})")
        else:
            page_order = VLLM_PAGE_ORDERS[key]
        dtype = str(getattr(kv_cache_spec, "dtype", "")).removeprefix("torch.")
        # Duck-typed values: __post_init__ refuses a missing or non-integer one, naming the field.
        return cls(num_layers=num_layers, block_tokens=cast(int, getattr(kv_cache_spec, "block_size", None)),
                   num_kv_heads=cast(int, getattr(kv_cache_spec, "num_kv_heads", None)),
                   head_dim=cast(int, head_size),
                   dtype=dtype, page_order=page_order, pages=pages, outer=outer)


def describe(layout: KVLayout) -> str:
    return (f"{layout.num_layers} layers x {layout.pages} page(s) x {layout.page_order} "
            f"(H={layout.num_kv_heads}, T={layout.block_tokens}, D={layout.head_dim}) {layout.dtype}, "
            f"{layout.nbytes} bytes ({math.prod(layout.chunk_shape)} elements)")
