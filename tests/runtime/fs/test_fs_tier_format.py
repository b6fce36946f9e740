"""Pure parts of the filesystem tier: header format, file names, aligned I/O helpers."""
from __future__ import annotations

import os
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier_runtime.fs import format as fmt
from kvtier_runtime.fs import paths
from kvtier_runtime.fs.fileio import AlignedBuffer, FileOps, probe_o_direct, read_whole, write_atomic
from kvtier_runtime.tiers.keys import mac_key_from_bytes


def _header(**over):
    args = dict(codec="none", dtype="bfloat16", shape=(2, 16, 8, 128), payload_len=12345, payload_crc=77,
                key=b"\x01" * 36)
    args.update(over)
    return fmt.pack_header(**args)


def test_header_round_trip() -> None:
    raw = _header()
    assert len(raw) == fmt.HEADER_BYTES
    h = fmt.parse_header(raw)
    assert (h.codec, h.dtype, h.shape, h.payload_len, h.payload_crc, h.key) == (
        "none", "bfloat16", (2, 16, 8, 128), 12345, 77, b"\x01" * 36)
    # format 2: the blob starts 96 bytes before the page-aligned payload; the file is padded to whole pages
    assert h.version == 2 and h.blob_offset == fmt.HEADER_BYTES - 96
    assert h.file_bytes == fmt.align_up(fmt.HEADER_BYTES - 96 + 12345) == fmt.HEADER_BYTES + fmt.align_up(12345 - 96)
    v1 = fmt.parse_header(_header(version=1))
    assert (v1.version, v1.blob_offset, v1.file_bytes) == (1, fmt.HEADER_BYTES, fmt.HEADER_BYTES + fmt.align_up(12345))


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, fmt.HEADER_USED - 1), bit=st.integers(0, 7))
def test_any_flipped_header_bit_is_detected(pos: int, bit: int) -> None:
    raw = bytearray(_header())
    raw[pos] ^= 1 << bit
    with pytest.raises(fmt.FormatError) as info:
        fmt.parse_header(bytes(raw))
    assert info.value.kind in ("foreign", "version", "corrupt")


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=5000))
def test_arbitrary_bytes_never_raise_anything_but_format_error(data: bytes) -> None:
    try:
        fmt.parse_header(data)
    except fmt.FormatError:
        pass


def test_truncated_header_and_foreign_file() -> None:
    with pytest.raises(fmt.FormatError, match="truncated"):
        fmt.parse_header(_header()[:100])
    with pytest.raises(fmt.FormatError, match="foreign"):
        fmt.parse_header(b"hello world" * 500)


def test_payload_verification() -> None:
    payload = bytearray(os.urandom(5000))
    h = fmt.parse_header(_header(payload_len=5000, payload_crc=fmt.checksum(payload)))
    fmt.verify_payload(h, h.file_bytes, memoryview(payload))
    with pytest.raises(fmt.FormatError, match="truncated"):
        fmt.verify_payload(h, h.file_bytes - 1, memoryview(payload))
    with pytest.raises(fmt.FormatError, match="corrupt"):
        fmt.verify_payload(h, h.file_bytes + fmt.ALIGN, memoryview(payload))
    payload[4999] ^= 0x10
    with pytest.raises(fmt.FormatError, match="payload checksum"):
        fmt.verify_payload(h, h.file_bytes, memoryview(payload))


@pytest.mark.parametrize("field,value,rule", [
    ("shape", (1,) * 9, "at most 8"), ("key", b"", "1..1024"), ("key", b"k" * 1025, "1..1024"),
    ("codec", "x" * 17, "1..16"), ("dtype", "", "1..16"), ("payload_len", -1, ">= 0"),
])
def test_unrepresentable_fields_are_named(field: str, value: object, rule: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}: .*{rule}"):
        _header(**{field: value})


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=1, max_size=300))
def test_block_paths_are_confined_and_well_formed(key: bytes) -> None:
    rel = paths.block_relpath(key)
    d1, d2, name = rel.split("/")
    assert paths.is_fanout_name(d1) and paths.is_fanout_name(d2)
    assert paths.is_block_name(name)
    assert set(rel) <= set("0123456789abcdefh/.kvb")
    root = "/r/" + paths.NAMESPACE
    assert os.path.normpath(os.path.join(root, rel)).startswith(root + "/")
    assert len(name) < 255


def test_path_traversal_bytes_are_only_hex() -> None:
    key = b"../../etc/passwd\x00/"
    rel = paths.block_relpath(key)
    assert ".." not in rel.replace(".kvb", "") and rel.endswith(key.hex() + ".kvb")
    with pytest.raises(ValueError, match="key"):
        paths.block_relpath(b"")
    with pytest.raises(ValueError, match="key"):
        paths.block_relpath("not-bytes")  # type: ignore[arg-type]


def test_long_keys_are_named_by_digest_and_names_are_recognised() -> None:
    assert paths.block_name(b"k" * 101).startswith("h")
    assert paths.is_block_name(paths.block_name(b"k" * 101))
    assert not paths.is_block_name("abc.kvb")  # odd hex length
    assert not paths.is_block_name("../x.kvb")
    assert paths.is_tmp_name(paths.block_name(b"ab") + ".tmp.12.3")
    assert not paths.is_tmp_name("random.tmp.1")


def test_aligned_buffer_is_page_aligned() -> None:
    import ctypes

    buf = AlignedBuffer(8192)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf.mv))
    assert addr % fmt.ALIGN == 0
    with pytest.raises(ValueError, match="nbytes"):
        AlignedBuffer(100)


@pytest.mark.parametrize("direct", [False, True])
def test_atomic_write_and_read_back(tmp_path, direct: bool) -> None:
    if direct and not probe_o_direct(str(tmp_path)):
        pytest.skip("the filesystem of tmp_path does not support O_DIRECT")
    buf = AlignedBuffer(3 * fmt.ALIGN)
    buf.mv[:] = os.urandom(len(buf.mv))
    final = str(tmp_path / "f.kvb")
    write_atomic(FileOps(), final + ".tmp.1", final, buf.mv, direct)
    assert sorted(os.listdir(tmp_path)) == ["f.kvb"]
    back = AlignedBuffer(4 * fmt.ALIGN)
    assert read_whole(FileOps(), final, back.mv, direct) == 3 * fmt.ALIGN
    assert bytes(back.mv[: 3 * fmt.ALIGN]) == bytes(buf.mv)
    small = AlignedBuffer(2 * fmt.ALIGN)
    assert read_whole(FileOps(), final, small.mv, direct) == 2 * fmt.ALIGN + 1  # oversize is reported


def test_failed_write_leaves_no_file(tmp_path) -> None:
    import errno

    class Full(FileOps):
        def write(self, fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    buf = AlignedBuffer(fmt.ALIGN)
    with pytest.raises(OSError):
        write_atomic(Full(), str(tmp_path / "f.tmp.1"), str(tmp_path / "f"), buf.mv, False)
    assert os.listdir(tmp_path) == []


@settings(max_examples=100, deadline=None)
@given(version=st.sampled_from(fmt.READ_VERSIONS), pos=st.integers(0, fmt.HEADER_BYTES + 5000 - 1),
       bit=st.integers(0, 7))
def test_the_mac_covers_header_blob_and_itself(version: int, pos: int, bit: int) -> None:
    # The blob (the codec's header + payload) starts at 4000 in format 2 (its header ends the header page) and
    # at 4096 in format 1; the MAC covers the header's fields, itself and every byte of the blob.
    mac_key = b"k" * 32
    start = fmt.BLOB_OFFSET[version]
    blob_len = fmt.HEADER_BYTES + 5000 - start
    block = bytearray(_header(payload_len=blob_len, version=version)) + bytes(range(256)) * 20
    block[start:] = bytes(i % 251 for i in range(blob_len))
    block[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = fmt.block_mac(mac_key, block, block[start:])
    mv = memoryview(block)
    fmt.verify_mac(mac_key, mv[: fmt.HEADER_BYTES], mv[start:])
    fmt.verify_mac(mac_key, mv[: fmt.HEADER_BYTES], mv[start:start + 100], mv[start + 100:])  # in parts, too
    covered = pos < fmt.HEADER_USED + fmt.MAC_BYTES or pos >= start
    block[pos] ^= 1 << bit
    if covered:
        with pytest.raises(fmt.FormatError, match="forged"):
            fmt.verify_mac(mac_key, mv[: fmt.HEADER_BYTES], mv[start:])
    else:  # unused header bytes after the MAC: not part of any field
        fmt.verify_mac(mac_key, mv[: fmt.HEADER_BYTES], mv[start:])
    with pytest.raises(fmt.FormatError, match="forged"):
        fmt.verify_mac(b"j" * 32, mv[: fmt.HEADER_BYTES], mv[start:])


def test_the_mac_of_one_format_version_does_not_verify_as_the_other() -> None:
    # Relabelling a block's version (header CRC recomputed by a forger without the key) must not keep its MAC.
    mac_key = b"k" * 32
    blob = os.urandom(5000)
    v1 = bytearray(_header(payload_len=len(blob), version=1))
    v2 = bytearray(_header(payload_len=len(blob), version=2))
    v1[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = fmt.block_mac(mac_key, v1, blob)
    v2[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = v1[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES]
    fmt.verify_mac(mac_key, memoryview(v1), blob)
    with pytest.raises(fmt.FormatError, match="forged"):
        fmt.verify_mac(mac_key, memoryview(v2), blob)


def test_the_mac_of_format_3_is_gmac_under_a_key_of_its_own_per_block() -> None:
    # Computed here through the one-shot AEAD API (header and blob joined), not the streaming one the tier uses:
    # the block key is HMAC-SHA256(mac key, domain || salt), the tag AES-256-GCM's over no plaintext with the
    # covered header bytes and the blob as associated data, the nonce all zeros (the key authenticates one block).
    import hmac

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    mac_key, blob = os.urandom(40), os.urandom(5000)
    head = bytearray(_header(payload_len=len(blob), version=3))
    salt = bytes(head[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_SALT_BYTES])
    field = fmt.block_mac(mac_key, head, blob[:7], blob[7:])
    block_key = hmac.digest(mac_key, b"kvtier-block-v3\0" + salt, "sha256")
    tag = AESGCM(block_key).encrypt(bytes(12), b"", bytes(head[: fmt.HEADER_USED]) + blob)
    assert field == salt + tag and len(field) == fmt.MAC_BYTES
    head[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = field
    fmt.verify_mac(mac_key, memoryview(head), blob)


def test_every_format_3_header_draws_a_fresh_salt() -> None:
    # Two blocks under one block key would reuse GCM's nonce (revealing its hash key): the salt is never repeated
    # (random, 128 bits) and never left zero.
    salts = {fmt.pack_header(codec="none", dtype="bfloat16", shape=(4,), payload_len=8, payload_crc=0, key=b"k",
                             version=3)[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_SALT_BYTES] for _ in range(64)}
    assert len(salts) == 64 and bytes(fmt.MAC_SALT_BYTES) not in salts
    # formats 1 and 2 leave the MAC field to their HMAC
    assert _header(version=2)[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] == bytes(fmt.MAC_BYTES)


@pytest.mark.parametrize("signed, relabelled", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_a_mac_does_not_verify_under_another_format_version(signed: int, relabelled: int) -> None:
    # A forger without the key who relabels a block's version (and recomputes the header CRC) gets the other
    # version's MAC checked: HMAC-SHA256 for formats 1 and 2, GMAC for format 3.
    mac_key, blob = b"k" * 32, os.urandom(5000)
    head = bytearray(_header(payload_len=len(blob), version=signed))
    head[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] = fmt.block_mac(mac_key, head, blob)
    fmt.verify_mac(mac_key, memoryview(head), blob)
    head[8:10] = relabelled.to_bytes(2, "little")
    with pytest.raises(fmt.FormatError, match="forged"):
        fmt.verify_mac(mac_key, memoryview(head), blob)


def test_an_unknown_version_is_refused_when_packing_and_reported_when_parsing() -> None:
    with pytest.raises(ValueError, match=r"^version: 4 is not one of \(1, 2, 3\)$"):
        _header(version=4)
    raw = bytearray(_header())
    raw[8:10] = (4).to_bytes(2, "little")
    with pytest.raises(fmt.FormatError) as info:
        fmt.parse_header(bytes(raw))
    assert info.value.kind == "version"


def test_a_short_mac_key_is_refused_naming_the_file() -> None:
    with pytest.raises(ValueError, match=r"^mac_key_file: /k holds 31 bytes, needs at least 32$"):
        mac_key_from_bytes(b"x" * 31 + b"\n", "/k")


def test_a_binary_key_is_read_as_every_byte_written() -> None:
    # 32 random bytes end in 0x0a about one time in 256: such a key must be kept whole, not cut to 31 and refused.
    binary = bytes(range(0x90, 0xAF)) + b"\n"
    assert len(binary) == 32 and mac_key_from_bytes(binary, "/k") == binary
    every_byte = bytes(range(256))  # every value, newline and NUL included
    assert mac_key_from_bytes(every_byte, "/k") == every_byte
    assert mac_key_from_bytes(every_byte + b"\n", "/k") == every_byte + b"\n"
    # A printable text key written with echo loses only its one trailing newline, as before.
    text = b"0123456789abcdef0123456789abcdef"
    assert mac_key_from_bytes(text + b"\n", "/k") == text
    assert mac_key_from_bytes(text, "/k") == text


def test_a_vectored_block_write_and_read_survive_short_system_calls(tmp_path) -> None:
    # Format 2 writes a block as segments (header page, the caller's row, a tail page) in one vectored call; a
    # kernel may return short, and the rest must follow from the right byte of the right segment.
    from kvtier_runtime.fs.fileio import read_segments

    class Short(FileOps):
        def write(self, fd, data):
            first = data[0] if not isinstance(data, memoryview) else data
            return super().write(fd, [first[:3001]] if not isinstance(data, memoryview) else first[:3001])

        def readinto(self, fd, buf, offset):
            first = buf[0] if not isinstance(buf, memoryview) else buf
            return super().readinto(fd, [first[:2999]], offset)

    parts = [os.urandom(4096), os.urandom(10000), b"", os.urandom(77)]
    final = str(tmp_path / "f.kvb")
    write_atomic(Short(), final + ".tmp.1", final, [memoryview(p) for p in parts], False)
    assert pathlib.Path(final).read_bytes() == b"".join(parts)
    back = [bytearray(len(p)) for p in parts]
    fd = os.open(final, os.O_RDONLY)
    try:
        assert read_segments(Short(), fd, [memoryview(b) for b in back]) == sum(map(len, parts))
    finally:
        os.close(fd)
    assert [bytes(b) for b in back] == parts
