"""The operator in a background thread with its own event loop, for tests and benchmarks (not the product).

``HarnessOperator`` is the product's ``controller.Operator`` with the two seams filled for a harness: observers
called after every pass (``on_reconciled``) and a scripted measurement source for the SLO guard (``slo_source``)
instead of Prometheus.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Optional

from kvtier_operator.controller import Operator, Outcome
from kvtier_operator.handlers import Shared
from kvtier_operator.kube import Kube
from kvtier_operator.main import run
from kvtier_operator.metrics import Metrics
from kvtier_operator.settings import Settings

Key = tuple[str, str]


class HarnessOperator(Operator):
    def __init__(self, settings: Settings, kube: Kube, metrics: Optional[Metrics] = None):
        super().__init__(settings, kube, metrics)
        self.on_reconciled: list[Callable[[Key, Outcome], None]] = []
        self.slo_source: Optional[Callable[[str, str], Any]] = None

    def measurement_source(self, namespace: str, name: str) -> Optional[Any]:
        return self.slo_source(namespace, name) if self.slo_source is not None else None

    def reconciled(self, key: Key, outcome: Outcome) -> None:
        for hook in self.on_reconciled:
            hook(key, outcome)


class OperatorThread:
    """``stop()`` shuts it down like SIGTERM (and waits for the passes in flight)."""

    def __init__(self, settings: Settings, kube: Optional[Kube] = None, metrics: Optional[Metrics] = None):
        self.op = HarnessOperator(settings, kube or Kube(settings.kubeconfig), metrics)
        self.shared = Shared(self.op)  # the handlers' memo: event filter, wake-ups, lanes
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name="kvtier-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run(self.shared, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as err:
            self.error = err
            self._ready.set()

    def start(self, timeout: float = 30) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("operator did not get ready")
        if self.error:
            raise RuntimeError("operator failed to start") from self.error
        return self

    def stop(self, timeout: float = 30) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("operator did not stop")

    def is_alive(self) -> bool:
        return self._thread.is_alive()
