"""Low-level file I/O of the filesystem tier: aligned buffers, O_DIRECT probing, atomic block writes.

All system calls go through one ``FileOps`` object so that tests can inject ENOSPC/EIO or short writes by
subclassing it, exercising the same code paths a failing disk would. Every byte of every block moves through
``FileOps.write`` (stores) or ``FileOps.readinto`` (loads), one call per block: that is the single place a
per-I/O delay (a slow-disk drill) belongs. A block that moves without a staging copy (format 2's direct path)
is one vectored call: ``write`` and ``readinto`` take one buffer or a list of buffers.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Union

from .format import ALIGN, FormatError

O_DIRECT = getattr(os, "O_DIRECT", 0)

# One buffer, or the segments of one vectored call (O_DIRECT: each aligned in address and length).
Buffers = Union[memoryview, Sequence[memoryview]]


def address_of(mv: memoryview) -> int:
    """The address of a writable memoryview's first byte (to check O_DIRECT alignment)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def raw_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address`` (a contiguous tensor's ``data_ptr()``); the caller keeps
    the owner alive for as long as the view is used."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def advance(bufs: Sequence[memoryview], n: int) -> list[memoryview]:
    """The segments left after the first ``n`` bytes of ``bufs`` (a partial vectored write or read)."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


class AlignedBuffer:
    """Page-aligned memory (anonymous mmap), as O_DIRECT requires; allocated once and reused."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0 or nbytes % ALIGN:
            raise ValueError(f"nbytes: {nbytes} must be a positive multiple of {ALIGN}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        self.mv = memoryview(self._map)

    def close(self) -> None:
        self.mv.release()
        self._map.close()


class FileOps:
    """Thin wrappers over os.* that tests override to inject faults.

    Every open refuses a symlink as the last component (O_NOFOLLOW) and never waits for a peer (O_NONBLOCK: a
    FIFO swapped in for a block file would otherwise block ``open`` until a writer appears; on a regular file
    the flag changes nothing). Callers then check with ``fstat`` that they opened a regular file.
    """

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, mode)

    def write(self, fd: int, data: Buffers) -> int:
        if isinstance(data, memoryview):
            return os.write(fd, data)
        return os.writev(fd, list(data))

    def readinto(self, fd: int, buf: Buffers, offset: int) -> int:
        return os.preadv(fd, [buf] if isinstance(buf, memoryview) else list(buf), offset)

    def fsync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def regular_size(ops: FileOps, fd: int) -> int:
    """Size of the regular file open at ``fd``; FormatError("foreign") for a FIFO, device, socket or directory."""
    st = ops.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError("foreign", f"not a regular file (mode {stat.filemode(st.st_mode)})")
    return st.st_size


def probe_o_direct(directory: str, ops: FileOps | None = None) -> bool:
    """Whether the filesystem holding ``directory`` accepts an aligned O_DIRECT write and read (tmpfs does not)."""
    if not O_DIRECT:
        return False
    ops = ops or FileOps()
    path = os.path.join(directory, f".odirect-probe.{os.getpid()}")
    buf = AlignedBuffer(ALIGN)
    try:
        fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            ok = ops.write(fd, buf.mv) == ALIGN
        finally:
            ops.close(fd)
        fd = ops.open(path, os.O_RDONLY | O_DIRECT)
        try:
            ok = ok and ops.readinto(fd, buf.mv, 0) == ALIGN
        finally:
            ops.close(fd)
        return ok
    except OSError:
        return False
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def write_atomic(ops: FileOps, tmp_path: str, final_path: str, data: Buffers, direct: bool) -> None:
    """Write ``data`` (one buffer, or segments written by one vectored call) to ``tmp_path``, flush it to stable
    storage, then rename over ``final_path``.

    A crash leaves either no file, a ``.tmp`` file (removed on the next start) or the complete block: never a
    partial file under the final name. With ``direct`` every segment must be aligned in address and length.
    """
    # O_EXCL: the temporary name is unique to this write, so anything already there (a planted FIFO or file) is
    # someone else's and must not be written through.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    fd = ops.open(tmp_path, flags, 0o644)
    try:
        try:
            if isinstance(data, memoryview):
                done = 0
                while done < len(data):
                    n = ops.write(fd, data[done:])
                    if n <= 0:
                        raise OSError(errno.EIO, "write returned 0")
                    done += n
            else:
                left = [b for b in data if len(b)]
                while left:
                    n = ops.write(fd, left)
                    if n <= 0:
                        raise OSError(errno.EIO, "write returned 0")
                    left = advance(left, n)
            ops.fsync(fd)
        finally:
            ops.close(fd)
        ops.rename(tmp_path, final_path)
    except BaseException:
        try:
            ops.unlink(tmp_path)
        except OSError:
            pass
        raise


def open_block(ops: FileOps, path: str, direct: bool) -> int:
    """Open a block file for reading; FormatError("foreign") for what is not a regular file, else OSError."""
    try:
        return ops.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except OSError as exc:
        # O_DIRECT on a FIFO or device is EINVAL, a symlink under O_NOFOLLOW is ELOOP: not a block file.
        if exc.errno in (errno.EINVAL, errno.ELOOP, errno.ENXIO) and not _is_regular(path):
            raise FormatError("foreign", "not a regular file") from None
        raise


def read_segments(ops: FileOps, fd: int, segments: Sequence[memoryview]) -> int:
    """Fill ``segments`` from the start of the file (one vectored call unless the kernel returns short);
    returns the bytes read, fewer at end of file."""
    left, done = [s for s in segments if len(s)], 0
    while left:
        n = ops.readinto(fd, left, done)
        if n <= 0:
            break
        done += n
        left = advance(left, n)
    return done


def read_whole(ops: FileOps, path: str, buf: memoryview, direct: bool) -> int:
    """Read a whole file into ``buf``; returns its size. Raises OSError; a file larger than ``buf`` reads as
    ``len(buf) + 1`` bytes so the caller sees a length mismatch instead of a silent cut."""
    fd = open_block(ops, path, direct)
    try:
        return read_whole_fd(ops, fd, buf, direct)
    finally:
        ops.close(fd)


def read_whole_fd(ops: FileOps, fd: int, buf: memoryview, direct: bool) -> int:
    """:func:`read_whole` of an open file."""
    size = regular_size(ops, fd)
    if size > len(buf):
        return len(buf) + 1
    want = size if not direct else min(len(buf), (size + ALIGN - 1) // ALIGN * ALIGN)
    done = 0
    while done < size:
        n = ops.readinto(fd, buf[done:want], done)
        if n <= 0:
            break
        done += n
    return min(done, size)
