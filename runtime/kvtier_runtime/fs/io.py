"""The filesystem tier's block I/O (pool threads), :class:`BlockIO`: encode with the tier's codec, write a
checksummed file atomically; read it back, verify header, length, CRC or MAC, and decode into the caller's tensor.
A helper object the tier owns: it knows the file format and the codec, not the index (the tier's tasks turn what
it raises into an error kind for the key and settle the index).

Two paths (format 2, see :mod:`.format`):

* **direct** -- codec ``none``, O_DIRECT on, and the caller's tensor page-aligned (vLLM's CPU-tier rows and
  kvtier's host slab are): one vectored system call moves the header page, the row itself and (when the row is
  not a whole number of pages) a small tail page between the file and the caller's memory. No staging buffer is
  allocated. Stores CRC (and MAC) the row first, then write from it; loads read into the row, then check the
  CRC (or MAC) over it: a block that fails any check is never reported loaded, but the row may hold its bytes.
* **staging** -- everything else (a compressed codec, which encodes into / decodes from the staging buffer
  itself; an unaligned tensor; no O_DIRECT, e.g. tmpfs; format-1 files): the whole file goes through a
  per-thread page-aligned staging buffer, and the caller's tensor is touched only by the codec, under the
  job's ``io_lock``.

A direct load lends the caller's memory to the kernel for one ``preadv``: if that call is still running when the
job's ``io_timeout_s`` passes, the job is not finished until it returns (finishing it would hand the caller
back memory a late read could still overwrite); meanwhile new loads take the staging path, which times out
cleanly, and stores count the fault towards backoff (:meth:`BlockIO.pause_direct_reads`). See
:meth:`kvtier_runtime.tiers.jobs.JobQueue._expire`.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..codecs import HEADER_NBYTES, STATS, Codec, CodecHeader, KVChunkCodec, decode, peek_header
from ..codecs.base import PassthroughCodec
from ..codecs.header import FLAG_PER_CHANNEL
from ..tiers.checksum import checksum
from ..tiers.jobs import Expired, Job
from .fanout import FanoutDirs
from .fileio import (
    AlignedBuffer,
    FileOps,
    open_block,
    raw_view,
    read_segments,
    read_whole_fd,
    regular_size,
    write_atomic,
)
from .format import (
    ALIGN,
    BLOB_HEADER_BYTES,
    BLOB_OFFSET,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_FORMAT_VERSION,
    MAC_OFFSET,
    READ_VERSIONS,
    FormatError,
    block_mac,
    file_bytes_for,
    pack_header,
    parse_header,
    verify_length,
    verify_mac,
    verify_payload,
)
from .paths import TMP_MARK

assert BLOB_HEADER_BYTES == HEADER_NBYTES, "format 2 reserves the codec header's size at the end of the header page"

log = logging.getLogger("kvtier_runtime.fs.tier")

# Where formats 2 and 3 put the codec blob: its 96-byte header ends the header page, its payload starts page-aligned.
_BLOB = BLOB_OFFSET[FORMAT_VERSION]
assert BLOB_OFFSET[MAC_FORMAT_VERSION] == _BLOB
# The versions a direct read can serve (the blob where the direct path reads it).
_DIRECT_VERSIONS = (FORMAT_VERSION, MAC_FORMAT_VERSION)
# How often a store retries when the fan-out directory it writes into is pruned under it (each retry recreates
# the directory; another store's unlink can only prune it between our mkdir and our open, so a handful of tries
# is plenty).
_DIR_ATTEMPTS = 8


def _may_fall_back(codec: Codec | KVChunkCodec) -> bool:
    """Whether a block may be stored with a wider codec than ``codec.name`` (the block's own header then says)."""
    if isinstance(codec, KVChunkCodec):  # the engine path's layout-aware codec: a verifying one walks its chain
        return len(codec.chain) > 1
    return bool(codec.fallback and codec.fallback_codec is not None)


class BlockIO:
    """Block files of one shape and dtype through ``codec``: written under ``dirs`` with ``ops``, read back and
    checked (``mac_key``: the files carry a MAC, checked instead of the payload CRC). ``direct_io``: O_DIRECT is
    on (files opened with it; codec ``none`` then takes the direct path for page-aligned tensors)."""

    def __init__(self, *, name: str, codec: Codec | KVChunkCodec, ops: FileOps, dirs: FanoutDirs,
                 block_shape: tuple[int, ...], dtype: torch.dtype, mac_key: bytes | None, direct_io: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self.codec = codec
        self._ops = ops
        self._dirs = dirs
        self.block_shape = block_shape
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self._mac_key = mac_key
        # Blocks are written as format 2, or with a MAC key as format 3 (its faster MAC; see .format).
        self._version = FORMAT_VERSION if mac_key is None else MAC_FORMAT_VERSION
        self.direct_io = direct_io
        self._clock = clock
        # Staging buffers hold a whole file of either format (format 1's is the longer); a codec with fallback
        # may emit its wider fallback encoding.
        self.max_payload = codec.max_encoded_nbytes(block_shape, dtype)
        self.nominal_file_bytes = file_bytes_for(codec.encoded_nbytes(block_shape, dtype))
        self._buffer_bytes = max(file_bytes_for(self.max_payload, v) for v in READ_VERSIONS)
        self._local = threading.local()
        self._tmp_ids = itertools.count(1)
        self._init_direct_path()

    @property
    def direct(self) -> bool:
        """Whether blocks may take the direct path (off for good once the filesystem refused it)."""
        return self._direct

    def pause_direct_reads(self, until: float) -> None:
        """Loads take the staging path (which times out cleanly) until ``until`` on the tier's clock: a direct
        read overran its job."""
        self._direct_reads_resume_at = until

    def _init_direct_path(self) -> None:
        """Decide once whether blocks of this tier can take the direct path (codec ``none``, O_DIRECT), and
        precompute what every such block shares: its codec header and its split into whole pages and a tail."""
        codec = self.codec
        self._direct = bool(self.direct_io) and type(codec) is PassthroughCodec
        self._direct_reads_resume_at = 0.0  # reads take the staging path until then (a read overran its job)
        nbytes = 1
        for d in self.block_shape:
            nbytes *= d
        nbytes *= self.dtype.itemsize
        self._row_bytes = nbytes
        self._row_pages = nbytes // ALIGN * ALIGN  # the part of a row moved straight to or from the file
        self._direct_file_bytes = file_bytes_for(HEADER_NBYTES + nbytes)
        self._none_blob_header = b""
        if self._direct and isinstance(codec, PassthroughCodec):
            self._none_blob_header = CodecHeader(
                codec="none", codec_version=codec.version, dtype=self.dtype, shape=self.block_shape,
                group_size=codec.group_size, payload_nbytes=nbytes, requested_codec="none",
                flags=FLAG_PER_CHANNEL if codec.per_channel else 0,
            ).pack()
        # The blob's CRC starts with its (constant) header: the row's CRC continues from this.
        self._none_blob_crc = checksum(self._none_blob_header)

    # ---- I/O tasks (pool threads) -----------------------------------------------------------------------
    def staging(self) -> tuple[AlignedBuffer, torch.Tensor]:
        """This thread's staging buffer (a whole file of either format), allocated on first use."""
        local = self._local
        if getattr(local, "buf", None) is None:
            local.buf = AlignedBuffer(self._buffer_bytes + ALIGN)
            local.tensor = torch.frombuffer(local.buf.mv, dtype=torch.uint8)
        return local.buf, local.tensor

    def _pages(self) -> tuple[memoryview, memoryview]:
        """This thread's header page and tail page for the direct path (8 KiB, not a whole file)."""
        local = self._local
        if getattr(local, "pages", None) is None:
            local.pages = AlignedBuffer(2 * ALIGN)
        return local.pages.mv[:ALIGN], local.pages.mv[ALIGN:]

    def _aligned(self, t: torch.Tensor) -> bool:
        return t.is_cpu and t.is_contiguous() and t.data_ptr() % ALIGN == 0

    def _direct_refused(self, exc: OSError, what: str) -> None:
        """An O_DIRECT transfer between the file and the caller's memory failed: EINVAL means the filesystem
        refused the row's alignment after all, so the staging buffer is used from now on; anything else raises."""
        if exc.errno != errno.EINVAL:
            raise exc
        log.warning("filesystem tier %s: O_DIRECT refused %s the caller's memory (%s); using the staging buffer",
                    self._name, what, exc.strerror or exc)
        self._direct = False

    def write_block(self, job: Job, key: bytes, block: torch.Tensor) -> int:
        if self._direct and self._aligned(block):
            try:
                return self._write_direct(job, key, block)
            except OSError as exc:
                self._direct_refused(exc, "a write straight from")
        buf, tensor = self.staging()
        with job.io_lock:  # the only read of the caller's tensor
            if job.expired:
                raise Expired()
            src = block if block.is_contiguous() else block.contiguous()
            # The codec writes its blob where format 2 wants it: header at the end of the header page.
            nbytes = self.codec.encode(src, tensor[_BLOB : _BLOB + self.max_payload])
        end = _BLOB + nbytes
        total = file_bytes_for(nbytes)
        if end < total:  # zero the padding so no stale bytes of an earlier block reach the disk
            tensor[end:total].zero_()
        crc = checksum(buf.mv[_BLOB:end])
        header = pack_header(
            # the codec actually used (after any fallback), from the blob's own header
            codec=self._written_codec(tensor[_BLOB:end]), dtype=self.dtype_name, shape=self.block_shape,
            payload_len=nbytes, payload_crc=crc, key=key, version=self._version,
        )
        buf.mv[:_BLOB] = header[:_BLOB]  # the blob's header, already in place, stays
        if self._mac_key is not None:
            buf.mv[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = block_mac(self._mac_key, buf.mv, buf.mv[_BLOB:end])
        self.write_file(key, buf.mv[:total])
        return nbytes

    def _write_direct(self, job: Job, key: bytes, block: torch.Tensor) -> int:
        """Codec ``none`` from a page-aligned tensor: CRC (and MAC) the row, then one ``writev`` of the header
        page, the row's whole pages and a zero-padded tail page. The row is read twice (hash, then DMA) and never
        copied; should the caller change it in between (only after its job expired), the file fails its check."""
        page, tail = self._pages()
        n, whole = self._row_bytes, self._row_pages
        blob_header = self._none_blob_header
        # The hashes read the caller's tensor: lent (not under io_lock, which would serialise the hashing of
        # every block of a job), so the job cannot expire under them. A job that expired before keeps its row.
        with job.io_lock:
            if job.expired:
                raise Expired()
            job.lent += 1
        try:
            row = raw_view(block.data_ptr(), n)
            crc = checksum(row, self._none_blob_crc)
            if n > whole:
                tail[: n - whole] = row[whole:]
                tail[n - whole :] = bytes(ALIGN - (n - whole))
            page[:] = pack_header(codec="none", dtype=self.dtype_name, shape=self.block_shape,
                                  payload_len=HEADER_NBYTES + n, payload_crc=crc, key=key, version=self._version)
            page[_BLOB:] = blob_header
            if self._mac_key is not None:
                page[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = block_mac(self._mac_key, page, page[_BLOB:], row)
        finally:
            with job.io_lock:
                job.lent -= 1
        STATS.record_encode("none", n, HEADER_NBYTES + n)  # what codec none's encode would have counted
        segments = [page]
        if whole:
            segments.append(row[:whole])
        if n > whole:
            segments.append(tail)
        self.write_file(key, segments)
        return HEADER_NBYTES + n

    def write_file(self, key: bytes, data: memoryview | Sequence[memoryview]) -> None:
        """Write a block file atomically under its fan-out directory, recreating the directory when it was
        pruned under us (another store's unlink emptied it) -- as often as that happens, up to _DIR_ATTEMPTS."""
        final = self._dirs.block_path(key)
        directory = os.path.dirname(final)
        tmp = f"{final}{TMP_MARK}{os.getpid()}.{next(self._tmp_ids)}"
        for attempt in range(_DIR_ATTEMPTS):
            self._dirs.ensure(directory)
            try:
                write_atomic(self._ops, tmp, final, data, self.direct_io)
                return
            except FileNotFoundError:  # the fan-out directory was removed behind our back
                self._dirs.lost(directory)
                if attempt == _DIR_ATTEMPTS - 1:
                    raise

    def _written_codec(self, blob: torch.Tensor) -> str:
        # Parsing the blob's header costs ~0.4 ms of GIL-held Python per block (measured in the fs bench
        # breakdown); only a codec that can fall back needs it to learn what it wrote.
        if not _may_fall_back(self.codec):
            return self.codec.name
        return peek_header(blob).codec

    def read_block(self, job: Job, key: bytes, out: torch.Tensor) -> None:
        fd = open_block(self._ops, self._dirs.block_path(key), self.direct_io)
        try:
            size = regular_size(self._ops, fd)
            if (self._direct and size == self._direct_file_bytes and self._aligned(out)
                    and self._clock() >= self._direct_reads_resume_at
                    and self._read_direct(job, fd, size, key, out)):
                return
            buf, tensor = self.staging()
            size = read_whole_fd(self._ops, fd, buf.mv, self.direct_io)
        finally:
            self._ops.close(fd)
        header = parse_header(buf.mv[: min(size, HEADER_BYTES)])
        self.check_header(header, key)
        start = header.blob_offset
        # With a MAC key the MAC is the integrity check (it catches every change a CRC catches), so the CRC pass
        # over the payload is skipped: one hash per block instead of two.
        verify_payload(header, size, buf.mv[start:], check_crc=self._mac_key is None)
        if header.payload_len > self.max_payload:
            raise FormatError("mismatch", f"payload of {header.payload_len} bytes exceeds {self.max_payload}")
        blob = buf.mv[start : start + header.payload_len]
        if self._mac_key is not None:
            verify_mac(self._mac_key, buf.mv[:HEADER_BYTES], blob)
        with job.io_lock:  # the only write of the caller's tensor
            if job.expired:
                raise Expired()
            decode(tensor[start : start + header.payload_len], out=out)

    def _read_direct(self, job: Job, fd: int, size: int, key: bytes, out: torch.Tensor) -> bool:
        """One ``preadv`` of the header page, the row's whole pages (straight into ``out``) and the tail page,
        then the checks over ``out``. False (nothing served) when the file is not a format-2 ``none`` block of
        this row's size after all -- a format-1 file or another codec's of the same length: the caller then
        reads it again through the staging buffer. Raises FormatError as the staging path does."""
        with job.io_lock:
            # Past the deadline (the job is about to expire) lend nothing: the staging path times out cleanly.
            if job.expired or time.monotonic() >= job.deadline:
                return False
            job.lent += 1  # from here until the matching decrement, _expire leaves the job open
            job.lent_reads += 1
        try:
            page, tail = self._pages()
            n, whole = self._row_bytes, self._row_pages
            row = raw_view(out.data_ptr(), n)
            segments = [page]
            if whole:
                segments.append(row[:whole])
            if n > whole:
                segments.append(tail)
            try:
                got = read_segments(self._ops, fd, segments)
            except OSError as exc:
                self._direct_refused(exc, "a read straight into")
                return False
            header = parse_header(page[: min(got, HEADER_BYTES)])
            self.check_header(header, key)
            if (header.version not in _DIRECT_VERSIONS or header.codec != "none"
                    or header.payload_len != HEADER_NBYTES + n or bytes(page[_BLOB:]) != self._none_blob_header):
                return False
            verify_length(header, min(got, size))
            if n > whole:
                row[whole:] = tail[: n - whole]
            if self._mac_key is not None:
                verify_mac(self._mac_key, page, page[_BLOB:], row)
            elif checksum(row, self._none_blob_crc) != header.payload_crc:  # the blob's header is the one above
                raise FormatError("corrupt", "payload checksum mismatch")
            return True
        finally:
            with job.io_lock:
                job.lent -= 1
                job.lent_reads -= 1

    def check_header(self, header: Any, key: bytes | None) -> None:
        if key is not None and header.key != key:
            raise FormatError("mismatch", "file holds another key")
        if header.shape != self.block_shape or header.dtype != self.dtype_name:
            raise FormatError(
                "mismatch", f"block is {header.dtype}{list(header.shape)}, tier is {self.dtype_name}{list(self.block_shape)}"
            )
