"""The tenant keys a remote tier seals and opens values with, and their rotation without a restart (pure but for
reading two key files; no torch).

A rotation (docs/security.md, "Rotating the tenant key") is two edits of the tenant key's Secret: first the new key
becomes current and the old one moves to the previous key; once every replica has switched (and the chunks written
under the old key aged out, or are no longer wanted), the previous key is removed. The kubelet swaps the projected
files in place, and a :class:`Keyring` reads them again when they change (a ``stat`` of each at most every
``recheck_s``), so a running engine switches within seconds of the kubelet:

- values are sealed under the **current** key only, each carrying its key id (:mod:`.format`, version 3);
- a value is opened under the key its id names, the current or the **previous** one (counted: ``previous_reads``);
- a value under a key this replica does not hold -- a replica that switched earlier, or a key since removed -- is a
  ``key`` miss (counted, never decoded), not ``forged``: both sides of a rotation keep serving what they can open,
  and the forged count keeps meaning "someone without a key wrote this".

A replaced key file that cannot be used (unreadable, too short, equal to a credential of the store) keeps the keys
in use and is reported once per change; only at start is it an error. The store password and username are never
the tenant key: whoever can log in to the store could otherwise read and forge the tenant's values.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from ..config import REMOTE_KEY_RULE, ConfigError
from ..tiers.keys import read_mac_key
from .format import RemoteFormatError, Sealer, key_id_of

log = logging.getLogger("kvtier.remote")

__all__ = ["Keyring"]

# How often the key files' identity (inode, size, mtime) is compared with what was read: the kubelet's own sync of a
# changed Secret takes up to a minute, so a second more is nothing, and a stat per second is free.
DEFAULT_RECHECK_S = 1.0
FileStamp = tuple[int, int, int] | None


def _stamp(path: str | None) -> FileStamp:
    if path is None:
        return None
    try:
        st = os.stat(path)  # follows the kubelet's ..data symlink: a swap changes the inode
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Keyring:
    """The current and the previous tenant key of one scope and model, as :class:`~.format.Sealer` s.

    ``credentials``: the store's credentials by the field that holds them (``password_file``, ``username``); a key
    file holding the same bytes is refused. Thread-safe: the I/O threads seal and open concurrently; a reload swaps
    one immutable tuple.
    """

    def __init__(self, current_file: str, previous_file: str | None, scope: str, identity: str, *,
                 credentials: Mapping[str, bytes] | None = None, recheck_s: float = DEFAULT_RECHECK_S,
                 clock: Callable[[], float] = time.monotonic, on_previous_read: Callable[[], None] | None = None,
                 on_reload: Callable[[], None] | None = None) -> None:
        self._files = (current_file, previous_file)
        self._scope, self._identity = scope, identity
        self._credentials = dict(credentials or {})
        self._recheck_s = recheck_s
        self._clock = clock
        self._on_previous_read = on_previous_read
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self.previous_reads = 0
        self.reloads = 0
        stamps = (_stamp(current_file), _stamp(previous_file))
        self._sealers = self._load()  # at start a bad key is an error (ConfigError), as before rotation existed
        self._stamps = stamps
        self._checked_at = clock()

    # ------------------------------------------------------------------ loading

    def _key(self, path: str, field: str) -> bytes:
        key = read_mac_key(path)
        assert key is not None
        for other, credential in self._credentials.items():
            if credential and key == credential:
                raise ConfigError(f"{field}: holds the same bytes as {other}: {REMOTE_KEY_RULE}")
        return key

    def _load(self) -> tuple[Sealer, Sealer | None]:
        current_file, previous_file = self._files
        current = Sealer(self._key(current_file, "mac_key_file"), self._scope, self._identity)
        previous = None
        if previous_file is not None and os.path.exists(previous_file):
            sealer = Sealer(self._key(previous_file, "previous_mac_key_file"), self._scope, self._identity)
            previous = sealer if sealer.key_id != current.key_id else None
        return current, previous

    def refresh(self) -> bool:
        """Read the key files again if they changed since they were read; True when the keys in use changed. Called
        by :meth:`seal` and :meth:`open` at most every ``recheck_s``; tests call it directly."""
        stamps = (_stamp(self._files[0]), _stamp(self._files[1]))
        with self._lock:
            self._checked_at = self._clock()
            if stamps == self._stamps:
                return False
            self._stamps = stamps
            try:
                sealers = self._load()
            except ConfigError as err:
                log.error("remote tier %s: the tenant key files changed but cannot be used (%s); the keys in use "
                          "stay", self._scope, err)
                return False
            changed = tuple(s and s.key_id for s in sealers) != tuple(s and s.key_id for s in self._sealers)
            self._sealers = sealers
            if changed:
                self.reloads += 1
                if self._on_reload is not None:
                    self._on_reload()
                log.warning("remote tier %s: tenant keys reloaded (a previous key is %s)", self._scope,
                            "kept for reads" if sealers[1] is not None else "not present")
            return changed

    def _current(self) -> tuple[Sealer, Sealer | None]:
        if self._clock() - self._checked_at >= self._recheck_s:
            self.refresh()
        return self._sealers

    @property
    def key_ids(self) -> tuple[int, int | None]:
        """The ids of the current and the previous key (None: no previous key)."""
        current, previous = self._sealers
        return current.key_id, (previous.key_id if previous is not None else None)

    # ------------------------------------------------------------------ sealing

    def seal(self, buf: bytearray | memoryview, key: bytes, codec: str, payload: memoryview) -> int:
        return self._current()[0].seal(buf, key, codec, payload)

    def seal_parts(self, buf: bytearray | memoryview, key: bytes, codec: str, parts: Sequence[memoryview]) -> int:
        return self._current()[0].seal_parts(buf, key, codec, parts)

    def open(self, value: bytes | bytearray | memoryview, key: bytes, out: bytearray | memoryview,
             ) -> tuple[str, memoryview]:
        """Open a value under the key its id names (current or previous); ``key`` refusal for any other id."""
        current, previous = self._current()
        wanted = key_id_of(value)
        if wanted is None or wanted == current.key_id:
            try:
                return current.open(value, key, out)
            except RemoteFormatError as err:
                # A value of the format before key ids (version 2) names no key: the previous key may open it.
                if wanted is not None or previous is None or err.kind != "forged":
                    raise
        if previous is not None and wanted in (None, previous.key_id):
            opened = previous.open(value, key, out)
            with self._lock:
                self.previous_reads += 1
            if self._on_previous_read is not None:
                self._on_previous_read()
            return opened
        raise RemoteFormatError("key", f"written under a tenant key this replica does not hold (key id "
                                       f"{wanted:08x}: a rotation under way, or a key since removed)")
