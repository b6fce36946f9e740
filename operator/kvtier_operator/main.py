"""``kvtier operator``: run the operator in this process (``main``), or in a thread for tests (``OperatorThread``)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import sys
import threading
from typing import Optional, Sequence

import kopf

from .handlers import Operator, kopf_settings
from .kube import Kube
from .metrics import Metrics
from .reconcile import prime
from .settings import Settings, from_args

log = logging.getLogger("kvtier.operator")


def build(settings: Settings, kube: Optional[Kube] = None,
          metrics: Optional[Metrics] = None) -> tuple[Operator, kopf.OperatorRegistry]:
    op = Operator(settings, kube or Kube(settings.kubeconfig), metrics)
    registry = kopf.OperatorRegistry()
    op.register(registry)
    _register_slo(registry, op)
    return op, registry


def _register_slo(registry: kopf.OperatorRegistry, op: Operator) -> None:
    if importlib.util.find_spec(f"{__package__}.slo") is None:
        log.warning("the SLO guard (kvtier_operator.slo) is not installed; spec.slo is not enforced")
        return
    from .slo_timer import register_slo  # a broken guard fails loudly, never silently off

    register_slo(registry, op)


async def run(op: Operator, registry: kopf.OperatorRegistry, *, stop_flag: Optional[threading.Event] = None,
              ready_flag: Optional[threading.Event] = None) -> None:
    s = op.settings
    prime()
    loop = asyncio.get_running_loop()
    # Reconciles run the blocking client in threads; two cores still overlap many small API calls.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvtier"))
    await kopf.operator(
        registry=registry,
        settings=kopf_settings(s),
        standalone=s.standalone or None,
        peering_name=None if s.standalone else s.peering_name,
        clusterwide=not s.namespaces,
        namespaces=list(s.namespaces),
        liveness_endpoint=s.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = from_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.DEBUG if settings.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    op, registry = build(settings)
    if settings.metrics_port is not None:
        port = op.metrics.serve(settings.metrics_port, settings.metrics_host)
        log.info("metrics on %s:%d/metrics", settings.metrics_host, port)
    try:
        asyncio.run(run(op, registry))
    except KeyboardInterrupt:
        pass
    finally:
        op.metrics.close()
        op.kube.close()
    return 0


class OperatorThread:
    """The operator in a background thread with its own event loop; ``stop()`` shuts it down like SIGTERM."""

    def __init__(self, settings: Settings, kube: Optional[Kube] = None, metrics: Optional[Metrics] = None):
        self.op, self.registry = build(settings, kube, metrics)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name="kvtier-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run(self.op, self.registry, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as err:  # noqa: BLE001 - surfaced to the test through .error
            self.error = err
            self._ready.set()

    def start(self, timeout: float = 30) -> "OperatorThread":
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
