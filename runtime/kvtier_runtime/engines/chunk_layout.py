"""Which codec a filesystem tier of kvtier's offloading spec encodes chunks with (no vllm import).

A host row is one offload chunk: for each layer (one engine cache tensor per layer), ``blocks_per_chunk`` pages
laid end to end, each page in the attention backend's own byte order (see :mod:`.page_copy`). When the facts
vLLM gives about that chunk -- layers, tokens per block, KV heads, head size, KV dtype, attention backend, KV cache
layout and, for the CPU backend, the ISA of its kernels -- describe it completely, a lossy tier encodes each chunk
with the layout-aware codec (:func:`kvtier_runtime.codecs.get_kv_codec`: K scaled per channel, V per token, never
across K/V, layers or heads, every chunk verified on attention output). When they do not, the tier keeps the flat
codec and says why: once in the log and as a reason code in the spec's metrics.

The facts are gathered in the scheduler process (where the tiers encode); :func:`chunk_layout` is pure so the
decision is testable without vLLM.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from ..codecs import Codec, CodecError, KVChunkCodec, KVLayout, get_codec, get_kv_codec
from ..codecs.layout import DTYPE_NAMES
from ..codecs.metrics import STATS
from ..config import TierConfig

# Why a lossy tier encodes with the flat codec: the reason label of its metric, defined with it.
from .metric_defs import FLAT_REASONS


@dataclass(frozen=True)
class ChunkFacts:
    """What vLLM says about one offload chunk, as gathered by the adapter (``None``: not known here)."""

    num_layers: int
    block_tokens: int
    blocks_per_chunk: int
    kv_dtype: str                      # vLLM's KV cache dtype name ("float32", "bfloat16", "fp8_e4m3"...)
    worker_kv_bytes_per_block: int     # one worker's bytes of one block, every layer
    world_size: int = 1
    num_groups: int = 1
    num_kv_heads: int | None = None    # per worker
    head_dim: int | None = None
    backend: str | None = None         # AttentionBackend.get_name(), e.g. "CPU_ATTN"
    kv_cache_layout: str | None = None  # resolved KVCacheLayout name, e.g. "LBHNC"
    cpu_attn_isa: str | None = None    # CPU backend only: the ISA its kernels use ("vec", "vec16", "amx")
    use_mla: bool = False              # ModelConfig.use_mla: the cache holds a latent per token, not K and V


@dataclass(frozen=True)
class LayoutDecision:
    layout: KVLayout | None
    reason: str = ""    # one of FLAT_REASONS when layout is None
    detail: str = ""    # the human-readable why, for the log

    @property
    def flat(self) -> bool:
        return self.layout is None


def _flat(reason: str, detail: str) -> LayoutDecision:
    assert reason in FLAT_REASONS, reason
    return LayoutDecision(None, reason, detail)


def chunk_layout(f: ChunkFacts) -> LayoutDecision:
    """The :class:`KVLayout` of one host row, or why there is none."""
    if f.num_groups != 1:
        return _flat("kv_groups", f"the model has {f.num_groups} KV cache groups; one is supported")
    if f.use_mla:
        return _flat("mla", "the model caches a latent per token (MLA): there are no K and V heads to scale by")
    dtype = str(f.kv_dtype).removeprefix("torch.")
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    if dtype not in DTYPE_NAMES:
        return _flat("kv_dtype", f"KV dtype {f.kv_dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    if not f.num_kv_heads or not f.head_dim:
        return _flat("shape_unknown", "the KV heads or head size of the model are not known in the scheduler process")
    if not f.backend:
        return _flat("backend_unknown", "the attention backend is not known in the scheduler process")
    backend = f.backend.upper()
    kv_cache_layout = f.kv_cache_layout
    if kv_cache_layout is None and backend == "CPU_ATTN":
        kv_cache_layout = "LBHNC"  # vLLM 0.32's CPU backend supports no other (and reports none)
    if kv_cache_layout is None:
        return _flat("unsupported_layout", f"backend {backend} did not report its KV cache layout")
    spec = SimpleNamespace(block_size=f.block_tokens, num_kv_heads=f.num_kv_heads, head_size=f.head_dim,
                           head_size_v=f.head_dim, dtype=dtype)
    try:
        layout = KVLayout.from_vllm(spec, num_layers=f.num_layers, backend=backend, kv_cache_layout=kv_cache_layout,
                                    cpu_attn_isa=f.cpu_attn_isa, pages=f.blocks_per_chunk, outer="LP")
    except CodecError as exc:
        return _flat("unsupported_layout", str(exc))
    # The engine's own byte count is the cross-check: heads or head size derived wrongly cannot add up to it
    # (unless their product is right; the worker checks its real page sizes against the layout as well).
    # Per worker: under pipeline parallelism a worker holds fewer layers and this does not add up either.
    block_bytes = layout.page_nbytes * layout.num_layers
    if block_bytes != f.worker_kv_bytes_per_block:
        if f.world_size != 1:
            return _flat("tensor_parallel",
                         f"{f.world_size} workers, each with {f.worker_kv_bytes_per_block} bytes per block, not "
                         f"{block_bytes} ({f.num_layers} layers of {layout.page_nbytes}-byte pages): not one "
                         "tensor-parallel group of whole-layer shares (pipeline parallelism?)")
        return _flat("size_mismatch",
                     f"{f.num_layers} layers x 2 x {f.num_kv_heads} heads x {f.block_tokens} tokens x {f.head_dim} "
                     f"x {layout.itemsize} bytes = {block_bytes} bytes per block, vLLM reports "
                     f"{f.worker_kv_bytes_per_block}")
    if f.world_size != 1:
        # Tensor parallelism: the host row is the workers' chunks end to end (worker r at r * its chunk bytes),
        # each its own ``num_kv_heads`` heads of every layer, in the same page order. Scales never span layers or
        # heads, so W workers of L layers are exactly W * L layers of this layout.
        layout = KVLayout(num_layers=f.world_size * f.num_layers, block_tokens=layout.block_tokens,
                          num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
                          page_order=layout.page_order, pages=layout.pages, outer=layout.outer)
    return LayoutDecision(layout)


def check_worker_pages(layout: KVLayout, page_bytes: tuple[int, ...], workers: int = 1) -> str | None:
    """Why one worker's real cache tensors contradict ``layout`` (one tensor per layer, each page one layer's K and
    V of one block; under tensor parallelism ``layout`` spans the ``workers`` shares of a row, one worker holds
    ``layout.num_layers / workers`` of its layers), or ``None``. A contradiction means the scheduler would encode
    chunks in the wrong order."""
    if len(page_bytes) * workers != layout.num_layers or any(p != layout.page_nbytes for p in page_bytes):
        return (f"the engine's KV cache has {len(page_bytes)} tensors with pages of {sorted(set(page_bytes))} bytes; "
                f"the chunk layout expects {layout.num_layers // max(1, workers)} of {layout.page_nbytes} bytes")
    return None


# Codecs the flat codec may not store without a layout: its per-block relative-L2 fallback does not see what they
# do to attention (flat int4 on outlier-K data: worst held-out attention cosine 0.898, fallback silent), so a
# tier asking for one stores this instead. fp8 and int8 keep >= 0.99 there (docs/compression.md).
FLAT_REFUSED: dict[str, str] = {"int4": "int8"}
_refusals_logged: set[tuple[str, str]] = set()
_refusals_lock = threading.Lock()
_log = logging.getLogger(__name__)


def tier_codec(tier: TierConfig, decision: LayoutDecision) -> KVChunkCodec | Codec | None:
    """The codec of a tier behind the host tier (filesystem or remote): the layout-aware one when the chunk's layout is known; ``None`` for the
    tier's own flat codec (``none`` needs no layout; a lossy tier without a layout keeps the flat codec), except
    that a codec in ``FLAT_REFUSED`` is refused there and the tier gets the flat codec it names (counted in
    ``kvtier_runtime_codec_refusals_total{requested_codec, codec, reason}``, the reason logged once).
    ``codec_fallback`` turns the per-chunk attention check (and the wider fallback it triggers) on or off, as it
    does for the flat codec."""
    if tier.codec == "none":
        return None
    if decision.layout is None:
        instead = FLAT_REFUSED.get(tier.codec)
        if instead is None:
            return None
        STATS.record_refusal(tier.codec, instead, decision.reason)
        with _refusals_lock:
            first = (tier.codec, decision.reason) not in _refusals_logged
            _refusals_logged.add((tier.codec, decision.reason))
        if first:
            _log.warning("kvtier: tier codec %s refused, storing %s: the KV layout is not described "
                         "(%s: %s), and without it nothing checks %s on attention", tier.codec, instead,
                         decision.reason, decision.detail, tier.codec)
        return get_codec(instead, fallback=tier.codec_fallback)
    return get_kv_codec(tier.codec, decision.layout, verify=tier.codec_fallback)
