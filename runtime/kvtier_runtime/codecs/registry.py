"""Codec construction with validated options, and decoding that trusts only the block's own header."""
from __future__ import annotations

import torch

from ..config import CODECS
from .base import Codec, PassthroughCodec, as_byte_buffer, read_header
from .header import HEADER_NBYTES, CodecError, CodecHeader
from .kv import check_kv_header, decode_kv_block
from .metrics import STATS
from .quant import Fp8Codec, Fp8E5M2Codec, Int4Codec, Int8Codec, ScaledCodec

CODEC_CLASSES: dict[str, type[Codec]] = {
    "none": PassthroughCodec,
    "fp8": Fp8Codec,
    "fp8_e5m2": Fp8E5M2Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}
assert tuple(CODEC_CLASSES) == CODECS, "codec names must match kvtier_runtime.config.CODECS"

# A block over its codec's error budget is stored with the next wider codec; int8 keeps int4's group size.
FALLBACK_TO: dict[str, str] = {"int4": "int8", "int8": "none", "fp8": "none", "fp8_e5m2": "none"}

ERROR_BUDGETS: dict[str, float] = {name: cls.error_budget for name, cls in CODEC_CLASSES.items()}


def get_codec(name: str, *, group_size: int | None = None, scales: str = "group", fallback: bool = False,
              error_budget: float | None = None, compile: bool = False) -> Codec:
    """A codec by its ``KVCachePolicy`` name.

    ``group_size``: elements sharing one scale (fp8/int8 default 128, int4 default 32; int4 needs an even
    size). ``scales``: ``"group"`` or ``"channel"``: one scale per index of the last dim over the whole block,
    which keeps K's outlier channels from inflating every group they sit in (view a [tokens, heads, dim] block
    as [tokens, heads * dim] for a scale per head and channel; int4 needs an even last dim).
    ``fallback``: measure each block's relative error on encode and store blocks over ``error_budget`` with
    the wider codec of ``FALLBACK_TO`` (``out`` must then hold ``max_encoded_nbytes``).
    ``error_budget``: override the codec's documented budget (relative L2 error per block) for fallback.
    ``compile``: encode fp8 group-scaled blocks with torch.compile'd kernels once a background thread has
    compiled them (eager until then; see ``compiled.py``); ignored by the other codecs, where it does not pay.
    """
    if name not in CODEC_CLASSES:
        raise CodecError(f"codec: {name!r} is not one of {', '.join(CODEC_CLASSES)}")
    if not isinstance(fallback, bool):
        raise CodecError(f"fallback: {fallback!r} must be a bool")
    cls = CODEC_CLASSES[name]
    if scales not in ("group", "channel"):
        raise CodecError(f"scales: {scales!r} is not one of group, channel")
    if not issubclass(cls, ScaledCodec):
        if group_size is not None:
            raise CodecError(f"group_size: codec {name!r} has no groups; leave it unset")
        if scales != "group":
            raise CodecError(f"scales: codec {name!r} has no scales; leave it unset")
        codec: Codec = cls(fallback=fallback)
    else:
        per_channel = scales == "channel"
        if per_channel:
            if group_size is not None:
                raise CodecError("group_size: must be unset with scales='channel'")
            group_size = 0
        else:
            if group_size is None:
                group_size = cls.default_group_size
            if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
                raise CodecError(f"group_size: {group_size!r} must be a positive integer")
            if group_size > 1 << 24:
                raise CodecError(f"group_size: {group_size} exceeds {1 << 24}")
            if name == "int4" and group_size % 2:
                raise CodecError(f"group_size: {group_size} must be even for int4 (two codes per byte)")
        codec = cls(group_size=group_size, fallback=fallback, per_channel=per_channel)
    if not isinstance(compile, bool):
        raise CodecError(f"compile: {compile!r} must be a bool")
    if compile and name in _COMPILED_ENCODERS and scales == "group" and isinstance(codec, ScaledCodec):
        from .compiled import CompiledKernels

        codec.compiled_kernels = CompiledKernels(_COMPILED_ENCODERS[name]())
    if error_budget is not None:
        if isinstance(error_budget, bool) or not isinstance(error_budget, (int, float)) or not (
                0 < error_budget < 1):
            raise CodecError(f"error_budget: {error_budget!r} must be a number in (0, 1)")
        codec.error_budget = float(error_budget)
    if fallback and name in FALLBACK_TO:
        wider = FALLBACK_TO[name]
        if wider == "none":
            codec.fallback_codec = get_codec(wider, fallback=True)
        elif codec.per_channel:
            codec.fallback_codec = get_codec(wider, scales="channel", fallback=True)
        else:
            codec.fallback_codec = get_codec(wider, group_size=codec.group_size, fallback=True)
    return codec


def _e4m3():
    from .compiled import fp8_encode_e4m3

    return fp8_encode_e4m3


def _e5m2():
    from .compiled import fp8_encode_e5m2

    return fp8_encode_e5m2


_COMPILED_ENCODERS = {"fp8": _e4m3, "fp8_e5m2": _e5m2}


# One decoder instance per codec name: its scratch is per-thread, and group size etc. come from each header.
_DECODERS: dict[str, Codec] = {}


def _decoder(name: str) -> Codec:
    dec = _DECODERS.get(name)
    if dec is None:
        dec = _DECODERS[name] = CODEC_CLASSES[name]()
    return dec


def peek_header(buf: torch.Tensor | bytes | bytearray | memoryview) -> CodecHeader:
    """Parse and validate the header at the start of ``buf`` (CPU or CUDA); raises ``CodecError``."""
    try:
        header = read_header(as_byte_buffer(buf))
        if header.kv_layout:
            check_kv_header(header)
        else:
            _decoder(header.codec).check_header(header)
        return header
    except CodecError:
        STATS.record_decode_error()
        raise


def decode(buf: torch.Tensor | bytes | bytearray | memoryview, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode one block, whatever codec wrote it. ``out`` (the header's shape and dtype, contiguous, on the
    buffer's device) avoids an allocation; without it a new tensor is returned."""
    data = as_byte_buffer(buf)
    header = peek_header(data)
    if data.numel() < header.total_nbytes:
        STATS.record_decode_error()
        raise CodecError(f"buf: {data.numel()} bytes, the header announces {header.total_nbytes}; block truncated")
    if out is None:
        out = torch.empty(header.shape, dtype=header.dtype, device=data.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise CodecError(f"out: {type(out).__name__} is not a torch.Tensor")
        if header.kv_layout and out.is_contiguous() and (
                (out.dtype == header.dtype and out.numel() == header.numel)
                or (out.dtype in (torch.uint8, torch.int8) and out.numel() == header.numel * header.dtype.itemsize)):
            # a KV chunk decodes into any flat view of its bytes (a tier's row, the engine's pages)
            out_flat = out.reshape(-1).view(torch.uint8).view(header.dtype) if out.dtype != header.dtype else out
            if out.device != data.device:
                raise CodecError(f"out: on {out.device}, the buffer is on {data.device}")
            decode_kv_block(data, header, out_flat.reshape(-1))
            return out
        if tuple(out.shape) != header.shape or out.dtype != header.dtype:
            raise CodecError(
                f"out: {tuple(out.shape)} {out.dtype}, the block holds {header.shape} {header.dtype}")
        if not out.is_contiguous():
            raise CodecError("out: must be contiguous")
        if out.device != data.device:
            raise CodecError(f"out: on {out.device}, the buffer is on {data.device}")
    payload = data[HEADER_NBYTES:header.total_nbytes]
    if header.kv_layout:
        decode_kv_block(data, header, out.reshape(-1))
    else:
        _decoder(header.codec)._decode_payload(payload, header, out.reshape(-1))
    return out
