"""On-disk format of one filesystem-tier block file (pure functions, no I/O).

A block file is a 4 KiB header page followed by the codec's payload, zero-padded to a multiple of 4 KiB so that
the whole file can be written and read with O_DIRECT. The header carries everything needed to rebuild the index
after a restart without reading payloads, and a CRC of itself so a torn or flipped header is detected before any
of its fields are trusted.

**Format 2** (what this version writes): the codec's 96-byte blob header sits at the *end* of the header page
(bytes [4000, 4096)), so the codec blob (its header, then its payload) runs contiguously from byte 4000 and the
payload itself starts page-aligned at 4096. An uncompressed block's payload is the caller's row byte for byte,
so it moves between the file and a page-aligned row with O_DIRECT and no staging copy.

**Format 3** (what this version writes with a MAC key; format 2 without one): format 2's layout, with a faster
MAC. Formats 1 and 2 carry HMAC-SHA256 of the header and blob; SHA-256 runs at about 1 GB/s on one core, slower than
the disk, and was the tier's largest cost per block. Format 3 carries GMAC (AES-256-GCM's tag, with the header and
blob as associated data and no plaintext), 15-30x faster with AES-NI and carry-less multiply, under a key used for
one block only: ``HMAC-SHA256(mac key, domain || salt)``, where the salt is 16 random bytes the writer draws per
block and stores in the MAC field beside the tag. GCM's one weakness as a MAC, a nonce used twice under one key
(which reveals the hash key and so allows forgeries), cannot happen: every key authenticates one message (with the
all-zero nonce), and two blocks share a key only if their 128-bit salts collide (about 2^-49 after 2^40 blocks).
A forger without the mac key cannot derive any block key, so changing the salt, the header or the blob fails the
tag (``forged``). Readers keep reading formats 1 and 2 (HMAC-SHA256) as before.

**Format 1** (read, never written): the blob starts at 4096, so the payload sits 96 bytes past a page boundary
and always goes through the staging buffer. All versions share the header fields below; they differ only in
where the blob starts (``BlockHeader.blob_offset``) and in the MAC (its domain tag; format 3's algorithm).

Header layout (little-endian)::

    0   8s   magic  b"KVTIERB1"
    8   H    format version (1 or 2)
    10  H    header length covered by the header CRC (HEADER_USED)
    12  I    CRC32 of bytes [16, HEADER_USED) of the header
    16  16s  codec name (ASCII, NUL padded)
    32  16s  dtype name (ASCII, NUL padded), e.g. "bfloat16"
    48  B    ndim (<= MAX_NDIM), then 7 bytes padding
    56  8Q   shape (unused dims are 0)
    120 Q    blob length in bytes (the codec's header + payload, before padding)
    128 I    CRC32 of the blob
    132 H    key length (<= MAX_KEY_BYTES)
    134 2x
    136 key bytes (MAX_KEY_BYTES, NUL padded)
    1160 32s  formats 1, 2: HMAC-SHA256 of a per-version domain tag, header bytes [0, HEADER_USED) and the blob;
              format 3: a 16-byte salt, then the 16-byte GMAC tag of header bytes [0, HEADER_USED) and the blob
              under the salt's block key; zeros without a MAC key
    4000 96s  formats 2, 3: the codec blob's own header (the blob's first 96 bytes)

The MAC sits outside the header CRC on purpose: the MAC covers the CRC'd bytes itself. A tier configured with a
key serves only blocks whose MAC verifies (of any version it reads).

What every medium's format shares -- the refusal kinds (:class:`FormatError` is the envelope's error), the order of
the reader's checks (magic, version, length, then CRC or MAC), the bounded key and name fields -- is written once in
:mod:`kvtier_runtime.tiers.envelope`; this module keeps the block layout and its primitives (CRC32, HMAC-SHA256,
GMAC).
"""
from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ..tiers.checksum import checksum
from ..tiers.envelope import EnvelopeError, check_key, check_length, name_field, open_head, read_name
from ..tiers.envelope import verify_mac as verify_stored_mac

MAGIC = b"KVTIERB1"
# What this version writes: format 2 without a MAC key, format 3 (the same layout, GMAC) with one.
FORMAT_VERSION = 2
MAC_FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
ALIGN = 4096
HEADER_BYTES = ALIGN
MAX_NDIM = 8
MAX_KEY_BYTES = 1024
NAME_BYTES = 16

_FIXED = struct.Struct("<8sHHI16s16sB7x8QQIH2x")
HEADER_USED = _FIXED.size + MAX_KEY_BYTES
MAC_OFFSET = HEADER_USED
MAC_BYTES = 32
# Formats 1 and 2: HMAC-SHA256 (it ran 2.9x faster than keyed BLAKE2b with SHA-NI), and it derives format 3's block
# keys. Format 3's GMAC: 256 KiB in about 20 us here against HMAC-SHA256's 330 us (docs/performance.md); keyed
# BLAKE3 (a new dependency) ran at 4 GB/s, a fifth of GMAC's speed.
_MAC_DIGEST = "sha256"
_MAC_DOMAINS = {1: b"kvtier-block-v1\0", 2: b"kvtier-block-v2\0", 3: b"kvtier-block-v3\0"}
# Format 3's MAC field: the block key's salt, then the GMAC tag (16 bytes each).
MAC_SALT_BYTES = 16
_GMAC_NONCE = bytes(12)  # every block key authenticates one message: a fixed nonce is never reused under a key
# The codec blob's header (kvtier_runtime.codecs.HEADER_NBYTES; this module stays torch-free, io.py checks they
# agree). Format 2 puts it at the end of the header page so that the payload behind it starts page-aligned.
BLOB_HEADER_BYTES = 96
BLOB_OFFSET = {1: HEADER_BYTES, 2: HEADER_BYTES - BLOB_HEADER_BYTES, 3: HEADER_BYTES - BLOB_HEADER_BYTES}
assert HEADER_USED <= MAC_OFFSET and BLOB_OFFSET[2] >= MAC_OFFSET + MAC_BYTES


# A block refused for what it holds; ``kind`` says why (the envelope's kinds, kvtier_runtime.tiers.envelope.KINDS):
# ``foreign`` (not our magic, or not a regular file), ``forged`` (the keyed MAC does not verify), ``version`` (a
# format this build does not read), ``corrupt`` (a CRC does not match or a field is out of range), ``truncated``
# (shorter than its header says), ``mismatch`` (a valid block, but not the key, shape or dtype that was asked for).
FormatError = EnvelopeError


@dataclass(frozen=True)
class BlockHeader:
    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    payload_crc: int
    key: bytes
    version: int = FORMAT_VERSION

    @property
    def blob_offset(self) -> int:
        """Where the codec blob starts in the file (format 2: 96 bytes before the page-aligned payload)."""
        return BLOB_OFFSET[self.version]

    @property
    def file_bytes(self) -> int:
        return file_bytes_for(self.payload_len, self.version)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def file_bytes_for(payload_len: int, version: int = FORMAT_VERSION) -> int:
    """Size on disk of a block file whose codec blob is ``payload_len`` bytes."""
    return align_up(BLOB_OFFSET[version] + payload_len)


def pack_header(
    *, codec: str, dtype: str, shape: tuple[int, ...], payload_len: int, payload_crc: int, key: bytes,
    version: int = FORMAT_VERSION,
) -> bytes:
    """The 4 KiB header for a block (raises ValueError naming the field when a value cannot be represented).
    The blob header of formats 2 and 3 (bytes [4000, 4096)) is left zero for the caller to fill; ``version=1`` is
    kept for tests that need format-1 files. Format 3's header carries a fresh salt at the start of its MAC field
    (drawn here, so that no writer can reuse one), the rest of which :func:`block_mac` fills."""
    if version not in READ_VERSIONS:
        raise ValueError(f"version: {version} is not one of {READ_VERSIONS}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape: {len(shape)} dimensions, at most {MAX_NDIM}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape: {shape} has a negative dimension")
    check_key(key, MAX_KEY_BYTES)
    if payload_len < 0:
        raise ValueError(f"payload_len: {payload_len} must be >= 0")
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    fixed = _FIXED.pack(
        MAGIC, version, HEADER_USED, 0, name_field("codec", codec, NAME_BYTES),
        name_field("dtype", dtype, NAME_BYTES), len(shape), *dims, payload_len, payload_crc & 0xFFFFFFFF, len(key),
    )
    body = bytearray(HEADER_BYTES)
    body[: _FIXED.size] = fixed
    body[_FIXED.size : _FIXED.size + len(key)] = key
    crc = header_crc(memoryview(body), version)
    struct.pack_into("<I", body, 12, crc)
    if version == MAC_FORMAT_VERSION:
        body[MAC_OFFSET : MAC_OFFSET + MAC_SALT_BYTES] = new_salt()
    return bytes(body)


def header_crc(mv: memoryview, version: int) -> int:
    """The header's CRC32: from byte 16 on; format 3's also covers its version and length (bytes 8-11), so one
    flipped bit can no longer turn a format-2 header into a valid format-3 one or back (2 and 3 differ in one bit)."""
    if version >= MAC_FORMAT_VERSION:
        return checksum(mv[16:HEADER_USED], checksum(mv[8:12]))
    return checksum(mv[16:HEADER_USED])


def parse_header(buf: bytes | memoryview) -> BlockHeader:
    """Parse and verify a header; raises FormatError (never anything else) for any bytes it is given."""
    mv = memoryview(buf)
    open_head(mv, magic=MAGIC, head_bytes=HEADER_USED, readable=READ_VERSIONS, what="block")
    _, version, used, crc, codec, dtype, ndim, *rest = _FIXED.unpack_from(mv, 0)
    if used != HEADER_USED or header_crc(mv, version) != crc:
        raise FormatError("corrupt", "header checksum mismatch")
    dims, (payload_len, payload_crc, key_len) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    if ndim > MAX_NDIM or not 0 < key_len <= MAX_KEY_BYTES:
        raise FormatError("corrupt", f"ndim={ndim} key_len={key_len} out of range")
    codec_s, dtype_s = read_name(codec, "codec name"), read_name(dtype, "dtype name")
    key = bytes(mv[_FIXED.size : _FIXED.size + key_len])
    return BlockHeader(codec_s, dtype_s, tuple(dims[:ndim]), payload_len, payload_crc, key, version)


def verify_length(header: BlockHeader, file_len: int) -> None:
    """Raise FormatError(truncated|corrupt) unless the file is exactly as long as its header says."""
    check_length(file_len, header.file_bytes, "file")


def verify_crc(header: BlockHeader, *blob: memoryview | bytes) -> None:
    """Raise FormatError("corrupt") unless the CRC of the blob (given in consecutive parts) is the header's."""
    crc = 0
    for part in blob:
        crc = checksum(part, crc)
    if crc != header.payload_crc:
        raise FormatError("corrupt", "payload checksum mismatch")


def verify_payload(header: BlockHeader, file_len: int, payload: memoryview, *, check_crc: bool = True) -> None:
    """Check a block's length and (unless a MAC is checked instead) the CRC of its contiguous blob ``payload``
    (at least ``payload_len`` bytes); raises FormatError(truncated|corrupt)."""
    verify_length(header, file_len)
    if check_crc:
        verify_crc(header, payload[: header.payload_len])


def block_mac(mac_key: bytes, header: memoryview | bytes | bytearray, *blob: memoryview | bytes) -> bytes:
    """The MAC field (``MAC_BYTES``) for this header and blob (given in consecutive parts), by the header's format
    version: formats 1 and 2, HMAC-SHA256 of the version's domain tag, the header's covered bytes and the blob
    (OpenSSL; the GIL is released for large inputs); format 3, the salt already in the header's MAC field
    (:func:`pack_header` draws it) followed by the GMAC tag of the covered bytes and the blob under the salt's
    block key (OpenSSL, 15-30x HMAC-SHA256's speed)."""
    mv = memoryview(header)
    version = struct.unpack_from("<H", mv, 8)[0]
    domain = _MAC_DOMAINS.get(version)
    if domain is None:
        raise FormatError("version", f"format version {version} has no MAC")
    if version == MAC_FORMAT_VERSION:
        salt = bytes(mv[MAC_OFFSET : MAC_OFFSET + MAC_SALT_BYTES])
        block_key = hmac.digest(mac_key, domain + salt, _MAC_DIGEST)
        gmac = Cipher(algorithms.AES(block_key), modes.GCM(_GMAC_NONCE)).encryptor()
        gmac.authenticate_additional_data(mv[:HEADER_USED])
        for part in blob:
            gmac.authenticate_additional_data(part)
        gmac.finalize()
        return salt + gmac.tag
    h = hmac.new(mac_key, domain, _MAC_DIGEST)
    h.update(mv[:HEADER_USED])
    for part in blob:
        h.update(part)
    return h.digest()


def new_salt() -> bytes:
    """A fresh salt for a format-3 block's MAC field (its first ``MAC_SALT_BYTES``: the block key's only input
    besides the mac key)."""
    return os.urandom(MAC_SALT_BYTES)


def verify_mac(mac_key: bytes, header: memoryview, *blob: memoryview | bytes) -> None:
    """Raise FormatError("forged") unless the MAC stored in ``header`` is the MAC of this header and blob."""
    try:
        want = block_mac(mac_key, header, *blob)
    except FormatError:  # a version without a MAC domain: no MAC can verify (parse_header refuses it first)
        raise FormatError("forged", "keyed MAC does not verify") from None
    verify_stored_mac(want, header[MAC_OFFSET : MAC_OFFSET + MAC_BYTES])
