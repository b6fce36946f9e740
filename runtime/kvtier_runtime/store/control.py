"""The runtime's live control file: tiers an operator disables without restarting the engine (docs/breaker.md).

The file is a small JSON object, e.g. ``{"disabledTiers": ["nvme"], "generation": 3}``:

* ``disabledTiers``: names of this engine's tiers to bypass until they are removed from the list again (absent:
  none). A name is a tier's name (``tier_names`` in the spec's config) or its address (``host``, a filesystem
  tier's ``root_dir``, a remote tier's ``url``).
* ``generation``: an optional non-negative integer the writer bumps with each change; exported as the generation
  in force so the writer can see that the engine applied it.
* Other keys are ignored (room for later fields).

Reading it is built for a Kubernetes ConfigMap volume, which replaces its files by an atomic symlink swap
(``..data -> ..2026_...``): the path is stat-ed through the symlinks at most once per ``interval_s`` and read only
when the file behind it changed (device, inode, size or mtime); a file whose size or mtime changes while it is
read is read again at the next poll. A file over ``max_bytes``, not JSON or of the wrong shape keeps the last good
state: logged once per version of the file and counted by reason in :attr:`ControlFile.errors`. A name that is no
tier of this engine is ignored, logged and counted the same way, and the other names apply (a tier the operator
no longer renders must not void the rest of its list: a bypass is always safe). A missing file disables nothing.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..config import CONTROL_DISABLED_TIERS, CONTROL_FILE_MAX_BYTES, CONTROL_GENERATION

MAX_CONTROL_BYTES = CONTROL_FILE_MAX_BYTES
DEFAULT_POLL_INTERVAL_S = 1.0
# Reasons counted in ControlFile.errors.
TOO_LARGE, UNPARSABLE, INVALID, UNKNOWN_TIER, UNREADABLE = "too_large", "unparsable", "invalid", "unknown_tier", \
    "unreadable"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlState:
    """What a good control file says: the tiers it disables (as written) and its generation (None: not given)."""

    disabled: frozenset[str] = frozenset()
    generation: int | None = None
    # Names listed that are no tier of this engine: ignored (the others still apply), counted, logged.
    unknown: tuple[str, ...] = ()


class ControlError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_control(data: bytes, known: Collection[str] | None = None,
                  max_bytes: int = MAX_CONTROL_BYTES) -> ControlState:
    """The state a control file's bytes describe; :class:`ControlError` (with a ``reason``) names the field and the
    rule it broke. ``known``: the tier names this engine answers to (None: any name); other names are left out of
    ``disabled`` and listed in ``unknown``."""
    if len(data) > max_bytes:
        raise ControlError(TOO_LARGE, f"larger than {max_bytes} bytes")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ControlError(UNPARSABLE, f"not a JSON document ({exc})") from None
    if not isinstance(doc, dict):
        raise ControlError(INVALID, f"must be a JSON object, got {type(doc).__name__}")
    tiers = doc.get(CONTROL_DISABLED_TIERS, [])
    if not isinstance(tiers, list):
        raise ControlError(INVALID, f"{CONTROL_DISABLED_TIERS}: {tiers!r} must be a list of tier names")
    for i, name in enumerate(tiers):
        if not isinstance(name, str) or not name:
            raise ControlError(INVALID, f"{CONTROL_DISABLED_TIERS}[{i}]: {name!r} must be a non-empty string")
    generation = doc.get(CONTROL_GENERATION)
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                   or generation < 0):
        raise ControlError(INVALID, f"{CONTROL_GENERATION}: {generation!r} must be a non-negative integer")
    unknown = tuple(n for n in tiers if known is not None and n not in known)
    return ControlState(frozenset(n for n in tiers if n not in unknown), generation, unknown)


class ControlFile:
    """Polls one control file (see the module's docstring). :meth:`poll` is cheap enough for the scheduler's loop:
    it does nothing until ``interval_s`` has passed since the last look, then one ``stat``; it opens the file only
    when that changed."""

    def __init__(self, path: str, known: Collection[str] | None = None, *,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 max_bytes: int = MAX_CONTROL_BYTES, logger: logging.Logger | None = None) -> None:
        self.path = path
        self.known = None if known is None else frozenset(known)
        self.clock = clock
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.log = logger or log
        self.state = ControlState()  # the last good state, in force
        self.errors: Counter[str] = Counter()
        self._next_look = float("-inf")
        self._seen: tuple[object, ...] | None = None  # identity of the version last read (good or bad); () = missing

    def poll(self, force: bool = False) -> ControlState | None:
        """The new state when a new good version of the file (or its removal) was seen, else None."""
        now = self.clock()
        if not force and now < self._next_look:
            return None
        self._next_look = now + self.interval_s
        try:
            st = os.stat(self.path)  # through the symlinks: a swap shows as a new inode
        except FileNotFoundError:
            return self._missing()
        except OSError as exc:
            self._bad(("stat-error", exc.errno or 0), UNREADABLE, f"cannot stat it ({exc})")
            return None
        ident = _identity(st)
        if ident == self._seen:
            return None
        try:
            with open(self.path, "rb") as f:
                opened = _identity(os.fstat(f.fileno()))  # what is read, whatever the path points to by now
                if opened == self._seen:
                    return None
                if opened[2] > self.max_bytes:
                    self._bad(opened, TOO_LARGE, f"larger than {self.max_bytes} bytes ({opened[2]})")
                    return None
                data = f.read(self.max_bytes + 1)
                if _identity(os.fstat(f.fileno())) != opened:
                    return None  # written while read: read it again at the next poll, once it holds still
        except FileNotFoundError:
            return self._missing()
        except OSError as exc:
            self._bad(ident, UNREADABLE, f"cannot read it ({exc})")
            return None
        try:
            state = parse_control(data, self.known, self.max_bytes)
        except ControlError as err:
            self._bad(opened, err.reason, str(err))
            return None
        self._seen = opened
        if state.unknown:
            self.errors[UNKNOWN_TIER] += 1
            self.log.warning("kvtier: control file %s: %s: %s %s not a tier of this engine (%s); ignored, the other "
                             "names apply", self.path, CONTROL_DISABLED_TIERS, ", ".join(map(repr, state.unknown)),
                             "is" if len(state.unknown) == 1 else "are", ", ".join(sorted(self.known or ())))
            state = ControlState(state.disabled, state.generation)
        return self._apply(state)

    def _missing(self) -> ControlState | None:
        if self._seen == ():
            return None
        first = self._seen is None
        self._seen = ()
        if not first:
            self.log.info("kvtier: control file %s is gone: no tier is disabled by it any more", self.path)
        return self._apply(ControlState())

    def _bad(self, ident: tuple[object, ...], reason: str, message: str) -> None:
        if ident != self._seen:  # once per version of the file
            self._seen = ident
            self.errors[reason] += 1
            self.log.warning("kvtier: control file %s: %s; keeping the last good state (disabled tiers: %s, "
                             "generation %s)", self.path, message, ", ".join(sorted(self.state.disabled)) or "none",
                             self.state.generation)
        return None

    def _apply(self, state: ControlState) -> ControlState | None:
        if state == self.state:
            return None
        self.state = state
        return state


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
