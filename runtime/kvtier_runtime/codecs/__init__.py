"""KV block codecs: ``none``, ``fp8`` (e4m3), ``fp8_e5m2``, ``int8``, ``int4``.

    codec = get_codec("int4", group_size=32)
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    n = codec.encode(x, out)                 # header + payload, returns bytes written
    y = decode(out[:n])                      # any codec's block: the header says which

Every block carries a self-describing header (see ``header``), so blocks written before a policy switched codec
still decode. This package imports torch; ``kvtier_runtime`` itself does not import it.
"""
from .base import Codec
from .header import HEADER_NBYTES, CodecError, CodecHeader
from .metrics import STATS, CodecMetricsCollector, add_fallback_listener, remove_fallback_listener
from .registry import CODEC_CLASSES, ERROR_BUDGETS, FALLBACK_TO, decode, get_codec, peek_header

__all__ = [
    "CODEC_CLASSES", "Codec", "CodecError", "CodecHeader", "CodecMetricsCollector", "ERROR_BUDGETS",
    "FALLBACK_TO", "HEADER_NBYTES", "STATS", "add_fallback_listener", "decode", "get_codec", "peek_header",
    "remove_fallback_listener",
]
