"""``kvtier operator``: run the operator in this process."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Optional

import kopf

from .controller import Operator
from .handlers import REGISTRY, Shared, kopf_settings
from .kube import Kube
from .printable import PrintableFormatter
from .reconcile import prime
from .settings import from_args

log = logging.getLogger("kvtier.operator")


async def run(shared: Shared, *, stop_flag: Optional[threading.Event] = None,
              ready_flag: Optional[threading.Event] = None) -> None:
    """The operator on the running event loop until ``stop_flag`` (or a signal, in the main thread)."""
    s = shared.op.settings
    prime()
    loop = asyncio.get_running_loop()
    # Passes run the blocking client in threads; two cores still overlap many small API calls.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvtier"))
    await kopf.operator(
        registry=REGISTRY,
        settings=kopf_settings(s),
        memo=kopf.Memo(shared=shared),
        standalone=s.standalone or None,
        peering_name=None if s.standalone else s.peering_name,
        clusterwide=not s.namespaces,
        namespaces=list(s.namespaces),
        liveness_endpoint=s.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def install_log_escaping() -> None:
    """Every line the root logger writes goes through the one escape (printable): kopf's and ours."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(PrintableFormatter(LOG_FORMAT))


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = from_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.DEBUG if settings.verbose else logging.INFO)
    install_log_escaping()
    if not settings.verbose:
        # kopf logs "Handler ... succeeded" for every watch event, and aiohttp every probe: two lines per event of
        # every policy and workload, formatted and written on kopf's event loop (a tenth of its time at 500
        # policies, bench/operator_scale.py profiled). Failures are warnings and errors, still logged; --verbose
        # brings the rest back.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    op = Operator(settings, Kube(settings.kubeconfig))
    if settings.metrics_port is not None:
        port = op.metrics.serve(settings.metrics_port, settings.metrics_host)
        log.info("metrics on %s:%d/metrics", settings.metrics_host, port)
    try:
        asyncio.run(run(Shared(op)))
    except KeyboardInterrupt:
        pass
    finally:
        op.metrics.close()
        op.kube.close()
    return 0
