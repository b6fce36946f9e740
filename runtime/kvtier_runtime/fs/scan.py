"""The filesystem tier's start-up scan, :func:`scan_blocks`: find the blocks to rebuild the index from (by their
headers), removing temporary, torn, foreign and mismatched files -- only inside the tier's own namespace, walked by
directory descriptors that never follow a symlink. It reads the disk and nothing of the tier's state: the tier hands
what it found to its index (:meth:`~.index.BlockIndex.adopt`)."""
from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from typing import Any

from ..config import ConfigError
from .fileio import FileOps, regular_size
from .format import HEADER_BYTES, FormatError, parse_header
from .paths import block_relpath, is_block_name, is_fanout_name, is_tmp_name

# What a scan finds per block: (mtime, path, key, file bytes).
Found = tuple[float, str, bytes, int]


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """A descriptor of directory ``name`` (relative to ``dir_fd``), or None if it is a symlink or not a directory."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (NotADirectoryError, FileNotFoundError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


def _rmdir_if_empty(dir_fd: int, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:  # not empty, gone, or not a directory (the scan removed strays already)
        pass


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the directory open at ``dir_fd`` without following it: a symlink is unlinked, never
    its target; a directory is removed by descriptors (shutil.rmtree's symlink-safe walk)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def scan_blocks(root: str, ops: FileOps, check_header: Callable[[Any, bytes | None], None]
                ) -> tuple[dict[str, int], list[Found]]:
    """The blocks under ``root`` (the tier's namespace directory), oldest first (by mtime), whose headers pass
    ``check_header`` (raising FormatError for a block of another shape or dtype), and the scan's counts per kind
    of file removed (``blocks`` and ``evicted`` are left to the caller). Temporary, torn, foreign and mismatched
    files are removed; files elsewhere under root_dir are left alone."""
    stats = {"blocks": 0, "tmp": 0, "foreign": 0, "corrupt": 0, "truncated": 0, "mismatch": 0,
             "version": 0, "evicted": 0}
    found: list[Found] = []
    head = bytearray(HEADER_BYTES)
    # Walked by directory file descriptors opened with O_NOFOLLOW at every level: a symlink swapped in for
    # the namespace, a fan-out directory or a block file is never followed, so cleanup cannot reach outside.
    top = _open_dir(root, None)
    if top is None:
        raise ConfigError(f"root_dir: {root} is a symlink or not a directory; refusing it, since "
                          "start-up cleanup would delete files in its target")
    try:
        for d1 in os.listdir(top):
            fd1 = _scan_dir(top, d1, stats)
            if fd1 is None:
                continue
            try:
                for d2 in os.listdir(fd1):
                    fd2 = _scan_dir(fd1, d2, stats)
                    if fd2 is None:
                        continue
                    try:
                        for name in os.listdir(fd2):
                            entry = _scan_file(ops, check_header, fd2, name, f"{d1}/{d2}/{name}", head, stats)
                            if entry is not None:
                                mtime, relpath, key, nbytes = entry
                                found.append((mtime, os.path.join(root, relpath), key, nbytes))
                    finally:
                        os.close(fd2)
                    _rmdir_if_empty(fd1, d2)  # left by an earlier run, or emptied by the scan
            finally:
                os.close(fd1)
            _rmdir_if_empty(top, d1)
    finally:
        os.close(top)
    found.sort()
    return stats, found


def _scan_dir(parent: int, name: str, stats: dict[str, int]) -> int | None:
    """A descriptor of fan-out directory ``name``, or None after removing whatever else is there (a symlink
    or stray file in the fan-out could point blocks outside root_dir)."""
    if is_fanout_name(name):
        fd = _open_dir(name, parent)
        if fd is not None:
            return fd
    stats["foreign"] += 1
    _remove_entry(parent, name)
    return None


def _scan_file(ops: FileOps, check_header: Callable[[Any, bytes | None], None], dir_fd: int, name: str,
               relpath: str, head: bytearray, stats: dict[str, int]) -> Found | None:
    """The block file ``name`` (at ``relpath`` under the namespace) as found, or None after removing it."""
    if is_tmp_name(name):
        stats["tmp"] += 1
        _remove_entry(dir_fd, name)
        return None
    if not is_block_name(name):
        stats["foreign"] += 1
        _remove_entry(dir_fd, name)
        return None
    try:
        # O_NONBLOCK: a FIFO here must not block start-up; O_NOFOLLOW: a symlink is not a block.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        stats["foreign"] += 1
        _remove_entry(dir_fd, name)
        return None
    try:
        st = os.fstat(fd)
        size = regular_size(ops, fd)
        n = os.preadv(fd, [head], 0)
        header = parse_header(memoryview(head)[:n])
        check_header(header, None)
        if relpath != block_relpath(header.key):
            raise FormatError("mismatch", "file name does not match the key in its header")
        if size != header.file_bytes:
            raise FormatError("truncated" if size < header.file_bytes else "corrupt", "length")
    except FormatError as exc:
        stats[exc.kind] += 1
        _remove_entry(dir_fd, name)
        return None
    except OSError:
        stats["corrupt"] += 1
        _remove_entry(dir_fd, name)
        return None
    finally:
        os.close(fd)
    return (st.st_mtime, relpath, header.key, header.file_bytes)
