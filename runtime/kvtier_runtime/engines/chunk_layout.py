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

from dataclasses import dataclass
from types import SimpleNamespace

from ..codecs import CodecError, KVChunkCodec, KVLayout, get_kv_codec
from ..codecs.layout import DTYPE_NAMES
from ..config import FilesystemTierConfig

# Reason codes (a metric label): why a lossy tier encodes with the flat codec.
FLAT_REASONS = (
    "kv_groups",           # more than one KV cache group
    "tensor_parallel",     # a host row holds every rank's shard: no single layout describes it
    "kv_dtype",            # KV dtype the layout codecs do not quantise
    "shape_unknown",       # heads or head size not available in the scheduler process
    "backend_unknown",     # attention backend not known in the scheduler process
    "unsupported_layout",  # a backend/layout/ISA the layout codecs have no checked page order for
    "size_mismatch",       # the described chunk does not add up to the bytes vLLM reports per block
)


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
    if f.world_size != 1:
        return _flat("tensor_parallel", f"a host row holds the shards of {f.world_size} workers")
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
    block_bytes = layout.page_nbytes * layout.num_layers
    if block_bytes != f.worker_kv_bytes_per_block:
        return _flat("size_mismatch",
                     f"{f.num_layers} layers x 2 x {f.num_kv_heads} heads x {f.block_tokens} tokens x {f.head_dim} "
                     f"x {layout.itemsize} bytes = {block_bytes} bytes per block, vLLM reports "
                     f"{f.worker_kv_bytes_per_block}")
    return LayoutDecision(layout)


def check_worker_pages(layout: KVLayout, page_bytes: tuple[int, ...]) -> str | None:
    """Why the worker's real cache tensors contradict ``layout`` (one tensor per layer, each page one layer's K and
    V of one block), or ``None``. A contradiction means the scheduler would encode chunks in the wrong order."""
    if len(page_bytes) != layout.num_layers or any(p != layout.page_nbytes for p in page_bytes):
        return (f"the engine's KV cache has {len(page_bytes)} tensors with pages of {sorted(set(page_bytes))} bytes; "
                f"the chunk layout expects {layout.num_layers} of {layout.page_nbytes} bytes")
    return None


def tier_codec(tier: FilesystemTierConfig, decision: LayoutDecision) -> KVChunkCodec | None:
    """The layout-aware codec of a filesystem tier, or ``None`` for the tier's flat codec (``none`` needs no
    layout; a lossy tier without a layout keeps the flat codec). ``codec_fallback`` turns the per-chunk
    attention check (and the wider fallback it triggers) on or off, as it does for the flat codec."""
    if tier.codec == "none" or decision.layout is None:
        return None
    return get_kv_codec(tier.codec, decision.layout, verify=tier.codec_fallback)
