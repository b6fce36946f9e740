"""Waking an idle vLLM engine when the control file changes, so a tier the guard disables (or re-enables) leaves
(or re-enters) a router's index within seconds, traffic or not.

vLLM publishes KV cache events only from a scheduler step, and an idle engine core blocks on its input queue: a
disabled tier would stay in the index until the next request arrived -- the request a router then sends here for a
prefix this replica would recompute. So while the engine publishes events, a thread of the manager's watches the
control file (a ``stat`` every :data:`WATCH_S`: the kubelet swaps a ConfigMap volume's files by a symlink rename) and,
when it changed, puts vLLM's own ``WAKEUP`` sentinel into the engine core's input queue; the manager then asks for
steps (``has_pending_work``) for :data:`WAKE_S`, long enough for the books to read the file (at most once a second)
and announce what changed. Nothing else of the engine is touched.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from vllm.v1.engine import EngineCoreRequestType

from .caller_frames import find_in_callers

__all__ = ["ControlWatch", "WAKE_S", "engine_input_queue", "wake"]

_log = logging.getLogger(f"vllm.{__name__}")

WATCH_S = 1.0
WAKE_S = 2.5


def engine_input_queue(max_frames: int = 32) -> Any | None:
    """The input queue of the engine core building this manager (``EngineCoreProc.input_queue``), or None. vLLM
    hands an offloading spec no reference to its engine; the engine core that constructs the scheduler holds it a
    few frames up (it sets the queue before it builds the scheduler). Read-only and bounded; None where this vLLM
    builds the manager some other way (an idle engine then announces a control-file change at its next step)."""
    def inbox(local: dict[str, object]) -> Any | None:
        queue = getattr(local.get("self"), "input_queue", None)
        return queue if queue is not None and callable(getattr(queue, "put_nowait", None)) else None

    return find_in_callers(inbox, start=1, max_frames=max_frames)


def wake(inbox: Any) -> None:
    """vLLM's own sentinel: the engine core's loop takes it, does nothing with it, and asks ``has_work`` again."""
    inbox.put_nowait((EngineCoreRequestType.WAKEUP, None))


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class ControlWatch:
    """Calls ``on_change`` (on its own daemon thread) each time the file at ``path`` is replaced or rewritten."""

    def __init__(self, path: str, on_change: Callable[[], None], interval_s: float = WATCH_S) -> None:
        self.path = path
        self._on_change = on_change
        self._interval = interval_s
        self._stop = threading.Event()
        self._seen = _signature(path)
        self.changes = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-control-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            now = _signature(self.path)
            if now != self._seen:
                self._seen = now
                self.changes += 1
                try:
                    self._on_change()
                except Exception as exc:  # never into vLLM: the next step announces it anyway
                    _log.warning("kvtier: waking the engine for a control-file change failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
