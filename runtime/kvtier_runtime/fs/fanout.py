"""The fan-out directories block files live in (``<h0h1>/<h2h3>/``, :mod:`.paths`): created on a block's first
write, removed once empty. Shared by the writer (:class:`~.io.BlockIO`) and the index that unlinks files
(:class:`~.index.BlockIndex`); both reach it only through :class:`FanoutDirs`."""
from __future__ import annotations

import os

from .paths import block_relpath


class FanoutDirs:
    """The block files' directories under ``root`` (the tier's namespace directory), and which of them this
    process made (so a write need not ``makedirs`` a directory it knows exists)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._made: set[str] = set()

    def block_path(self, key: bytes) -> str:
        return os.path.join(self.root, block_relpath(key))

    def ensure(self, directory: str) -> None:
        """Create ``directory`` (and its parent) unless this process made it already."""
        if directory not in self._made:
            os.makedirs(directory, exist_ok=True)
            self._made.add(directory)

    def lost(self, directory: str) -> None:
        """``directory`` was found missing (another store's unlink pruned it): make it again on the next write."""
        self._made.discard(directory)

    def prune(self, leaf: str) -> None:
        """Remove the block's fan-out directories once they are empty: left behind they grow to 65,792
        directories (about 260 MiB on ext4) that no capacity counts. A writer that loses the race finds its
        directory gone and recreates it, as often as that happens (:meth:`BlockIO.write_file`)."""
        self._made.discard(leaf)
        for directory in (leaf, os.path.dirname(leaf)):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (the usual case), already gone, or not ours to remove
                return
