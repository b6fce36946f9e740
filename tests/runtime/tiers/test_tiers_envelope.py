"""The envelope both tiers' formats read and write through (kvtier_runtime.tiers.envelope), and the bytes of each
format pinned: blocks and values written before the envelope was shared still read, and what is written now is
byte for byte what was written then."""
from __future__ import annotations

import hashlib
import struct
from unittest import mock

import pytest
from kvtier_runtime.fs import format as fs_format
from kvtier_runtime.remote import format as remote_format
from kvtier_runtime.tiers import envelope
from kvtier_runtime.tiers.envelope import EnvelopeError

MAGIC = b"KVTIERX1"
HEAD = 20


def _head(version: int = 2, size: int = HEAD) -> bytes:
    raw = MAGIC + struct.pack("<H", version)
    return raw + b"\0" * (size - len(raw))


def _open(buf: bytes) -> int:
    return envelope.open_head(buf, magic=MAGIC, head_bytes=HEAD, readable=(1, 2), what="test")


def test_open_head_returns_a_readable_version():
    assert _open(_head(1)) == 1
    assert _open(_head(2, size=HEAD + 100)) == 2


@pytest.mark.parametrize(("buf", "kind", "detail"), [
    (b"", "foreign", "0 bytes, no test magic"),
    (b"KVTIER", "foreign", "6 bytes, no test magic"),  # a prefix of the magic is not the magic
    (b"something else entirely, long enough", "foreign", "no test magic"),
    (MAGIC + b"\x02\x00", "truncated", "header is 10 bytes, needs 20"),
    (_head(3), "version", "format version 3, this build reads (1, 2)"),
    (_head(0), "version", "format version 0, this build reads (1, 2)"),
])
def test_open_head_refuses_by_kind(buf: bytes, kind: str, detail: str):
    with pytest.raises(EnvelopeError) as info:
        _open(buf)
    assert (info.value.kind, info.value.detail) == (kind, detail)


def test_length_shorter_is_truncated_longer_is_corrupt():
    envelope.check_length(10, 10, "value")
    with pytest.raises(EnvelopeError, match=r"^truncated: value is 9 bytes, header says 10$"):
        envelope.check_length(9, 10, "value")
    with pytest.raises(EnvelopeError, match=r"^corrupt: value is 11 bytes, header says 10$"):
        envelope.check_length(11, 10, "value")


def test_key_and_name_fields_are_bounded_and_named():
    envelope.check_key(b"k", 4)
    envelope.check_key(b"kkkk", 4)
    for bad in (b"", b"kkkkk"):
        with pytest.raises(ValueError, match=rf"^key: {len(bad)} bytes, must be 1\.\.4$"):
            envelope.check_key(bad, 4)
    assert envelope.name_field("codec", "none", 16) == b"none"
    for bad in ("", "x" * 17, "nöne"):
        with pytest.raises(ValueError, match=r"^codec: .* must be 1\.\.16 ASCII characters$"):
            envelope.name_field("codec", bad, 16)
    assert envelope.read_name(b"int8\0\0\0\0", "codec name") == "int8"
    with pytest.raises(EnvelopeError, match=r"^corrupt: codec name is not ASCII$"):
        envelope.read_name(b"\xff\0", "codec name")


def test_bound_data_changes_with_the_key():
    assert envelope.bound_data(b"head", b"k1") == b"headk1"
    assert envelope.bound_data(memoryview(b"head"), b"k1") != envelope.bound_data(b"head", b"k2")


def test_mac_compare_refuses_any_other_mac_as_forged():
    envelope.verify_mac(b"\x01" * 32, memoryview(b"\x01" * 32))
    with pytest.raises(EnvelopeError) as info:
        envelope.verify_mac(b"\x01" * 32, b"\x01" * 31 + b"\x02")
    assert info.value.kind == "forged"


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind: 'odd' is not one of"):
        EnvelopeError("odd", "x")


def test_both_formats_refuse_with_the_one_envelope_error():
    assert fs_format.FormatError is EnvelopeError is remote_format.RemoteFormatError


# ---- the bytes of both formats, recorded from the build before the envelope was shared ---------------------------

def test_filesystem_block_headers_and_macs_are_byte_identical():
    v1 = fs_format.pack_header(codec="none", dtype="bfloat16", shape=(2, 16, 8, 64), payload_len=4096 + 96,
                               payload_crc=0xDEADBEEF, key=b"k" * 40, version=1)
    v2 = fs_format.pack_header(codec="int8-kv", dtype="float16", shape=(3, 5), payload_len=1234,
                               payload_crc=0x01020304, key=b"\x00\xffabc", version=2)
    assert hashlib.sha256(v1).hexdigest() == "0976f3193d5d61f52f9e9c58f4a8ce6dd4b0855f527157a6303258a34b10bc74"
    assert hashlib.sha256(v2).hexdigest() == "9742c0afba73519514ab0da8567dea333a25bffb621559bc2e6ceb65cda3c49e"
    mac_key = bytes(range(32))
    assert fs_format.block_mac(mac_key, v1, b"blob-a", b"blob-b").hex() == (
        "6f39abf8761e67ef91f2404b2ed9897a2fd3d71ec677b9e888e87eafc1d667ed")
    assert fs_format.block_mac(mac_key, v2, b"payload").hex() == (
        "982b7c601927006118b03cc2ec84cc102672a4e2f3a872daf06943d18d052a00")
    h = fs_format.parse_header(v2)
    assert (h.codec, h.dtype, h.shape, h.payload_len, h.payload_crc, h.key, h.version) == (
        "int8-kv", "float16", (3, 5), 1234, 0x01020304, b"\x00\xffabc", 2)


# A value sealed by the earlier build: tenant key bytes(range(32, 64)), scope "team-a", identity "ab12", store key
# b"chunk-key", codec "none", payload b"hello world", nonce bytes(range(12)).
OLD_VALUE = bytes.fromhex(
    "4b5654494552523102000100000000000b000000000000006e6f6e65000000000000000000000000000102030405060708090a0b7ad066"
    "1a87aaed241ca770dab8b4bbc88492b237eef3d4d7d728bc")


# The same value as this build seals it (format 3: the key id 0x55b6fca1 in the header's spare bytes, so the tag
# differs too): pinned, so a format change is a decision, never an accident.
VALUE = bytes.fromhex(
    "4b56544945525231030001a1fcb655000b000000000000006e6f6e65000000000000000000000000000102030405060708090a0b7ad066"
    "1a87aaed241ca7703d110b0d86a5812c135ef5bac083c315")


def _sealer() -> remote_format.Sealer:
    return remote_format.Sealer(bytes(range(32, 64)), "team-a", "ab12")


def test_a_remote_value_of_the_earlier_build_still_opens():
    out = bytearray(64)
    codec, payload = _sealer().open(OLD_VALUE, b"chunk-key", out)
    assert (codec, bytes(payload)) == ("none", b"hello world")
    with pytest.raises(EnvelopeError) as info:  # the key binding holds: moved to another store key, it is refused
        _sealer().open(OLD_VALUE, b"other-key", out)
    assert info.value.kind == "forged"


@pytest.mark.parametrize("parts", [False, True])
def test_remote_values_are_sealed_byte_identically(parts: bool):
    buf = bytearray(remote_format.value_bytes(11))
    with mock.patch.object(remote_format.os, "urandom", lambda n: bytes(range(n))):
        if parts:
            n = _sealer().seal_parts(buf, b"chunk-key", "none", [memoryview(b"hello "), memoryview(b"world")])
        else:
            n = _sealer().seal(buf, b"chunk-key", "none", memoryview(b"hello world"))
    assert bytes(buf[:n]) == VALUE
