"""Degraded mode and backoff of the filesystem tier: a directory the tier cannot write to degrades it to
serving what it has; repeated disk-level faults (``BACKOFF_KINDS``) refuse stores for an exponentially growing
time. Also the error kinds an ``OSError`` maps to, which every other part of the tier counts by."""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from ..config import ConfigError
from ..tiers.backoff import Backoff
from .tier_metrics import FilesystemMetrics

log = logging.getLogger("kvtier_runtime.fs.tier")

IO_ERRNO_KIND = {
    errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio", errno.EROFS: "erofs",
    errno.EACCES: "eacces", errno.EPERM: "eacces",
}


# Kinds that say the disk or directory itself is failing (not one bad file): repeated, they trigger backoff.
BACKOFF_KINDS = frozenset({"enospc", "eio", "erofs", "eacces", "timeout"})


class TierHealth:
    """The filesystem tier's health, a helper object of :class:`~.tier.FilesystemTier` (``tier.disk_health``): the
    namespace directory, degraded mode (``degraded``: why the tier cannot store, or None) and store backoff.

    ``lock`` is the tier's: faults are reported from several pool threads."""

    def __init__(self, *, name: str, root: str, metrics: FilesystemMetrics, backoff: Backoff,
                 lock: threading.Lock) -> None:
        self.name = name
        self.root = root
        self.backoff = backoff
        self._metrics = metrics
        self._lock = lock
        # Why the tier cannot store (a read-only or forbidden directory), or None: it then serves what it finds
        # and refuses every store with this reason, instead of failing the engine's start-up.
        self.degraded: str | None = None

    @property
    def in_backoff(self) -> bool:
        return self.backoff.active

    def open_namespace(self) -> None:
        """Create ``<root_dir>/kvtier-blocks-v1`` and make sure it is a real directory.

        A symlink there is refused: start-up removes every file of the namespace it does not recognise, and
        following a link would do that in the link's target. A read-only or forbidden directory degrades the
        tier (see ``degraded``) instead of raising a bare OSError into the engine."""
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            os.mkdir(self.root, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            self._degrade(exc)
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return  # degraded above: nothing to serve
        except OSError as exc:
            self._degrade(exc)
            return
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"root_dir: {self.root} is a symlink; refusing it, since start-up cleanup would "
                              "delete files in its target (make it a real directory)")
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"root_dir: {self.root} exists and is not a directory")
        if self.degraded is None and not os.access(self.root, os.W_OK):
            read_only = bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
            code = errno.EROFS if read_only else errno.EACCES
            self._degrade(OSError(code, os.strerror(code)))

    def _degrade(self, exc: OSError) -> None:
        kind = IO_ERRNO_KIND.get(exc.errno or 0, "other")
        self.degraded = kind
        log.error("filesystem tier %s: %s is unusable for stores (%s: %s); serving existing blocks only",
                  self.name, self.root, kind, exc.strerror or exc)
        self._metrics.error(kind)

    # ---- backoff ----------------------------------------------------------------------------------------
    def io_failure(self) -> None:
        """A disk-level fault (or an expired job): one more towards store backoff."""
        with self._lock:
            if self.backoff.failure() is not None:
                self._metrics.backoff(True)

    def io_success(self) -> None:
        """A block written: the faults in a row start over."""
        if self.backoff.failures:  # after every block written: the lock only when there is a streak to end
            with self._lock:
                self.backoff.success()
        self._metrics.backoff(False)
