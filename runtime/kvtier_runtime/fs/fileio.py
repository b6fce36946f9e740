"""Low-level file I/O of the filesystem tier: aligned buffers, O_DIRECT probing, atomic block writes.

All system calls go through one ``FileOps`` object so that tests can inject ENOSPC/EIO or short writes by
subclassing it, exercising the same code paths a failing disk would. Every byte of every block moves through
``FileOps.write`` (stores) or ``FileOps.readinto`` (loads), one call per block: that is the single place a
per-I/O delay (a slow-disk drill) belongs.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat

from .format import ALIGN, FormatError

O_DIRECT = getattr(os, "O_DIRECT", 0)


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

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def readinto(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

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


def write_atomic(ops: FileOps, tmp_path: str, final_path: str, data: memoryview, direct: bool) -> None:
    """Write ``data`` to ``tmp_path``, flush it to stable storage, then rename over ``final_path``.

    A crash leaves either no file, a ``.tmp`` file (removed on the next start) or the complete block: never a
    partial file under the final name. With ``direct`` the data must be aligned in address and length.
    """
    # O_EXCL: the temporary name is unique to this write, so anything already there (a planted FIFO or file) is
    # someone else's and must not be written through.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    fd = ops.open(tmp_path, flags, 0o644)
    try:
        try:
            done = 0
            while done < len(data):
                n = ops.write(fd, data[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write returned 0")
                done += n
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


def read_whole(ops: FileOps, path: str, buf: memoryview, direct: bool) -> int:
    """Read a whole file into ``buf``; returns its size. Raises OSError; a file larger than ``buf`` reads as
    ``len(buf) + 1`` bytes so the caller sees a length mismatch instead of a silent cut."""
    try:
        fd = ops.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except OSError as exc:
        # O_DIRECT on a FIFO or device is EINVAL, a symlink under O_NOFOLLOW is ELOOP: not a block file.
        if exc.errno in (errno.EINVAL, errno.ELOOP, errno.ENXIO) and not _is_regular(path):
            raise FormatError("foreign", "not a regular file") from None
        raise
    try:
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
    finally:
        ops.close(fd)
