"""The self-describing header that travels in front of every encoded block.

A block written under one codec must still decode after a policy switches codec, so the reader never trusts
its own configuration: everything it needs (codec, codec version, group size, source dtype, shape, payload
length) is in these 96 bytes, and a CRC32 over them turns a torn or foreign header into a clean
``CodecError`` instead of garbage tensors.

Layout (little endian)::

    0  4s  magic b"KVTC"
    4  u8  header format version (1)
    5  u8  codec id (the codec whose payload follows)
    6  u8  codec payload version
    7  u8  source dtype id
    8  u8  ndim (0..8)
    9  u8  flags (bit 0: a fallback replaced the requested codec; bit 1: per-channel scales;
           bit 2: a KV-layout block, see ``kv.py``)
    10 u8  requested codec id (differs from the codec id after a fallback)
    11 u8  KV-layout blocks: the layout code (``KVLayout.code``); else reserved, 0
    12 u32 group size (0 for codecs without groups; KV-layout blocks: K token group | V channel group << 16)
    16 u64 payload bytes following the header
    24 8 x u64 shape (unused dims 0)
    88 u32 KV-layout blocks: the quantisation scheme (1: K per channel, V per token, bf16 scales; 2 | n << 8:
           scheme 1 with n K channels per layer, head and page kept apart exactly, int4 only, see ``kv.py``); else 0
    92 u32 CRC32 of bytes 0..91
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from .errors import CodecError

MAGIC = b"KVTC"
HEADER_FORMAT_VERSION = 1
HEADER_NBYTES = 96
MAX_NDIM = 8

FLAG_FALLBACK = 1
FLAG_PER_CHANNEL = 2
FLAG_KV_LAYOUT = 4
_KNOWN_FLAGS = FLAG_FALLBACK | FLAG_PER_CHANNEL | FLAG_KV_LAYOUT

_BODY = struct.Struct("<4sBBBBBBBBIQ8QI")
_CRC = struct.Struct("<I")
assert _BODY.size + _CRC.size == HEADER_NBYTES

# Wire ids are part of the on-disk format: never renumber, only append.
CODEC_IDS: dict[str, int] = {"none": 0, "fp8": 1, "fp8_e5m2": 2, "int8": 3, "int4": 4}
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}
DTYPE_IDS: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_IDS.items()}


@dataclass(frozen=True)
class CodecHeader:
    codec: str
    codec_version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    group_size: int
    payload_nbytes: int
    requested_codec: str
    flags: int = 0
    layout_code: int = 0      # KV-layout blocks only
    scheme: int = 0           # KV-layout blocks only

    @property
    def fallback(self) -> bool:
        """True when the block was stored with a wider codec than the one requested (error over budget)."""
        return bool(self.flags & FLAG_FALLBACK)

    @property
    def kv_layout(self) -> bool:
        return bool(self.flags & FLAG_KV_LAYOUT)

    @property
    def per_channel(self) -> bool:
        return bool(self.flags & FLAG_PER_CHANNEL)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def total_nbytes(self) -> int:
        return HEADER_NBYTES + self.payload_nbytes

    def pack(self) -> bytes:
        if len(self.shape) > MAX_NDIM:
            raise CodecError(f"shape: {len(self.shape)} dimensions, at most {MAX_NDIM} are supported")
        dims = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _BODY.pack(
            MAGIC, HEADER_FORMAT_VERSION, CODEC_IDS[self.codec], self.codec_version, DTYPE_IDS[self.dtype],
            len(self.shape), self.flags, CODEC_IDS[self.requested_codec], self.layout_code, self.group_size,
            self.payload_nbytes, *dims, self.scheme,
        )
        return body + _CRC.pack(zlib.crc32(body))


def unpack_header(raw: bytes) -> CodecHeader:
    """Parse and validate a header; anything inconsistent raises ``CodecError`` naming the field."""
    if len(raw) < HEADER_NBYTES:
        raise CodecError(f"header: {len(raw)} bytes, a block starts with a {HEADER_NBYTES}-byte header")
    raw = bytes(raw[:HEADER_NBYTES])
    if raw[:4] != MAGIC:
        raise CodecError(f"header.magic: {raw[:4]!r} is not {MAGIC!r}; not a kvtier encoded block")
    (crc,) = _CRC.unpack_from(raw, _BODY.size)
    if zlib.crc32(raw[: _BODY.size]) != crc:
        raise CodecError("header.crc32: checksum mismatch; the header is corrupt")
    (_, version, codec_id, codec_version, dtype_id, ndim, flags, requested_id, reserved, group_size,
     payload_nbytes, *rest) = _BODY.unpack_from(raw)
    dims, reserved2 = rest[:MAX_NDIM], rest[MAX_NDIM]
    if version != HEADER_FORMAT_VERSION:
        raise CodecError(f"header.version: {version} is not supported (this reader knows {HEADER_FORMAT_VERSION})")
    if codec_id not in CODEC_NAMES:
        raise CodecError(f"header.codec: id {codec_id} is unknown")
    if requested_id not in CODEC_NAMES:
        raise CodecError(f"header.requested_codec: id {requested_id} is unknown")
    if dtype_id not in DTYPES:
        raise CodecError(f"header.dtype: id {dtype_id} is unknown")
    if ndim > MAX_NDIM:
        raise CodecError(f"header.ndim: {ndim} exceeds {MAX_NDIM}")
    if flags & ~_KNOWN_FLAGS or (not flags & FLAG_KV_LAYOUT and (reserved or reserved2)):
        raise CodecError("header.flags: unknown flag or non-zero reserved field")
    if flags & FLAG_KV_LAYOUT and (flags & FLAG_PER_CHANNEL or not reserved or not reserved2):
        raise CodecError("header.flags: a KV-layout block needs a layout code and a scheme, and no channel flag")
    if any(d != 0 for d in dims[ndim:]):
        raise CodecError("header.shape: non-zero dimension past ndim")
    return CodecHeader(
        codec=CODEC_NAMES[codec_id], codec_version=codec_version, dtype=DTYPES[dtype_id],
        shape=tuple(int(d) for d in dims[:ndim]), group_size=group_size, payload_nbytes=payload_nbytes,
        requested_codec=CODEC_NAMES[requested_id], flags=flags, layout_code=reserved, scheme=reserved2,
    )
