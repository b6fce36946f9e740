"""A queue of the remote tier's work drained in batches by pool tasks: one round trip for many keys once there is a
backlog."""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["Lane"]

log = logging.getLogger("kvtier_runtime.remote")

Item = TypeVar("Item")


class Lane(Generic[Item]):
    """Items drained by up to ``workers`` tasks on ``pool``, each taking up to ``per_batch`` of what is queued and
    handing it to ``run`` as one batch; ``count`` is told +1/-1 around a running batch (the job queue's
    ``count_task``, so closing the tier waits for it)."""

    def __init__(self, pool: ThreadPoolExecutor, run: Callable[[list[Item]], None], workers: int, per_batch: int,
                 count: Callable[[int], None]) -> None:
        self._pool = pool
        self._run = run
        self._workers = workers
        self._per_batch = max(1, per_batch)
        self._count = count
        self._items: deque[Item] = deque()
        self._active = 0
        self._lock = threading.Lock()

    def put(self, items: Sequence[Item]) -> None:
        with self._lock:
            self._items.extend(items)
            spawn = self._active < self._workers
            if spawn:
                self._active += 1
        if spawn:
            try:
                self._pool.submit(self._drain)
            except RuntimeError:  # the pool is shut down (tier closing): the jobs expire
                with self._lock:
                    self._active -= 1

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._active -= 1
                    return
                n = min(len(self._items), self._per_batch)
                batch = [self._items.popleft() for _ in range(n)]
            self._count(1)
            try:
                self._run(batch)
            except Exception:  # a bug must not kill the lane: the batch's jobs expire as timeout
                log.exception("kvtier remote tier: a batch failed unexpectedly")
            finally:
                self._count(-1)
