"""The CRC both tiers write (kvtier_runtime.tiers.checksum): whichever library computes it (libdeflate for large
buffers when the system has it, zlib otherwise), every value is zlib's, so files written by either read with either."""
from __future__ import annotations

import ctypes
import os
import zlib

import pytest
from kvtier_runtime.tiers import checksum as mod
from kvtier_runtime.tiers.checksum import checksum


def _buffers() -> list[object]:
    data = bytearray(os.urandom(3 << 20))
    mv = memoryview(data)
    row = (ctypes.c_char * (2 << 20)).from_buffer(data)  # a tier row seen through ctypes, as raw_view makes it
    return [b"", b"x", bytes(data[:4095]), bytes(data), data, mv, mv[1:], mv[4096 : (1 << 20) + 7], mv.cast("H"),
            memoryview(row).cast("B"), memoryview(bytes(data[: 64 << 10])), mv[: (16 << 10) - 1], mv[: 16 << 10]]


@pytest.mark.parametrize("start", [0, 1, 0x1234ABCD, 0xFFFFFFFF])
def test_every_buffer_kind_and_starting_value_gives_zlibs_crc(start: int) -> None:
    for buf in _buffers():
        assert checksum(buf, start) == zlib.crc32(buf, start) & 0xFFFFFFFF  # type: ignore[arg-type]


def test_a_crc_continued_over_parts_equals_the_crc_of_the_whole() -> None:
    data = bytearray(os.urandom((5 << 20) + 13))
    mv = memoryview(data)
    crc = 0
    for at in range(0, len(data), 1 << 20):
        crc = checksum(mv[at : at + (1 << 20)], crc)
    assert crc == zlib.crc32(data)


def test_without_libdeflate_zlib_computes_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = _buffers()
    first = [checksum(buf, 9) for buf in buffers]  # type: ignore[arg-type]
    monkeypatch.setattr(mod, "_crc32", None)
    assert mod.checksum_backend() == "zlib"
    assert [checksum(buf, 9) for buf in buffers] == first  # type: ignore[arg-type]


def test_a_changed_byte_changes_the_crc_on_the_fast_path() -> None:
    data = bytearray(os.urandom(1 << 20))
    before = checksum(data)
    data[777_777] ^= 0x01
    assert checksum(data) != before and checksum(data) == zlib.crc32(data)
