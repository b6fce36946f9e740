"""The CRC both tiers' formats use (pure): the filesystem tier's block headers and payloads.

CRC-32 as zlib computes it (the gzip polynomial; every value on disk is zlib's). Large buffers go through
libdeflate's ``libdeflate_crc32`` when the system has the library (Debian/Ubuntu's ``libdeflate0``): the same
function, computed with carry-less multiplication (~25 GB/s on one core here against zlib 1.2's ~4), called
through ctypes, which releases the GIL for the call. Without the library, or for small or non-contiguous
buffers, zlib computes it: the result is the same either way (tests/runtime/tiers check the two agree).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import zlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["checksum", "checksum_backend"]

# Below this a ctypes call costs more than zlib's whole pass (and zlib releases the GIL only above 5 KiB).
_FAST_MIN_BYTES = 16 << 10


def _library_names() -> Iterator[str | None]:
    yield "libdeflate.so.0"
    # Only when the soname is not there: find_library runs ldconfig (a subprocess) in every importing process.
    yield ctypes.util.find_library("deflate")


def _load_libdeflate() -> Callable[[int, Any, int], int] | None:
    for name in _library_names():
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        # Trust it only if it computes zlib's CRC (another build or symbol of that name would corrupt nothing,
        # but every block it wrote would then fail its check elsewhere).
        probe = bytes(range(256)) * 129
        if fn(0, probe, len(probe)) != zlib.crc32(probe) or fn(7, probe, 1000) != zlib.crc32(probe[:1000], 7):
            continue
        return fn
    return None


_crc32 = _load_libdeflate()


def checksum_backend() -> str:
    """Which implementation computes large CRCs here: ``libdeflate`` or ``zlib``."""
    return "zlib" if _crc32 is None else "libdeflate"


def checksum(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """CRC32 of ``data`` continuing from ``value`` (zlib's ``crc32``, the same result whichever library runs it)."""
    if _crc32 is not None:
        if isinstance(data, bytes):
            if len(data) >= _FAST_MIN_BYTES:
                return int(_crc32(value & 0xFFFFFFFF, data, len(data)))
        else:
            mv = memoryview(data)
            # A read-only view (of bytes a caller sliced) cannot be exported to ctypes without a copy: zlib runs it.
            if mv.nbytes >= _FAST_MIN_BYTES and mv.c_contiguous and not mv.readonly:
                # Exporting the buffer pins it for the call; the pointer is its first byte.
                addr = ctypes.addressof((ctypes.c_char * mv.nbytes).from_buffer(mv))
                return int(_crc32(value & 0xFFFFFFFF, addr, mv.nbytes))
    return zlib.crc32(data, value) & 0xFFFFFFFF
