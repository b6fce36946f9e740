"""A chunk's store value from a host row, and a value back into one: the codec, then the tenant's seal
(:mod:`.format`), in buffers of each I/O thread's own. A value is decrypted into the thread's plaintext buffer and
checked there; only a verified payload reaches the caller's row, and only under the job's ``io_lock``, so a job
that timed out is never written into."""
from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence

import torch

from ..codecs import STATS, Codec, CodecHeader, KVChunkCodec, decode
from ..codecs.base import PassthroughCodec
from ..tiers.jobs import Expired, Job
from .format import ValueSealer, value_bytes

__all__ = ["ChunkValues"]


class ChunkValues:
    """Values of rows of ``block_shape`` and ``dtype`` through ``codec``, sealed by ``sealer`` (thread-safe: the
    buffers are per thread)."""

    def __init__(self, *, codec: Codec | KVChunkCodec, sealer: ValueSealer, block_shape: Sequence[int],
                 dtype: torch.dtype) -> None:
        self.codec = codec
        self._sealer = sealer
        self.max_payload = codec.max_encoded_nbytes(tuple(block_shape), dtype)
        self.row_bytes = math.prod(block_shape) * dtype.itemsize
        # Codec none: every payload is this header, then the row's bytes as they are. A store seals the row in place
        # (no encoded copy) and a load copies a verified payload with that header into the row with one memmove.
        self.raw_header = passthrough_header(codec, tuple(block_shape), dtype, self.row_bytes)
        # The largest value (header, ciphertext, tag).
        self.max_value_bytes = value_bytes(self.max_payload)
        self._local = threading.local()

    def buffers(self, n: int) -> list[bytearray]:
        """This thread's value buffers (a pipeline holds views of each until it is sent), at least ``n``."""
        bufs: list[bytearray] = getattr(self._local, "bufs", None) or []
        while len(bufs) < n:
            bufs.append(bytearray(self.max_value_bytes))
        self._local.bufs = bufs
        return bufs

    def _plain(self) -> tuple[bytearray, int]:
        """This thread's plaintext buffer and its address: the codec encodes into it before sealing, a value
        decrypts into it before decoding (never into the caller's row: a refused value's bytes must never reach
        it). The address is for the memmove of a verified payload into a row (the export pins the buffer)."""
        plain: bytearray | None = getattr(self._local, "plain", None)
        if plain is None:
            plain = self._local.plain = bytearray(self.max_payload)
            self._local.plain_at = ctypes.addressof((ctypes.c_char * len(plain)).from_buffer(plain))
            self._local.plain_tensor = torch.frombuffer(plain, dtype=torch.uint8)
        at: int = self._local.plain_at
        return plain, at

    def seal(self, job: Job, store_key: bytes, block: torch.Tensor, buf: bytearray) -> int:
        """Seal ``block`` (the caller's row, read under ``job.io_lock``) as the value of ``store_key`` into ``buf``;
        its length. Raises :class:`Expired` when the job timed out first, a codec's error when it cannot encode."""
        raw = self.raw_header
        if raw is not None and block.device.type == "cpu" and block.is_contiguous():
            with job.io_lock:  # the only read of the caller's row: sealed from the row itself
                if job.expired:
                    raise Expired()
                total = self._sealer.seal_parts(buf, store_key, self.codec.name,
                                                (memoryview(raw), row_bytes_of(block, self.row_bytes)))
            STATS.record_encode(self.codec.name, self.row_bytes, len(raw) + self.row_bytes)
            return total
        plain, _ = self._plain()
        with job.io_lock:  # the only read of the caller's row
            if job.expired:
                raise Expired()
            n = self.codec.encode(block if block.is_contiguous() else block.contiguous(), self._local.plain_tensor)
        # Encrypted from the plaintext buffer straight into the value's buffer (the pipeline sends a view).
        return self._sealer.seal(buf, store_key, self.codec.name, memoryview(plain)[:n])

    def open_into(self, job: Job, value: bytes | bytearray | memoryview, store_key: bytes,
                  out: torch.Tensor) -> None:
        """Verify ``value`` (read from ``store_key``) and decode it into ``out`` (the caller's row, written under
        ``job.io_lock``). Raises :class:`Expired` when the job timed out first, a RemoteFormatError or CodecError
        for a value refused for what it holds."""
        plain, plain_at = self._plain()
        _, payload = self._sealer.open(value, store_key, plain)
        with job.io_lock:  # the only write of the caller's row
            if job.expired:
                raise Expired()
            raw = self.raw_header
            if raw is not None and len(payload) == len(raw) + self.row_bytes and payload[:len(raw)] == raw:
                # What decode() would do for these header bytes (codec none, this shape and dtype: a copy), without
                # its torch ops; the payload is verified and sits at the buffer's start.
                ctypes.memmove(out.data_ptr(), plain_at + len(raw), self.row_bytes)
            else:
                decode(payload, out=out)


def passthrough_header(codec: Codec | KVChunkCodec, shape: tuple[int, ...], dtype: torch.dtype,
                       nbytes: int) -> bytes | None:
    """The codec header codec ``none`` writes in front of every row of this shape and dtype (it holds no checksum of
    the payload, so it is the same for every row); None for any other codec, which must run to encode."""
    if type(codec) is not PassthroughCodec or codec.fallback_codec is not None or codec.per_channel:
        return None
    return CodecHeader(codec=codec.name, codec_version=codec.version, dtype=dtype, shape=shape, group_size=0,
                       payload_nbytes=nbytes, requested_codec=codec.name, flags=0).pack()


def row_bytes_of(row: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of a contiguous CPU row, in place (a view the cipher reads; valid while ``row`` lives)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(row.data_ptr())).cast("B")
