"""What every codec shares: argument checks, header writing, the per-block error check and fallback."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .header import (
    DTYPE_IDS,
    FLAG_FALLBACK,
    FLAG_PER_CHANNEL,
    HEADER_NBYTES,
    MAX_NDIM,
    CodecError,
    CodecHeader,
    unpack_header,
)
from .metrics import STATS
from .scratch import ScratchPool

# Elements per chunk. CPU: eager torch pays ~1-5 us per op and a chunk takes ~15 ops, so chunks must be large;
# 2^18 measured as fast as 2^20 (bench/codecs.py --chunk-elems) and keeps a thread's scratch near 5 MiB, within
# L3. 2^16 was 1.5x slower (docs/performance.md).
# CUDA: kernel launches, not caches, dominate, so a chunk is a whole block of any realistic size.
CHUNK_ELEMS = 1 << 18
CUDA_CHUNK_ELEMS = 1 << 22


def chunk_elems(device: torch.device) -> int:
    return CHUNK_ELEMS if device.type == "cpu" else CUDA_CHUNK_ELEMS


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def as_byte_buffer(buf: object, name: str = "buf") -> torch.Tensor:
    """A 1-D uint8 view of a tensor, bytes, bytearray or memoryview, without copying."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8:
            raise CodecError(f"{name}: dtype {buf.dtype} must be torch.uint8")
        if not buf.is_contiguous():
            raise CodecError(f"{name}: must be contiguous")
        return buf.reshape(-1)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        mv = memoryview(buf).cast("B") if isinstance(buf, memoryview) else memoryview(buf)
        if mv.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if mv.readonly:
            # torch.frombuffer warns on read-only memory; decode only reads it, so a bytearray-free view is safe.
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(mv, dtype=torch.uint8)
        return torch.frombuffer(mv, dtype=torch.uint8)
    raise CodecError(f"{name}: {type(buf).__name__} is not a uint8 tensor, bytes, bytearray or memoryview")


def read_header(data: torch.Tensor) -> CodecHeader:
    """The header at the start of a block (a uint8 tensor on CPU or CUDA), parsed and checked for consistency;
    whether its codec accepts it is the caller's check (``registry.peek_header``, ``kv.check_kv_header``)."""
    head = data[:HEADER_NBYTES]
    if head.device.type != "cpu":
        head = head.cpu()
    return unpack_header(head.numpy().tobytes())


class Codec:
    """Base class. Subclasses define ``name``, ``payload_nbytes`` and the two payload kernels.

    ``error_budget`` is the largest relative L2 error ||x - decode(encode(x))|| / ||x|| a block may have; with
    ``fallback=True`` every encode measures it and stores an over-budget block with ``fallback_codec`` instead.
    """

    name: str = ""
    version: int = 1
    error_budget: float = 0.0

    def __init__(self, group_size: int = 0, fallback: bool = False, per_channel: bool = False) -> None:
        self.group_size = group_size
        self.per_channel = per_channel
        self.fallback = fallback
        self.fallback_codec: Codec | None = None
        self._scratch = ScratchPool()

    def __repr__(self) -> str:
        opts = f"group_size={self.group_size}" if self.group_size else ""
        if self.per_channel:
            opts = "scales='channel'"
        return f"{type(self).__name__}({self.name!r}{', ' + opts if opts else ''}, fallback={self.fallback})"

    # ---- sizes -----------------------------------------------------------------------------------------------
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        raise NotImplementedError

    def encoded_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact bytes ``encode`` writes for this shape and dtype when the block does not fall back."""
        _check_shape_dtype(shape, dtype)
        return HEADER_NBYTES + self.payload_nbytes(tuple(shape), dtype)

    def max_encoded_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Bytes ``out`` must hold so that an encode with fallback always fits."""
        n = self.encoded_nbytes(shape, dtype)
        if self.fallback and self.fallback_codec is not None:
            n = max(n, self.fallback_codec.max_encoded_nbytes(shape, dtype))
        return n

    # ---- encode ----------------------------------------------------------------------------------------------
    def encode(self, src: torch.Tensor, out: torch.Tensor) -> int:
        """Write header + payload for ``src`` into ``out`` (1-D uint8, same device); return the bytes written."""
        if not isinstance(src, torch.Tensor):
            raise CodecError(f"src: {type(src).__name__} is not a torch.Tensor")
        _check_shape_dtype(src.shape, src.dtype)
        if not src.is_contiguous():
            raise CodecError("src: must be contiguous")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1:
            raise CodecError("out: must be a 1-D torch.uint8 tensor")
        if out.device != src.device:
            raise CodecError(f"out: on {out.device}, src is on {src.device}; both must be on one device")
        self._check_src_shape(tuple(src.shape))
        return self._encode_as(src, out, self.name)

    def _check_src_shape(self, shape: tuple[int, ...]) -> None:
        """Reject shapes this codec's options cannot lay out (before anything is written)."""

    def _encode_as(self, src: torch.Tensor, out: torch.Tensor, requested: str) -> int:
        shape = tuple(src.shape)
        n = self.encoded_nbytes(shape, src.dtype)
        if out.numel() < n:
            raise CodecError(f"out: {out.numel()} bytes, codec {self.name!r} needs {n} for shape {shape} {src.dtype}")
        flat = src.reshape(-1)
        measure = self.fallback and self.fallback_codec is not None
        err = self._encode_payload(flat, shape, out[HEADER_NBYTES:n], measure)
        # ``not <=`` so that a NaN error (non-finite input) also falls back: ``none`` keeps inf/NaN as they are.
        if measure and err is not None and not err <= self.error_budget:
            assert self.fallback_codec is not None
            STATS.record_fallback(requested, self.fallback_codec.name, err)
            return self.fallback_codec._encode_as(src, out, requested)
        flags = (FLAG_FALLBACK if requested != self.name else 0) | (FLAG_PER_CHANNEL if self.per_channel else 0)
        header = CodecHeader(
            codec=self.name, codec_version=self.version, dtype=src.dtype, shape=shape,
            group_size=self.group_size, payload_nbytes=n - HEADER_NBYTES, requested_codec=requested, flags=flags,
        ).pack()
        hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        out[:HEADER_NBYTES].copy_(hdr)
        STATS.record_encode(self.name, src.numel() * src.element_size(), n)
        return n

    def _encode_payload(self, flat: torch.Tensor, shape: tuple[int, ...], payload: torch.Tensor,
                        measure: bool) -> float | None:
        """Fill ``payload``; when ``measure``, return the block's relative L2 error."""
        raise NotImplementedError

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_payload(self, payload: torch.Tensor, header: CodecHeader, dst: torch.Tensor) -> None:
        """Fill ``dst`` (flat, header.dtype) from ``payload`` (exactly header.payload_nbytes bytes)."""
        raise NotImplementedError

    def check_header(self, header: CodecHeader) -> None:
        """Reject header fields this codec cannot have written (a corrupt header with a valid CRC is unlikely,
        a header from a newer writer is not)."""
        if header.codec_version != self.version:
            raise CodecError(
                f"header.codec_version: {header.codec_version} for codec {self.name!r}; "
                f"this reader knows {self.version}")


def _check_shape_dtype(shape: Sequence[int], dtype: torch.dtype) -> None:
    if dtype not in DTYPE_IDS:
        raise CodecError(f"dtype: {dtype} is not one of torch.float16, torch.bfloat16, torch.float32")
    if len(shape) > MAX_NDIM:
        raise CodecError(f"shape: {len(shape)} dimensions, at most {MAX_NDIM}")
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise CodecError(f"shape: {tuple(shape)} must be non-negative integers")


class PassthroughCodec(Codec):
    """``none``: the raw bytes. The reference every other codec's speed is compared with."""

    name = "none"
    error_budget = 0.0

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return numel_of(shape) * dtype.itemsize

    def _encode_payload(self, flat, shape, payload, measure):
        if flat.numel():
            payload.copy_(flat.view(torch.uint8))
        return 0.0 if measure else None

    def _decode_payload(self, payload, header, dst):
        if dst.numel():
            dst.view(torch.uint8).copy_(payload)

    def check_header(self, header: CodecHeader) -> None:
        super().check_header(header)
        if header.group_size != 0 or header.per_channel:
            raise CodecError("header.group_size: codec 'none' has no groups")
        # Ties the length to the shape, so decode() sees a lying shape as a truncated block before allocating.
        expected = self.payload_nbytes(header.shape, header.dtype)
        if header.payload_nbytes != expected:
            raise CodecError(
                f"header.payload_nbytes: {header.payload_nbytes}, codec 'none' stores {expected} for "
                f"shape {header.shape} {header.dtype}")
