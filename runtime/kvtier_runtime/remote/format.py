"""The value format of kvtier's remote tier (pure functions, no I/O, no torch).

One chunk is one store value::

    0   8s   magic  b"KVTIERR1"
    8   H    format version
    10  H    key length (the whole store key, model identity included)
    12  B    integrity: 1 = HMAC-SHA256 (32 bytes), 0 = CRC32 (4 bytes)
    13  3x
    16  Q    payload length (the codec's self-describing blob)
    24  16s  codec name the writer was configured with (ASCII, NUL padded)
    40  key bytes
    ... payload
    ... trailer: HMAC-SHA256 or CRC32 of everything before it

The key is inside the value and under its MAC: a value copied to another key (another chunk, another model's
identity) fails as ``mismatch`` and is a miss, however it got there. With a MAC key the trailer is a keyed MAC, so a
writer without the key cannot forge a value (``forged``); a tier with a key refuses unkeyed values too, and a tier
without one refuses keyed values it cannot check (``unverifiable``). Without a key the CRC catches accidents only,
which is why a store shared by several writers should be given a key (docs/remote.md).

The MAC key is read by the filesystem tier's loader (:func:`kvtier_runtime.fs.format.mac_key_from_bytes`: at least
32 bytes); the CRC is the filesystem tier's (:func:`kvtier_runtime.fs.format.checksum`). The MAC is HMAC-SHA256 as
in the filesystem tier's block files, under a domain tag of its own, so a block file's MAC never verifies a value.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

from ..fs.format import checksum

MAGIC = b"KVTIERR1"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sHHB3xQ16s")
HEAD_BYTES = _HEAD.size  # 40
MAX_KEY_BYTES = 512
CODEC_NAME_BYTES = 16
MAC_BYTES = 32
CRC_BYTES = 4
INTEGRITY_CRC, INTEGRITY_MAC = 0, 1
_MAC_DOMAIN = b"kvtier-remote-value-v1\0"


class RemoteFormatError(Exception):
    """A value is not a valid chunk for the key it was read from; ``kind`` says why (``foreign``, ``version``,
    ``truncated``, ``corrupt``, ``forged``, ``unverifiable``, ``mismatch``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail



def header_bytes(key: bytes) -> int:
    """Bytes before the payload of a value stored under ``key``."""
    return HEAD_BYTES + len(key)


def trailer_bytes(mac: bool) -> int:
    return MAC_BYTES if mac else CRC_BYTES


def value_bytes(key_len: int, payload_len: int, mac: bool) -> int:
    """Size of a whole value: header, payload, trailer."""
    return HEAD_BYTES + key_len + payload_len + trailer_bytes(mac)


def _mac(mac_key: bytes, body: memoryview) -> bytes:
    h = hmac.new(mac_key, _MAC_DOMAIN, hashlib.sha256)
    h.update(body)
    return h.digest()


def seal(buf: bytearray | memoryview, key: bytes, codec: str, payload_len: int, mac_key: bytes | None) -> int:
    """Write the header and the trailer around a payload the caller already placed at ``header_bytes(key)`` in
    ``buf``; returns the value's length (``buf[:n]`` is what to store). ValueError names the field that cannot be
    represented."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key: {len(key)} bytes, must be 1..{MAX_KEY_BYTES}")
    name = codec.encode("ascii")
    if not name or len(name) > CODEC_NAME_BYTES:
        raise ValueError(f"codec: {codec!r} must be 1..{CODEC_NAME_BYTES} ASCII characters")
    if payload_len < 0:
        raise ValueError(f"payload_len: {payload_len} must be >= 0")
    mv = memoryview(buf)
    total = value_bytes(len(key), payload_len, mac_key is not None)
    if len(mv) < total:
        raise ValueError(f"buf: {len(mv)} bytes, the value needs {total}")
    _HEAD.pack_into(mv, 0, MAGIC, FORMAT_VERSION, len(key),
                    INTEGRITY_MAC if mac_key is not None else INTEGRITY_CRC, payload_len, name)
    mv[HEAD_BYTES:HEAD_BYTES + len(key)] = key
    end = HEAD_BYTES + len(key) + payload_len
    if mac_key is not None:
        mv[end:end + MAC_BYTES] = _mac(mac_key, mv[:end])
    else:
        struct.pack_into("<I", mv, end, checksum(mv[:end]))
    return total


def open_value(value: bytes | bytearray | memoryview, key: bytes, mac_key: bytes | None) -> tuple[str, memoryview]:
    """Verify a value read from ``key`` and return ``(codec name, payload)`` (a view into ``value``). Raises
    :class:`RemoteFormatError` (never anything else) for any bytes it is given."""
    mv = memoryview(value)
    if len(mv) < HEAD_BYTES:
        raise RemoteFormatError("foreign" if bytes(mv[:8]) != MAGIC else "truncated", f"{len(mv)} bytes")
    magic, version, key_len, integrity, payload_len, codec = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RemoteFormatError("foreign", "no kvtier value magic")
    if version != FORMAT_VERSION:
        raise RemoteFormatError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
    if integrity not in (INTEGRITY_CRC, INTEGRITY_MAC):
        raise RemoteFormatError("corrupt", f"integrity kind {integrity}")
    keyed = integrity == INTEGRITY_MAC
    expected = value_bytes(key_len, payload_len, keyed)
    if len(mv) < expected:
        raise RemoteFormatError("truncated", f"{len(mv)} bytes, the header says {expected}")
    if len(mv) > expected:
        raise RemoteFormatError("corrupt", f"{len(mv)} bytes, the header says {expected}")
    end = HEAD_BYTES + key_len + payload_len
    if mac_key is not None:
        if not keyed:
            raise RemoteFormatError("forged", "an unkeyed value in a tier that requires a MAC")
        if not hmac.compare_digest(_mac(mac_key, mv[:end]), bytes(mv[end:end + MAC_BYTES])):
            raise RemoteFormatError("forged", "keyed MAC does not verify")
    elif keyed:
        raise RemoteFormatError("unverifiable", "a keyed value, and this tier has no MAC key to check it")
    elif struct.unpack_from("<I", mv, end)[0] != checksum(mv[:end]):
        raise RemoteFormatError("corrupt", "checksum mismatch")
    # Checked after the integrity check: only then is the key field the writer's own.
    if bytes(mv[HEAD_BYTES:HEAD_BYTES + key_len]) != key:
        raise RemoteFormatError("mismatch", "the value was written under another key")
    try:
        name = codec.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise RemoteFormatError("corrupt", "codec name is not ASCII") from None
    return name, mv[HEAD_BYTES + key_len:end]
