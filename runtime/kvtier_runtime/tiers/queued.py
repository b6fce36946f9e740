"""What every tier behind the host tier does the same way with its :class:`~.jobs.JobQueue`, written once: the
:class:`~.base.Tier` protocol's ``get_finished`` and ``close``, ``drain``, and use as a context manager."""
from __future__ import annotations

from typing import Self

from .jobs import JobQueue, JobResult

__all__ = ["QueuedTier"]


class QueuedTier:
    """A base for a tier whose jobs run through the :class:`JobQueue` it owns (``jobs``): its results, waiting for
    them and closing are the queue's. What else a tier must release when it closes (threads of its own, a store's
    connections) it hands the queue with :meth:`JobQueue.at_close`."""

    jobs: JobQueue

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each once); a job past its deadline finishes here with its
        unfinished keys failed as ``timeout``."""
        return self.jobs.get_finished()

    def drain(self, timeout: float | None = 60) -> None:
        """Wait until every submitted job finished (see :meth:`JobQueue.drain`)."""
        self.jobs.drain(timeout)

    def close(self) -> None:
        """Refuse new jobs, wait (bounded) for the running ones and release the tier's threads (see
        :meth:`JobQueue.close`); a second call does nothing."""
        self.jobs.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
