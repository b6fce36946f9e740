"""The filesystem tier's start-up scan: rebuild the index from block headers, removing temporary, torn,
foreign and mismatched files -- only inside the tier's own namespace, walked by directory descriptors that never
follow a symlink."""
from __future__ import annotations

import errno
import os
import shutil
import stat

from ..config import ConfigError
from .fileio import regular_size
from .format import HEADER_BYTES, FormatError, parse_header
from .index import Entry
from .paths import block_relpath, is_block_name, is_fanout_name, is_tmp_name


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


class StartupScan:
    """Mixin of :class:`~.tier.FilesystemTier`: the start-up scan."""

    # ---- start-up ---------------------------------------------------------------------------------------
    def _rebuild_index(self) -> dict[str, int]:
        """Rebuild the index from block headers; remove temporary, torn, foreign and mismatched files.

        Only our own namespace directory is scanned and cleaned: files elsewhere under root_dir are left alone.
        Blocks are inserted oldest first (by mtime) so the eviction order starts close to the previous run's.
        """
        stats = {"blocks": 0, "tmp": 0, "foreign": 0, "corrupt": 0, "truncated": 0, "mismatch": 0,
                 "version": 0, "evicted": 0}
        found: list[tuple[float, str, bytes, int]] = []
        head = bytearray(HEADER_BYTES)
        # Walked by directory file descriptors opened with O_NOFOLLOW at every level: a symlink swapped in for
        # the namespace, a fan-out directory or a block file is never followed, so cleanup cannot reach outside.
        top = _open_dir(self.root, None)
        if top is None:
            raise ConfigError(f"root_dir: {self.root} is a symlink or not a directory; refusing it, since "
                              "start-up cleanup would delete files in its target")
        try:
            for d1 in os.listdir(top):
                fd1 = self._scan_dir(top, d1, stats)
                if fd1 is None:
                    continue
                try:
                    for d2 in os.listdir(fd1):
                        fd2 = self._scan_dir(fd1, d2, stats)
                        if fd2 is None:
                            continue
                        try:
                            for name in os.listdir(fd2):
                                self._scan_file(fd2, name, d1, d2, head, stats, found)
                        finally:
                            os.close(fd2)
                        _rmdir_if_empty(fd1, d2)  # left by an earlier run, or emptied by the scan
                finally:
                    os.close(fd1)
                _rmdir_if_empty(top, d1)
        finally:
            os.close(top)
        found.sort()
        with self._lock:
            for _, path, key, nbytes in found:
                evicted = self._policy.insert(key, nbytes)
                if evicted is None:
                    stats["evicted"] += 1
                    self._remove_path_locked(path)
                    continue
                for old in evicted:
                    self._index.pop(old, None)
                    stats["evicted"] += 1
                    self._remove_path_locked(self.block_path(old))
                self._index[key] = Entry("ready", nbytes)
            stats["blocks"] = len(self._index)
        for kind in ("foreign", "corrupt", "truncated", "mismatch", "version"):
            if stats[kind]:
                self._metrics.error(kind, stats[kind])
        if stats["tmp"]:
            self._metrics.error("torn", stats["tmp"])
        return stats

    def _scan_dir(self, parent: int, name: str, stats: dict[str, int]) -> int | None:
        """A descriptor of fan-out directory ``name``, or None after removing whatever else is there (a symlink
        or stray file in the fan-out could point blocks outside root_dir)."""
        if is_fanout_name(name):
            fd = _open_dir(name, parent)
            if fd is not None:
                return fd
        stats["foreign"] += 1
        _remove_entry(parent, name)
        return None

    def _scan_file(
        self, dir_fd: int, name: str, d1: str, d2: str, head: bytearray, stats: dict[str, int],
        found: list[tuple[float, str, bytes, int]],
    ) -> None:
        if is_tmp_name(name):
            stats["tmp"] += 1
            _remove_entry(dir_fd, name)
            return
        if not is_block_name(name):
            stats["foreign"] += 1
            _remove_entry(dir_fd, name)
            return
        relpath = f"{d1}/{d2}/{name}"
        try:
            # O_NONBLOCK: a FIFO here must not block start-up; O_NOFOLLOW: a symlink is not a block.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            stats["foreign"] += 1
            _remove_entry(dir_fd, name)
            return
        try:
            st = os.fstat(fd)
            size = regular_size(self._ops, fd)
            n = os.preadv(fd, [head], 0)
            header = parse_header(memoryview(head)[:n])
            self._check_header(header, None)
            if relpath != block_relpath(header.key):
                raise FormatError("mismatch", "file name does not match the key in its header")
            if size != header.file_bytes:
                raise FormatError("truncated" if size < header.file_bytes else "corrupt", "length")
        except FormatError as exc:
            stats[exc.kind] += 1
            _remove_entry(dir_fd, name)
            return
        except OSError:
            stats["corrupt"] += 1
            _remove_entry(dir_fd, name)
            return
        finally:
            os.close(fd)
        found.append((st.st_mtime, os.path.join(self.root, relpath), header.key, header.file_bytes))

    def _remove_path_locked(self, path: str) -> None:
        try:
            os.unlink(path)
            self._prune_fanout(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError:
            try:
                nbytes = os.lstat(path).st_size
            except OSError:
                return
            self._stuck_locked(path, None, nbytes)
