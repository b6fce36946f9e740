"""One worker thread per key ("lane") for blocking work that must not delay anyone else's.

Why: an SLO evaluation blocks on its Prometheus (each query up to its total deadline,
``spec.slo.prometheus.timeout``, on an event loop of the query's own: ``slo.http``), and the reconciles run the blocking Kubernetes client on the event loop's default executor. Run on that
shared pool, a few slow Prometheus servers would hold every worker and stall the reconciles of every policy, and
the other policies' evaluations. In its own lane an evaluation can only delay the next evaluation of its own
policy. A lane's thread exists while its key does (``close``); idle, it costs a blocked thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class Lanes:
    def __init__(self, name: str = "lane"):
        self._name = name
        self._executors: dict[Hashable, concurrent.futures.ThreadPoolExecutor] = {}

    async def run(self, key: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in ``key``'s own thread; calls for one key run one at a time, in order."""
        executor = self._executors.get(key)
        if executor is None:
            executor = self._executors[key] = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self._name}-{len(self._executors)}")
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def close(self, key: Hashable) -> None:
        """Forget ``key``'s lane; a call still running finishes in the background, nothing waits for it."""
        executor = self._executors.pop(key, None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._executors)
