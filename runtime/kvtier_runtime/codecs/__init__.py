"""KV block codecs: ``none``, ``fp8`` (e4m3), ``fp8_e5m2``, ``int8``, ``int4``.

Two APIs share one self-describing block format (see ``header``), so a block written before a policy switched
codec still decodes, and ``decode`` reads any block:

**The engine path: layout-aware chunks** (``kv.py``, ``layout.py``). The worker that moves a KV chunk (every
layer's K and V pages for some tokens) to a tier describes the chunk once and encodes through it::

    layout = KVLayout(num_layers=32, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      page_order="HKTD", pages=1, outer="LP")
    # or KVLayout.from_vllm(kv_cache_spec, num_layers=..., backend="CPU_ATTN", kv_cache_layout="LBHNC",
    #                       cpu_attn_isa=layer.isa)      # -> page_order "CPU_VEC" for the "vec" ISA
    codec = get_kv_codec("int4", layout)            # verify=True (default): fails safe, see below
    out = torch.empty(codec.max_encoded_nbytes, dtype=torch.uint8)
    n = codec.encode(chunk, out)                    # chunk: layout.nbytes uint8/int8, or layout.numel of dtype
    codec.decode(out[:n], chunk_out)                # page order restored; another layout's block is refused

- ``KVLayout`` (frozen, torch-free to construct): ``num_layers``, ``block_tokens`` (tokens per page),
  ``num_kv_heads``, ``head_dim``, ``dtype`` ("float16" | "bfloat16" | "float32"), ``page_order`` (outermost
  first over K = the K/V axis with K first, H = heads, T = tokens, D = head dim; FlashAttention/Triton "THKD"
  with layout LBNHC and "HTKD" with LBHNC; vLLM 0.32's CPU backend with its "vec" ISA "CPU_VEC": per head K as
  [D][T], then V as [T][D]; its "amx" ISA is refused), ``pages`` (pages per layer in a
  chunk) and ``outer`` ("LP": layer-major, "PL": page-major).
- Scales follow the layout: K per (layer, head, channel) over groups of tokens, V per (layer, head, token) over
  groups of channels (KIVI); never across K/V, layers or heads.
- int4 is scheme 3 (``kv_int4.py``): K's ranges per channel at 5 or 6 bits, V rotated by Hadamard blocks at 4 bits,
  attention-sink tokens kept exact; about 0.34 of raw bytes. Judged on a trained model's KV with ``kvtier accuracy``
  (``kvtier_runtime.accuracy``; docs/compression.md). ``int4_scheme=1`` asks for the previous int4.
- ``verify=True`` decodes every chunk again and measures the attention output of probe queries; a chunk over its
  codec's budget (``ATTENTION_BUDGETS``) is stored with the next codec of ``FALLBACK_CHAINS`` (ending in
  ``none``) and counted in ``kvtier_runtime_codec_fallbacks_total{requested_codec, codec}``.

**The flat API** (``get_codec``): any tensor, scales per group of consecutive elements or per last-dim channel,
an error budget on the block's relative L2 error. Kept for callers without a layout (tests, the fs tier's
generic rows); it does not see K, V or heads, so it is not safe on K with outlier channels::

    codec = get_codec("int4", group_size=32)
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    n = codec.encode(x, out)                 # header + payload, returns bytes written
    y = decode(out[:n])                      # any codec's block: the header says which

The accuracy measures (attention cosine, next-token logits of two engine runs) are test code, in
tests/plugins/kv_accuracy.py.
This package imports torch; ``kvtier_runtime`` itself does not import it.
"""
from .base import Codec
from .errors import CodecError
from .header import HEADER_NBYTES, CodecHeader
from .kv import ATTENTION_BUDGETS, FALLBACK_CHAINS, KVChunkCodec, get_kv_codec
from .layout import KVLayout
from .metrics import STATS, CodecMetricsCollector, add_fallback_listener, remove_fallback_listener
from .registry import CODEC_CLASSES, ERROR_BUDGETS, FALLBACK_TO, decode, get_codec, peek_header

__all__ = [
    "ATTENTION_BUDGETS", "CODEC_CLASSES", "Codec", "CodecError", "CodecHeader", "CodecMetricsCollector",
    "ERROR_BUDGETS", "FALLBACK_CHAINS", "FALLBACK_TO", "HEADER_NBYTES", "KVChunkCodec", "KVLayout", "STATS",
    "add_fallback_listener", "decode", "get_codec", "get_kv_codec", "peek_header", "remove_fallback_listener",
]
