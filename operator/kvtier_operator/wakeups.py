"""Per-policy wake-ups: the operator's one custom queue, and why it is not kopf's.

A policy must be reconciled when *other* objects change (its workloads, the policies it conflicts with), not only
when it does; kopf's change handlers (``on.create``/``on.update``) fire for the object's own changes only, and re-running one from another resource's handler is not something kopf offers. So
each policy has a kopf daemon (kopf starts and stops it with the object, and cancels it on shutdown) that sleeps
on its wake-up here. Handlers of any resource call :meth:`Wakeups.trigger`; a burst of triggers before the daemon
wakes costs one reconcile (an ``asyncio.Event`` is set once), and :meth:`Wakeups.trigger_later` coalesces the
status-only updates a rollout produces into one deferred wake-up. The daemon also sleeps here until the SLO
guard's next evaluation, so one loop per policy serves both.
"""
from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any, Optional


class Wakeups:
    def __init__(self) -> None:
        self._events: dict[Hashable, asyncio.Event] = {}
        self._delayed: set[Hashable] = set()

    def trigger(self, key: Hashable) -> None:
        self._events.setdefault(key, asyncio.Event()).set()

    def trigger_later(self, key: Hashable, delay: float) -> None:
        """One deferred wake-up per key: further calls before it fires add nothing."""
        if key in self._delayed:
            return
        self._delayed.add(key)

        def fire() -> None:
            self._delayed.discard(key)
            self.trigger(key)

        asyncio.get_running_loop().call_later(delay, fire)

    async def wait(self, key: Hashable, timeout: float, stop: Optional[asyncio.Future[Any]] = None) -> bool:
        """Sleep until ``key`` is triggered (True), ``timeout`` passes or ``stop`` completes (False). Triggers
        that arrived since the last wait count: nothing is lost between two waits."""
        event = self._events.setdefault(key, asyncio.Event())
        wake = asyncio.ensure_future(event.wait())
        waiting = {wake} if stop is None else {wake, stop}
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
        woken = event.is_set()
        event.clear()
        return woken

    def forget(self, key: Hashable) -> None:
        self._events.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._events
